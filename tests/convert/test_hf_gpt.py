"""HuggingFace <-> zoo for GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2 / 3 / 4, SmolLM3, Phi-3, OLMo 2 / 3, Granite
and GPT-NeoX: logits equal at every layout, round trips bit-exact.

Small random HF models (with a tiny byte-level BPE tokenizer) are saved in a temporary folder, imported with
``hf_to_zoo`` and checked with ``verify`` in one 4-rank gloo pool at (tp, pp) in {(1,1), (2,1), (1,2), (2,2)}
(Qwen2 at (1,1) and (2,2); a windowed Mistral, a windowed Qwen3, OLMo 2 / 3, Granite, NeoX, Gemma 4 and the RoPE
variants, SmolLM3's NoPE layers, Phi-3's LongRoPE with partial rotary, Gemma 3's theta per layer type, at (2,1) and
(1,2));
one torchrun run of ``launch/convert.py verify`` at tp=3 (a 9-query, 3-key-value-head model) checks the command
end to end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from zoo.convert import io, registry
from zoo.convert.cli import main
from zoo.convert.errors import ConvertError
from zoo.convert.gpt import check_hf, hf_to_zoo
from zoo.convert.hf.gemma2 import table as gemma2_table
from zoo.convert.hf.gemma3 import table as gemma3_table
from zoo.convert.hf.gpt2 import table as gpt2_table
from zoo.convert.hf.llama import table as llama_table
from zoo.convert.hf.phi3 import table as phi3_table
from zoo.convert.hf.qwen3 import table as qwen3_table
from zoo.convert.hub import resolve_hf_folder
from zoo.convert.registry import ARCHITECTURES
from zoo.convert.tables import blocks, rows_of
from zoo.models.gpt import GPTConfig

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 300  # > the tokenizer's 290 entries; not a multiple of 128, so zoo pads it
EOS = 0  # the tokenizer's <|endoftext|>
TOL = 1e-4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)
BLOCK_TABLES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "GraniteForCausalLM", "GPTNeoXForCausalLM")


# ---------------------------------------------------------------------------------------------------------------
# Small HF models on disk
# ---------------------------------------------------------------------------------------------------------------


def save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>").save_pretrained(folder)


def randomize_(model, seed: int) -> None:
    """Weights away from their init (norms 1, biases 0), so a swapped norm or a dropped bias shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if "norm" in name or ".ln_" in name else noise)


def hf_gpt2(**overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**{**dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                bos_token_id=EOS, eos_token_id=EOS), **overrides}))


def hf_llama(tied=False, heads=4, kv_heads=2, hidden=64, intermediate=176, arch="llama", **overrides):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    config_cls, model_cls = {"mistral": (MistralConfig, MistralForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8, "rope_theta": 5000.0} if not tied else \
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    cfg = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
               num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-6,
               rope_parameters=rope, tie_word_embeddings=tied, bos_token_id=EOS, eos_token_id=EOS)
    return model_cls(config_cls(**{**cfg, **overrides}))


def hf_gemma2(**overrides):
    """A tiny Gemma 2: head_dim 24 != 64 / 4, a window of 5 (shorter than verify's sequence) on alternate layers,
    both soft-caps, query_pre_attn_scalar apart from head_dim, tied embeddings; eager attention (HF's reference)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=5,
               layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=20,
               attn_logit_softcapping=5.0, final_logit_softcapping=3.0, bos_token_id=EOS, eos_token_id=EOS,
               pad_token_id=EOS, attn_implementation="eager")
    return Gemma2ForCausalLM(Gemma2Config(**{**cfg, **overrides}))


def hf_olmo2(arch="olmo2", **overrides):
    """A tiny OLMo 2 (post-norm, q/k RMSNorm over the projection), head_dim 24 != 64 / 4, GQA, untied; OLMo 3 adds a
    window of 5 (shorter than verify's sequence) on the layers layer_types marks, and RoPE per layer type: YaRN on
    the full layers (as transformers puts a legacy rope_scaling), a plain theta of its own on the sliding ones."""
    from transformers import Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM

    config_cls, model_cls = {"olmo2": (Olmo2Config, Olmo2ForCausalLM), "olmo3": (Olmo3Config, Olmo3ForCausalLM)}[arch]
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
               bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    if arch == "olmo3":
        cfg.update(sliding_window=5, layer_types=["sliding_attention", "full_attention"], rope_parameters={
            "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                               "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    model = model_cls(config_cls(**{**cfg, **overrides}))
    model.config.head_dim = overrides.get("head_dim", 24)  # read by the attention (no field in the config class)
    return model_cls(model.config)


def hf_granite(**overrides):
    """A tiny Granite: all four multipliers away from 1 (the query scale apart from 1/sqrt(d)), attention biases
    without MLP biases, GQA, untied."""
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
               embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.5,
               attention_bias=True, mlp_bias=False, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    return GraniteForCausalLM(GraniteConfig(**{**cfg, **overrides}))


def hf_neox(**overrides):
    """A tiny GPT-NeoX (Pythia's block: parallel residual, exact GELU, biases, untied embed_out), rotating a quarter
    of each head (Pythia's rotary_pct 0.25: 4 of 16 features)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, layer_norm_eps=1e-5, tie_word_embeddings=False, use_parallel_residual=True,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
               bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**{**cfg, **overrides}))


def hf_smollm3(**overrides):
    """A tiny SmolLM3: NoPE on layers 1 and 3, a window of 5 on layer 1 only, head_dim 24 != 64 / 4, tied."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, max_position_embeddings=64, rms_norm_eps=1e-6,
               no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=5,
               layer_types=["full_attention", "sliding_attention", "full_attention", "full_attention"],
               rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, tie_word_embeddings=True,
               bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    return SmolLM3ForCausalLM(SmolLM3Config(**{**cfg, **overrides}))


# Phi-3's LongRoPE on the tiny shape: 4 factors (rotary dim 8 = head_dim 16 x 0.5), switching at 8 positions.
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 2.1, 3.7],
             "long_factor": [1.1, 2.5, 6.0, 14.0]}


def hf_phi3(**overrides):
    """A tiny Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, GQA, LongRoPE switching at 8 positions (shorter
    than verify's 16 tokens), partial_rotary_factor 0.5, untied."""
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=8,
               rms_norm_eps=1e-6, partial_rotary_factor=0.5, rope_parameters=dict(PHI3_ROPE),
               tie_word_embeddings=False, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    return Phi3ForCausalLM(Phi3Config(**{**cfg, **overrides}))


def hf_gemma3(**overrides):
    """A tiny Gemma 3 text model: Gemma 2's block (head_dim 24, window 5 on alternate layers, query_pre_attn_scalar
    20) with per-head q/k norm; full layers theta 1e6 with linear scaling 4, sliding ones theta 1e4."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=5,
               layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=20,
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
               bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS, attn_implementation="eager")
    return Gemma3ForCausalLM(Gemma3TextConfig(**{**cfg, **overrides}))
def hf_gemma4(**overrides):
    """A tiny Gemma 4 text model: sliding layers of head_dim 16 with 2 kv heads and a window of 5 (shorter than
    verify's sequence), full layers of head_dim 32 with 1 kv head and k = v, proportional RoPE on a quarter of the
    full layers' frequencies, layer scalars apart from 1, the final soft-cap, tied embeddings; eager attention (HF's
    reference)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
               attention_k_eq_v=True, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=5,
               layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=rope,
               final_logit_softcapping=3.0, hidden_size_per_layer_input=0, bos_token_id=EOS, eos_token_id=EOS,
               pad_token_id=EOS, attn_implementation="eager")
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**cfg, **overrides}))
    with torch.no_grad():  # the layer scalars are buffers (randomize_ moves parameters only): away from 1 too
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.25 * i)
    return model


CASES = {
    "gpt2": lambda: hf_gpt2(),
    "llama-untied": lambda: hf_llama(tied=False),
    "llama-tied": lambda: hf_llama(tied=True),
    "mistral": lambda: hf_llama(arch="mistral", sliding_window=None),
    "llama-9q3kv": lambda: hf_llama(heads=9, kv_heads=3, hidden=72, intermediate=96),
    # Qwen2: q/k/v biases (zoo's qkv_bias), GQA, its usual RoPE theta; the sliding window off as in its releases.
    "qwen2": lambda: hf_llama(arch="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                              use_sliding_window=False),
    "qwen2-tied": lambda: hf_llama(arch="qwen2", tied=True, kv_heads=1, use_sliding_window=False),
    "gemma2": lambda: hf_gemma2(),
    "gemma4": lambda: hf_gemma4(num_global_key_value_heads=2),  # 2 kv heads on every layer: tp 2 splits them
    "gemma4-1kv": lambda: hf_gemma4(),  # one kv head on the full layers: replicated at tp 2
    # Windows shorter than verify's 16 tokens: every layer (Mistral), the layers after max_window_layers (Qwen3,
    # with per-head q/k norm and head_dim 24 != 64 / 4).
    "mistral-window": lambda: hf_llama(arch="mistral", sliding_window=5),
    "qwen3": lambda: hf_llama(arch="qwen3", head_dim=24, use_sliding_window=True, sliding_window=5,
                              max_window_layers=1),
    # The block features of tests/models/test_block_features.py: post-norm + q/k norm over the projection (OLMo 2; OLMo
    # 3 with a window of 5 on its first layer), Granite's multipliers and attention biases, NeoX's parallel residual.
    "olmo2": lambda: hf_olmo2(),
    "olmo3": lambda: hf_olmo2("olmo3"),
    "granite": lambda: hf_granite(),
    "neox": lambda: hf_neox(),
    # RoPE variants (zoo.models.rope): NoPE layers, LongRoPE + partial rotary, per-layer-type theta.
    "smollm3": lambda: hf_smollm3(),
    "phi3": lambda: hf_phi3(),
    "gemma3": lambda: hf_gemma3(),
}
LAYOUT_CASES = ["gpt2", "llama-untied", "llama-tied"]
QWEN2_LAYOUTS = [(1, 1), (2, 2)]  # Qwen2 differs from Llama by its biases only: two layouts suffice
GEMMA2_LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # sandwich norms under SP-free TP, the tied soft-capped head over PP
GEMMA4_LAYOUTS = [(2, 1), (1, 2)]  # per-layer head shapes, k = v under TP, layer scalars over PP; tp 1: test_registry
WINDOW_CASES, WINDOW_LAYOUTS = ["mistral-window", "qwen3"], [(2, 1), (1, 2)]  # tp 1, pp 1: tests/convert/test_registry
BLOCK_CASES = ["olmo2", "olmo3", "granite", "neox"]  # at WINDOW_LAYOUTS too (tp 1: test_registry)
ROPE_CASES, ROPE_LAYOUTS = ["smollm3", "phi3", "gemma3"], [(2, 1), (1, 2)]  # tp 1, pp 1: tests/convert/test_registry
# tp above the kv heads (each kv head replicated over tp / nkv ranks): Qwen2 with one kv head (q/k/v biases) at tp 2
# and 4, the Llama's two kv heads at tp 4, Gemma 4's one kv head on its full layers (k = v) at tp 2.
KV_REPLICATED = {(2, 1): ["qwen2-tied", "gemma4-1kv"], (4, 1): ["qwen2-tied", "llama-untied"]}


def save_hf(model, folder: Path, seed: int = 0, **kwargs) -> Path:
    randomize_(model, seed)
    model.eval().save_pretrained(folder, **kwargs)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    return {name: save_hf(make(), root / name, seed=i) for i, (name, make) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def zoo_dirs(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    return {name: hf_to_zoo(folder, root / name) for name, folder in hf_dirs.items()}


def run_cli(capsys, *argv) -> tuple[int, str]:
    """``main(argv)``: exit code and stderr."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def assert_error(capsys, pattern: str, *argv) -> None:
    rc, err = run_cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    assert re.search(pattern, lines[0]), lines[0]


# ---------------------------------------------------------------------------------------------------------------
# Tables (pure)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama-untied", "llama-tied", "qwen2", "qwen2-tied", "qwen3", "gemma2",
                                  *BLOCK_CASES, "smollm3", "phi3", "gemma3"])
def test_tables_cover_the_checkpoint_and_invert(name):
    """Every HF tensor is read once, with the shape the table expects; to_hf(to_zoo(x)) gives x back exactly."""
    from zoo.convert.gpt import gpt_config_from_hf

    hf = CASES[name]()
    arch = type(hf).__name__
    cfg = gpt_config_from_hf(arch, hf.config)
    table = {"GPT2LMHeadModel": gpt2_table, "Gemma2ForCausalLM": gemma2_table, "Qwen3ForCausalLM": qwen3_table,
             "Gemma3ForCausalLM": gemma3_table, "Phi3ForCausalLM": phi3_table}.get(arch, llama_table)(cfg)
    rows = [r for group in blocks(table, cfg.num_hidden_layers) for r in group]
    if arch in BLOCK_TABLES:
        rows = rows_of(ARCHITECTURES[arch].groups(cfg))
    state = hf.state_dict()
    if arch == "GPTNeoXForCausalLM":  # transformers 5 holds embed_out as lm_head, saves it as embed_out
        state["embed_out.weight"] = state.pop("lm_head.weight")
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert sorted(k for r in rows for k in r.hf) == sorted(state)
    g = torch.Generator().manual_seed(0)
    for row in rows:
        assert [tuple(state[k].shape) for k in row.hf] == [tuple(s) for s in row.hf_shapes], row.zoo
        xs = [torch.randn(s, generator=g) for s in row.hf_shapes]
        back = row.hf_tensors(row.to_zoo(*xs))
        assert all(torch.equal(a, b) for a, b in zip(xs, back)), row.zoo


# ---------------------------------------------------------------------------------------------------------------
# verify at every layout (in gloo pools), and that it notices a wrong weight
# ---------------------------------------------------------------------------------------------------------------


def verify_cases(pairs, tp, pp):
    from zoo.convert.verify import verify

    return [verify(hf, zoo, tp, pp) for hf, zoo in pairs]


def test_verify_every_layout(hf_dirs, zoo_dirs, dist_run):
    """One pool of 4 ranks serves every layout (dp = 4 / (tp x pp) replicas; rank 0's replica is compared)."""
    for tp, pp in LAYOUTS + [(4, 1)]:
        names = ((LAYOUT_CASES if (tp, pp) in LAYOUTS else []) + (["qwen2"] if (tp, pp) in QWEN2_LAYOUTS else [])
                 + (WINDOW_CASES + BLOCK_CASES if (tp, pp) in WINDOW_LAYOUTS else [])
                 + (["gemma2"] if (tp, pp) in GEMMA2_LAYOUTS else [])
                 + (ROPE_CASES if (tp, pp) in ROPE_LAYOUTS else [])
                 + (["gemma4"] if (tp, pp) in GEMMA4_LAYOUTS else []) + KV_REPLICATED.get((tp, pp), []))
        pairs = [(str(hf_dirs[n]), str(zoo_dirs[n])) for n in names]
        per_rank = dist_run(4, verify_cases, pairs, tp, pp)
        assert all(r == per_rank[0] for r in per_rank)  # every rank returns rank 0's number
        for name, diff in zip(names, per_rank[0]):
            assert diff < TOL, f"{name} at tp={tp} pp={pp}: max |logit diff| {diff}"


def test_verify_notices_a_wrong_weight(hf_dirs, zoo_dirs, tmp_path, dist_run):
    """Heads rotated in one block's fused QKV (each tensor still the right shape): verify reports it."""
    d = 64 // 4
    tensors = ((k, t.roll(d, dims=0) if k == "1.attention.qkv.weight" else t)
               for k, t in io.iter_tensors(zoo_dirs["gpt2"]))
    _, config = io.read_config(zoo_dirs["gpt2"])
    io.write_model_folder(tmp_path / "bad", "gpt", config, tensors)
    good, bad = dist_run(4, verify_cases, [(str(hf_dirs["mistral"]), str(zoo_dirs["mistral"])),
                                           (str(hf_dirs["gpt2"]), str(tmp_path / "bad"))], 2, 2)[0]
    assert good < TOL  # Mistral without a sliding window is Llama
    assert bad > 1e-2


def checkpoint_bytes(folder) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def capped_and_whole(pairs, tp, shares, **kwargs):
    """verify_report of each pair with memory caps of each share of its HF checkpoint's size (0: 1 byte), then
    without one; the parameter count of every set of tensors ``io.load_tensors`` filled along the way (capped runs
    first, then the whole ones), and how many vocabulary-sized modules each HF run read from disk. Those weights are
    read 4 KB of rows at a time, so the tiny models' heads take many blocks (and, at tp 2, a padding block)."""
    from zoo.convert import io, verify

    real, filled, on_disk = io.load_tensors, [], []
    real_stream, block_bytes = verify.stream_offloaded_vocab, verify.ROW_BLOCK_BYTES

    def recording(folder, tensors, *args):
        filled.append(sum(t.numel() for t in tensors.values()))
        return real(folder, tensors, *args)

    def recording_stream(model):
        on_disk.append(real_stream(model))
        return on_disk[-1]

    io.load_tensors, verify.stream_offloaded_vocab, verify.ROW_BLOCK_BYTES = recording, recording_stream, 4096
    try:
        capped = [[verify.verify_report(hf, zoo, tp, max_memory=max(1, int(share * checkpoint_bytes(hf))),
                                        **kwargs) for share in shares] for hf, zoo in pairs]
        streamed = list(filled)
        filled.clear()
        whole = [verify.verify_report(hf, zoo, tp, **kwargs) for hf, zoo in pairs]
    finally:
        io.load_tensors, verify.stream_offloaded_vocab, verify.ROW_BLOCK_BYTES = real, real_stream, block_bytes
    return capped, whole, streamed, filled, on_disk


def check_capped(result, pairs, shares, layers, vocab_modules=2):
    """A capped verify gives the uncapped one's number; accelerate placed the HF modules as the cap allows (all on
    disk at 1 byte, some on the CPU at 3/4 of the checkpoint), at 1 byte the HF embedding and head read their rows
    from disk, and the zoo side filled one layer at a time (``layers`` fills per capped run; it and ``vocab_modules``
    a number, or one per pair)."""
    capped, whole, streamed, filled, on_disk = result
    for (hf, _), reports, ref in zip(pairs, capped, whole):
        assert ref.max_abs_diff < TOL and ref.hf_device_map is None
        for share, report in zip(shares, reports):
            assert report.max_abs_diff == pytest.approx(ref.max_abs_diff, abs=1e-6), (hf, share)
            devices = set(report.hf_device_map.values())
            assert devices == ({"disk"} if share == 0 else {"cpu", "disk"}), (hf, share, report.hf_device_map)
    vocab_modules = [vocab_modules] * len(pairs) if isinstance(vocab_modules, int) else vocab_modules
    assert on_disk[::len(shares)] == vocab_modules, on_disk
    layers = [layers] * len(pairs) if isinstance(layers, int) else layers
    assert len(streamed) == len(shares) * sum(layers) and len(filled) == len(pairs)
    assert max(streamed) < min(filled) / 2, "the zoo side held one layer at a time, never the model"


def test_verify_with_a_memory_cap_streams_both_sides(hf_dirs, zoo_dirs, dist_run):
    """--max-memory at tp=2: the zoo side one layer at a time, transformers through accelerate's device_map with
    disk offload; the same max |logit diff| as the uncapped verify."""
    # GPT-2: learned positions, its tied head read from the embedding's table; Llama: RoPE, an untied head; Qwen2
    # with one kv head: each block's replicated k/v rows read by both ranks; Granite: the streamed head's logits
    # divided by logits_scaling; Gemma 4: soft-capped, its blocks' shapes per layer type.
    names = ("gpt2", "llama-untied", "qwen2-tied", "granite", "gemma4-1kv")
    pairs = [(str(hf_dirs[name]), str(zoo_dirs[name])) for name in names]
    shares = [0, 0.75]
    result = dist_run(2, capped_and_whole, pairs, 2, shares)[0]
    # Filled per run: the embedding's other tensors (GPT-2's position table; its token table: only the batch's
    # rows), the blocks (2; Gemma 4's 4), the final norm; the head reads its rows as it computes.
    # Gemma 4's tied head is its embedding module (one vocabulary-sized module on disk; GPT-2 names it twice).
    check_capped(result, pairs, shares, layers=[1 + 2 + 1] * 4 + [1 + 4 + 1], vocab_modules=[2] * 4 + [1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc (Linux)")
def test_capped_verify_of_a_gpt2_124m_peaks_below_its_checkpoint_size(tmp_path):
    """launch/convert.py verify --max-memory 100MB on a GPT-2 124M shape (random, saved by save_pretrained, fp32,
    498 MB): the process's peak RSS (torch, DeepSpeed, transformers and accelerate loaded) stays below the
    checkpoint's size, and the check passes. Neither side ever holds the tied 154 MB embedding / LM head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(tmp_path / "hf")
    checkpoint = checkpoint_bytes(tmp_path / "hf")
    hf_to_zoo(tmp_path / "hf", tmp_path / "zoo")
    # VmHWM, not getrusage's ru_maxrss: that one keeps the peak of the process before its exec (this test's fork).
    peak = ("import runpy, sys\n"
            "sys.argv = sys.argv[1:]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "finally:\n    print('peak_rss_kb', next(line.split()[1] for line in open('/proc/self/status')\n"
            "                                   if line.startswith('VmHWM:')))\n")
    out = subprocess.run([sys.executable, "-c", peak, str(ROOT / "launch" / "convert.py"), "verify", "--hf",
                          str(tmp_path / "hf"), "--zoo", str(tmp_path / "zoo"), "--max-memory", "100MB"],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and re.fullmatch(r"max_abs_diff=(\S+)", lines[-2]), out.stdout + out.stderr
    assert float(lines[-2].split("=")[1]) < TOL
    peak_bytes = int(lines[-1].split()[1]) * 1024
    assert peak_bytes < checkpoint, f"peak RSS {peak_bytes / 1e6:.0f} MB, checkpoint {checkpoint / 1e6:.0f} MB"


def test_verify_command_tp3_torchrun(hf_dirs, zoo_dirs):
    """A 9-query, 3-key-value-head model runs at tp=3 (three processes); the last line is max_abs_diff=<float>."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", str(port),
           str(ROOT / "launch" / "convert.py"), "verify", "--hf", str(hf_dirs["llama-9q3kv"]),
           "--zoo", str(zoo_dirs["llama-9q3kv"]), "--tp", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.fullmatch(r"max_abs_diff=(\S+)", lines[-1])
    assert m, lines[-3:]
    assert float(m.group(1)) < TOL


# ---------------------------------------------------------------------------------------------------------------
# Round trips through the command line
# ---------------------------------------------------------------------------------------------------------------


def hf_tensors(folder: Path) -> dict:
    return {k: t for f in sorted(folder.glob("*.safetensors")) for k, t in load_file(f).items()}


@pytest.mark.parametrize("name,dtype,shard", [("gpt2", None, None), ("llama-untied", None, "40KB"),
                                              ("llama-tied", "bf16", None), ("qwen2", None, "40KB"),
                                              ("qwen2-tied", "bf16", None), ("mistral-window", None, None),
                                              ("qwen3", None, "40KB"), ("olmo2", None, None),
                                              ("olmo3", None, "40KB"), ("granite", "bf16", None), ("neox", None, None),
                                              ("smollm3", None, None), ("phi3", "bf16", "40KB"),
                                              ("gemma3", None, None), ("gemma4", None, "40KB")])
def test_round_trip_bit_exact_and_same_generation(name, dtype, shard, hf_dirs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, zoo, out = hf_dirs[name], tmp_path / "zoo", tmp_path / "hf"
    extra = (["--dtype", dtype] if dtype else []) + (["--max-shard-size", shard] if shard else [])
    assert run_cli(capsys, "hf-to-zoo", "--src", src, "--out", zoo, *extra)[0] == 0
    assert run_cli(capsys, "zoo-to-hf", "--src", zoo, "--out", out, *extra)[0] == 0
    # generation_config.json went into the zoo folder with the weights (before it was published), unchanged
    assert (zoo / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    if shard:  # both folders sharded, with an index
        assert (zoo / io.INDEX_FILE).is_file() and (out / "model.safetensors.index.json").is_file()
    assert {"config.json", "generation_config.json", "tokenizer.json", "README.md"} <= {p.name for p in out.iterdir()}

    original, exported = hf_tensors(src), hf_tensors(out)
    assert sorted(exported) == sorted(original)
    want = torch.bfloat16 if dtype == "bf16" else torch.float32
    for key, t in original.items():
        assert exported[key].dtype == want and torch.equal(exported[key], t.to(want)), key

    if shard:  # a sharded HF folder (index) imports back to the same zoo tensors
        again = dict(io.iter_tensors(hf_to_zoo(out, tmp_path / "zoo-again")))
        assert all(torch.equal(t, again[k]) for k, t in io.iter_tensors(zoo)) and len(again) == len(dict(
            io.iter_tensors(zoo)))

    tok = AutoTokenizer.from_pretrained(out)
    assert tok("the lazy dog").input_ids == AutoTokenizer.from_pretrained(src)("the lazy dog").input_ids
    a = AutoModelForCausalLM.from_pretrained(src, dtype=want).eval()
    b = AutoModelForCausalLM.from_pretrained(out).eval()
    assert b.dtype == want and type(b).__name__ == type(a).__name__
    ids = torch.tensor([tok("the quick brown fox").input_ids])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
        ga = a.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=EOS)
        gb = b.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=EOS)
    assert ga.shape[1] > ids.shape[1] and torch.equal(ga, gb)


def test_hub_id_from_the_cache(hf_dirs, tmp_path, monkeypatch):
    """A Hub id resolves through huggingface_hub's cache layout without the network (HF_HUB_OFFLINE)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--zoo-test--tiny-gpt2"
    shutil.copytree(hf_dirs["gpt2"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    out = hf_to_zoo("zoo-test/tiny-gpt2", tmp_path / "zoo", cache_dir=tmp_path / "cache")
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(io.iter_tensors(out), io.iter_tensors(
        hf_to_zoo(hf_dirs["gpt2"], tmp_path / "zoo-local"))))
    with pytest.raises(ConvertError, match="does not exist, nor is it a model id in the local HF cache"):
        resolve_hf_folder("zoo-test/not-there", cache_dir=tmp_path / "cache")


def test_legacy_gpt2_keys_and_unused_tensors(hf_dirs, tmp_path, capsys):
    """Checkpoints saved from GPT2Model have no "transformer." prefix and may hold the causal-mask buffers: they
    convert the same. A tensor the table does not know is refused rather than dropped."""
    legacy = tmp_path / "legacy"
    shutil.copytree(hf_dirs["gpt2"], legacy)
    state = {k.removeprefix("transformer."): t for k, t in load_file(legacy / "model.safetensors").items()}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    save_file(state, legacy / "model.safetensors", metadata={"format": "pt"})
    converted = dict(io.iter_tensors(hf_to_zoo(legacy, tmp_path / "zoo")))
    reference = dict(io.iter_tensors(hf_to_zoo(hf_dirs["gpt2"], tmp_path / "zoo-ref")))
    assert sorted(converted) == sorted(reference) and all(torch.equal(converted[k], reference[k]) for k in reference)
    state["h.0.attn.extra_scale"] = torch.ones(4)
    save_file(state, legacy / "model.safetensors", metadata={"format": "pt"})
    assert_error(capsys, r"1 tensor\(s\) the GPT2LMHeadModel table does not use, e\.g\. \['h\.0\.attn\.extra_scale'\]",
                 "hf-to-zoo", "--src", legacy, "--out", tmp_path / "zoo2")


def test_pickle_only_with_the_flag(hf_dirs, tmp_path, capsys):
    src = tmp_path / "pickled"
    shutil.copytree(hf_dirs["llama-tied"], src)
    state = load_file(src / "model.safetensors")
    torch.save(state, src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    assert_error(capsys, r"pickle checkpoint .*--allow-pickle", "hf-to-zoo", "--src", src, "--out", tmp_path / "z")
    assert not (tmp_path / "z").exists()
    assert run_cli(capsys, "hf-to-zoo", "--src", src, "--out", tmp_path / "z", "--allow-pickle")[0] == 0
    from_safetensors = dict(io.iter_tensors(hf_to_zoo(hf_dirs["llama-tied"], tmp_path / "z2")))
    assert all(torch.equal(t, from_safetensors[k]) for k, t in io.iter_tensors(tmp_path / "z"))


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line each, exit 2
# ---------------------------------------------------------------------------------------------------------------


def edited_copy(folder: Path, dst: Path, **config) -> Path:
    shutil.copytree(folder, dst)
    meta = json.loads((dst / "config.json").read_text())
    meta.update(config)
    (dst / "config.json").write_text(json.dumps(meta))
    return dst


def test_bad_input(hf_dirs, zoo_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    supported = "supported: " + ", ".join(registry.names("transformers"))  # every registered class, in order
    t5 = edited_copy(hf_dirs["gpt2"], tmp_path / "t5", architectures=["T5ForConditionalGeneration"], model_type="t5")
    assert_error(capsys, f"architecture T5ForConditionalGeneration is not supported; {supported}", "hf-to-zoo",
                 "--src", t5, "--out", out)
    # Windows shorter than the context import (they were refused before zoo's block had them): Mistral's on every
    # layer, Qwen2's on the layers its layer_types say (those from max_window_layers on).
    window = edited_copy(hf_dirs["mistral"], tmp_path / "window", sliding_window=16)
    assert run_cli(capsys, "hf-to-zoo", "--src", window, "--out", tmp_path / "window-zoo")[0] == 0
    assert io.read_config(tmp_path / "window-zoo")[1]["sliding_window"] == 16
    assert "layer_types" not in io.read_config(tmp_path / "window-zoo")[1]
    qwen_window = edited_copy(hf_dirs["qwen2"], tmp_path / "qwen-window", use_sliding_window=True, sliding_window=16,
                              layer_types=["full_attention", "sliding_attention"])
    assert run_cli(capsys, "hf-to-zoo", "--src", qwen_window, "--out", tmp_path / "qwen-window-zoo")[0] == 0
    config = io.read_config(tmp_path / "qwen-window-zoo")[1]
    assert (config["sliding_window"], config["layer_types"]) == (16, ["full_attention", "sliding_attention"])
    qwen_full = edited_copy(hf_dirs["qwen2"], tmp_path / "qwen-full", use_sliding_window=True, sliding_window=16,
                            max_window_layers=2, layer_types=["full_attention", "full_attention"])
    assert run_cli(capsys, "hf-to-zoo", "--src", qwen_full, "--out", tmp_path / "qwen-full-zoo")[0] == 0
    assert io.read_config(tmp_path / "qwen-full-zoo")[1]["qkv_bias"] is True
    assert "sliding_window" not in io.read_config(tmp_path / "qwen-full-zoo")[1]  # no layer slides: full attention
    qwen3_bias = edited_copy(hf_dirs["qwen3"], tmp_path / "qwen3-bias", attention_bias=True)
    assert_error(capsys, "Qwen3ForCausalLM: attention_bias=True is not supported", "hf-to-zoo", "--src", qwen3_bias,
                 "--out", out)
    act = edited_copy(hf_dirs["gpt2"], tmp_path / "relu", activation_function="relu")
    assert_error(capsys, "activation_function 'relu' is not supported", "hf-to-zoo", "--src", act, "--out", out)
    biased = edited_copy(hf_dirs["llama-tied"], tmp_path / "biased", attention_bias=True)
    assert_error(capsys, "attention_bias=True is not supported", "hf-to-zoo", "--src", biased, "--out", out)
    shape = edited_copy(hf_dirs["gpt2"], tmp_path / "shape", n_inner=128)
    assert_error(capsys, r"tensor transformer\.h\.0\.mlp\.c_fc\.weight: checkpoint has shape \(64, 256\), "
                 r"config\.json implies \(64, 128\)", "hf-to-zoo", "--src", shape, "--out", out)
    assert_error(capsys, "HF model folder /no/such/folder does not exist", "hf-to-zoo", "--src", "/no/such/folder",
                 "--out", out)
    assert_error(capsys, "model folder /no/such/zoo does not exist", "zoo-to-hf", "--src", "/no/such/zoo", "--out", out)
    assert_error(capsys, "model folder /no/such/zoo does not exist", "verify", "--hf", hf_dirs["gpt2"],
                 "--zoo", "/no/such/zoo")
    assert_error(capsys, "model folder /no/such/zoo does not exist", "--local_rank=0", "verify", "--hf",
                 hf_dirs["gpt2"], "--zoo", "/no/such/zoo")  # as the deepspeed launcher calls it
    assert_error(capsys, "is not a zoo model config.*hf-to-zoo", "zoo-to-hf", "--src", hf_dirs["gpt2"], "--out", out)
    # A layout the heads do not allow: named before any process group is made.
    assert_error(capsys, r"tp 4 does not divide num_attention_heads 9; tp must divide num_attention_heads 9 and "
                 r"intermediate_size 96, and divide or be a multiple of num_key_value_heads 3: use 1 or 3", "verify",
                 "--hf", hf_dirs["llama-9q3kv"], "--zoo", zoo_dirs["llama-9q3kv"], "--tp", "4")
    assert_error(capsys, "tp 8 does not divide num_attention_heads 4; .*: use 1, 2 or 4", "verify", "--hf",
                 hf_dirs["llama-untied"], "--zoo", zoo_dirs["llama-untied"], "--tp", "8")
    assert_error(capsys, "pp 3 exceeds num_hidden_layers 2", "verify", "--hf", hf_dirs["gpt2"], "--zoo",
                 zoo_dirs["gpt2"], "--pp", "3")
    assert_error(capsys, "--max-memory runs the zoo model one layer at a time in one pipeline stage, not at pp 2: "
                 "use --pp 1", "verify", "--hf", hf_dirs["gpt2"], "--zoo", zoo_dirs["gpt2"], "--pp", "2",
                 "--max-memory", "1GB")
    assert_error(capsys, "--max-memory must be a positive size", "verify", "--hf", hf_dirs["gpt2"], "--zoo",
                 zoo_dirs["gpt2"], "--max-memory", "0")
    with pytest.raises(ConvertError, match="are different models: hidden_size 64 vs 72"):
        check_hf(hf_dirs["gpt2"], GPTConfig.from_dict(io.read_config(zoo_dirs["llama-9q3kv"])[1]))
    # A zoo folder whose tensor does not fit its config.
    tensors = ((k, t[:, :32] if k == "2.mlp.fc2.weight" else t) for k, t in io.iter_tensors(zoo_dirs["llama-tied"]))
    io.write_model_folder(tmp_path / "badzoo", "gpt", io.read_config(zoo_dirs["llama-tied"])[1], tensors)
    assert_error(capsys, r"tensor 2\.mlp\.fc2\.weight: checkpoint has shape \(64, 32\), its config implies \(64, 176\)",
                 "zoo-to-hf", "--src", tmp_path / "badzoo", "--out", out)
    assert not out.exists() and not list(tmp_path.glob(".*tmp"))  # nothing half-written


class _RunsCode:
    """Unpickling this would run code (here: create a file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_runs_code_is_never_executed(hf_dirs, tmp_path, capsys):
    """A pytorch_model.bin whose unpickling would run code: refused by convert and by train --init without the
    flag; with --allow-pickle, torch.load(weights_only=True) refuses it without running it (one line)."""
    import pickle

    from zoo.training.train import main as train_main

    src = tmp_path / "evil"
    shutil.copytree(hf_dirs["llama-tied"], src)
    (src / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    with open(src / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _RunsCode(marker)}, f)
    assert_error(capsys, r"pickle checkpoint .*--allow-pickle", "hf-to-zoo", "--src", src, "--out", tmp_path / "z")
    assert_error(capsys, r"could not be read with torch.load\(weights_only=True\)", "hf-to-zoo", "--src", src,
                 "--out", tmp_path / "z", "--allow-pickle")
    assert train_main(["--init", str(src), "--steps", "1", "--out", str(tmp_path / "run"), "--set",
                       "training.seq_length=32", "data.source=synthetic"]) == 2
    assert "--init reads safetensors only: convert it once with launch/convert.py hf-to-zoo" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "z").exists() and not (tmp_path / "run").exists()
