"""zoo's GPT computes what HuggingFace transformers computes, given the same weights.

Each test builds a small HF model with random weights (GPT2LMHeadModel, LlamaForCausalLM or Qwen2ForCausalLM:
Llama with q/k/v biases, zoo's ``add_bias=False, qkv_bias=True``), copies them into
zoo's ``SpecSequential(layer_specs(cfg))`` through an explicit key table, and compares logits (and, in the
backward test, the loss and the word-embedding gradient). One plain process, tp=1, no torch.distributed: the
tensor-parallel layers fall back to their single-rank path.

The key tables are the converters' own (``zoo.convert.hf.gpt2``, ``zoo.convert.hf.llama``): ``Row(zoo key, HF keys,
HF shapes, to_zoo, to_hf)``. In a per-block row ``{}`` is the block index, ``i + 1`` on zoo's side (layer 0 is the
embedding) and ``i`` on HF's side. Here they fill a model in memory; tests/convert/test_hf_gpt.py runs them through
files.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from zoo.convert.hf.gpt2 import table as gpt2_table
from zoo.convert.hf.llama import table as llama_table
from zoo.convert.tables import same, transpose
from zoo.models.gpt import GPTConfig, GPTLoss, layer_specs
from zoo.models.specs import SpecSequential

VOCAB = 300  # not a multiple of 128: zoo pads it to 384, so the padding path is exercised
SEQ = 40  # > 16 (the llama3 case's original_max_position_embeddings) and long enough for RoPE scaling to matter
LOGITS_ATOL = 1e-4
LOSS_ATOL = GRAD_ATOL = 1e-5

ROPE_SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def load_from_hf(model: SpecSequential, hf, table: list, cfg: GPTConfig) -> None:
    """Copy HF's weights into ``model`` through ``table``; every zoo and HF tensor must be covered exactly once.

    A zoo tensor with more rows than its source is a padded-vocabulary tensor (word embedding, LM head): HF's
    ``vocab_size`` rows go first, zoo's padding rows keep their initial values (they must not matter).
    """
    zoo_sd, hf_sd = model.state_dict(), hf.state_dict()
    written, read = set(), set()
    for row in table:
        blocks = range(cfg.num_hidden_layers) if "{}" in row.zoo else [None]
        for i in blocks:
            r = row.at(i)
            value, dst = r.to_zoo(*(hf_sd[k] for k in r.hf)), zoo_sd[r.zoo]
            if value.shape != dst.shape:
                assert (value.shape[0], dst.shape[0]) == (cfg.vocab_size, cfg.padded_vocab_size()), (r.zoo, value.shape)
                assert value.shape[1:] == dst.shape[1:], (r.zoo, value.shape, dst.shape)
            with torch.no_grad():
                dst[: value.shape[0]].copy_(value)  # state_dict() tensors share storage with the parameters
            assert r.zoo not in written, f"{r.zoo} written twice"
            written.add(r.zoo)
            read.update(r.hf)
    assert written == set(zoo_sd), f"zoo tensors not loaded: {sorted(set(zoo_sd) - written)}"
    unread = set(hf_sd) - read
    if cfg.tie_word_embeddings:  # HF lists the tied head under its own name; it is the embedding tensor
        assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
        unread.discard("lm_head.weight")
    assert not unread, f"HF tensors not used: {sorted(unread)}"


# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------


def randomize_(hf, seed: int) -> None:
    """Move every HF weight away from its init (norm weights 1, biases 0, std 0.02), so that a swapped norm,
    a dropped bias or a mis-ordered head cannot go unnoticed, and logits are O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if "norm" in name or ".ln_" in name else noise)


def gpt2_pair(seed: int = 0):
    torch.manual_seed(seed)
    hf_cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=VOCAB - 1,
                        eos_token_id=VOCAB - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = GPT2LMHeadModel(hf_cfg).eval()
    randomize_(hf, seed)
    cfg = GPTConfig.from_preset("tiny", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                max_position_embeddings=64, norm_eps=hf_cfg.layer_norm_epsilon)
    assert hf_cfg.activation_function == "gelu_new"  # zoo's "gelu" is the tanh approximation
    model = SpecSequential(layer_specs(cfg)).eval()
    return hf, model, cfg, gpt2_table(cfg)


def llama_pair(tied: bool, nkv: int, rope_scaling: dict | None, seed: int = 0):
    torch.manual_seed(seed)
    theta = 10000.0
    # transformers 5 takes RoPE settings as one dict, `rope_parameters` (theta included).
    rope_parameters = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": theta}
    hf_cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=nkv, max_position_embeddings=64, rms_norm_eps=1e-6,
                         rope_parameters=rope_parameters, tie_word_embeddings=tied, attention_bias=False,
                         mlp_bias=False)
    assert hf_cfg.rope_parameters == rope_parameters
    hf = LlamaForCausalLM(hf_cfg).eval()
    randomize_(hf, seed)
    cfg = GPTConfig.from_preset("tiny-llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=nkv,
                                max_position_embeddings=64, norm_eps=1e-6, rope_theta=theta,
                                rope_scaling=None if rope_scaling is None else dict(rope_scaling),
                                tie_word_embeddings=tied)
    model = SpecSequential(layer_specs(cfg)).eval()
    return hf, model, cfg, llama_table(cfg)


def qwen2_pair(tied: bool, nkv: int, seed: int = 0):
    """Qwen2: Llama's layout plus biases on q, k and v (fused into zoo's per-group QKV bias), RoPE theta 1e6."""
    torch.manual_seed(seed)
    theta = 1e6
    hf_cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=nkv, max_position_embeddings=64, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": theta}, tie_word_embeddings=tied,
                         use_sliding_window=False)
    hf = Qwen2ForCausalLM(hf_cfg).eval()
    randomize_(hf, seed)
    cfg = GPTConfig.from_preset("tiny-llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=nkv,
                                max_position_embeddings=64, norm_eps=1e-6, rope_theta=theta, qkv_bias=True,
                                tie_word_embeddings=tied)
    model = SpecSequential(layer_specs(cfg)).eval()
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()
    return hf, model, cfg, llama_table(cfg)


def token_ids(batch: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    ids[0, :3] = torch.tensor([0, VOCAB - 1, VOCAB - 2])  # the vocabulary's edges, next to zoo's padding rows
    return ids


def max_logit_diff(model, hf, cfg, ids) -> float:
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids).logits
    assert ours.shape == (*ids.shape, cfg.padded_vocab_size())
    assert theirs.shape == (*ids.shape, cfg.vocab_size)
    return (ours[..., : cfg.vocab_size] - theirs).abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------


def test_gpt2_logits_match():
    hf, model, cfg, table = gpt2_pair()
    load_from_hf(model, hf, table, cfg)
    ids = token_ids(seq=64)  # the full learned-position table
    assert max_logit_diff(model, hf, cfg, ids) < LOGITS_ATOL


def test_gpt2_mapping_has_teeth():
    """The comparison is sensitive: c_attn copied without the per-head regrouping gives different logits."""
    hf, model, cfg, table = gpt2_pair()
    naive = [replace(r, to_zoo=transpose if r.zoo.endswith("qkv.weight") else same if r.zoo.endswith("qkv.bias")
                     else r.to_zoo) for r in table]
    load_from_hf(model, hf, naive, cfg)
    assert max_logit_diff(model, hf, cfg, token_ids()) > 1e-2


@pytest.mark.parametrize("rope", list(ROPE_SCALINGS))
@pytest.mark.parametrize("nkv", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_logits_match(tied, nkv, rope):
    hf, model, cfg, table = llama_pair(tied, nkv, ROPE_SCALINGS[rope])
    load_from_hf(model, hf, table, cfg)
    assert max_logit_diff(model, hf, cfg, token_ids()) < LOGITS_ATOL


@pytest.mark.parametrize("nkv", [1, 2])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen2_logits_match(tied, nkv):
    hf, model, cfg, table = qwen2_pair(tied, nkv)
    assert dict(model.named_parameters())["1.attention.qkv.bias"].shape == ((4 + 2 * nkv) * 16,)
    assert "1.attention.dense.bias" not in dict(model.named_parameters())  # only the QKV has a bias
    load_from_hf(model, hf, table, cfg)
    assert max_logit_diff(model, hf, cfg, token_ids()) < LOGITS_ATOL


def test_qwen2_bias_mapping_has_teeth():
    """The q/k/v biases matter: fused without the per-group regrouping (plain [q; k; v]) the logits differ."""
    hf, model, cfg, table = qwen2_pair(False, 2)
    naive = [replace(r, to_zoo=lambda q, k, v: torch.cat([q, k, v])) if r.zoo.endswith("qkv.bias") else r
             for r in table]
    load_from_hf(model, hf, naive, cfg)
    assert max_logit_diff(model, hf, cfg, token_ids()) > 1e-2


def test_rope_scaling_matters_at_this_length():
    """Guards the parametrization above: at SEQ positions each scaling changes HF's own logits."""
    ids = token_ids()
    logits = {}
    for rope, scaling in ROPE_SCALINGS.items():
        hf = llama_pair(False, 2, scaling)[0]
        with torch.no_grad():
            logits[rope] = hf(ids).logits
    assert (logits["linear"] - logits["none"]).abs().max() > 1e-2
    assert (logits["llama3"] - logits["none"]).abs().max() > 1e-2
    assert (logits["llama3"] - logits["linear"]).abs().max() > 1e-2


PAIRS = {
    "gpt2": lambda: gpt2_pair(),
    "llama-untied": lambda: llama_pair(False, 2, ROPE_SCALINGS["llama3"]),
    "llama-tied": lambda: llama_pair(True, 1, ROPE_SCALINGS["linear"]),
    "qwen2": lambda: qwen2_pair(False, 2),
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_loss_and_embedding_grad_match(pair):
    hf, model, cfg, table = PAIRS[pair]()
    load_from_hf(model, hf, table, cfg)
    ids = token_ids(seq=SEQ + 1)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    # zoo: inputs and labels shifted by the caller.
    model.zero_grad()
    loss = GPTLoss(cfg)(model(inputs), labels)
    loss.backward()
    word_embeddings = dict(model.named_parameters())[table[0].zoo]
    zoo_grad = word_embeddings.grad[: cfg.vocab_size]

    # HF: shifts internally. Its logits at the last position see one more token than zoo's inputs, but the
    # causal mask keeps every earlier position's logits equal to those on `inputs` (checked below).
    hf.zero_grad()
    hf_loss = hf(ids, labels=ids).loss
    hf_loss.backward()
    hf_grad = hf.get_input_embeddings().weight.grad
    with torch.no_grad():
        ref = F.cross_entropy(hf(inputs).logits.flatten(0, 1), labels.flatten())

    assert abs(hf_loss.item() - ref.item()) < LOSS_ATOL
    assert abs(loss.item() - ref.item()) < LOSS_ATOL, (loss.item(), ref.item())
    assert hf_grad.shape == zoo_grad.shape
    assert hf_grad.abs().max() > 1e-3  # a gradient worth comparing
    assert (zoo_grad - hf_grad).abs().max().item() < GRAD_ATOL
    # The padding rows are never looked up and get probability 0 in the loss: no gradient.
    assert word_embeddings.grad[cfg.vocab_size:].abs().max().item() == 0.0
