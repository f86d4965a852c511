"""The block features of OLMo 2 / 3, Granite and GPT-NeoX in zoo's GPT (``norm_placement="post"``, ``qk_norm="full"``,
``use_parallel_residual``, ``activation="gelu_exact"``, ``mlp_bias``, ``residual_multiplier``, ``attention_multiplier``,
``logits_scaling``, ``embedding_multiplier``).

Against transformers: each architecture's tiny random model (tests/convert/test_hf_gpt.py's) imported by ``hf-to-zoo``
gives the same logits and the same greedy generation (zoo's KV cache) as transformers' own model. The fused LM head +
loss divides by ``logits_scaling`` as the plain head does (loss and gradients). Refusals are one line, naming the
field. Training: a tiny OLMo-2-like model (post-norm + q/k norm over the projection) and a tiny NeoX-like one
(parallel residual, LayerNorm, exact GELU, biases; with Granite's multipliers and the fused LM head + loss on top)
train the same in every layout as in one process (fp32, 1e-5 relative, 3 steps): tp2 + SP, pp2 (with and without
recompute), dp2 under ZeRO-2 (tests/training/test_gpt_layouts.py's runs) and cp2 with Ulysses and ring attention
(test_cp_layouts.py's runs).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.convert.test_hf_gpt import hf_granite, hf_neox, hf_olmo2, randomize_
from tests.training import test_cp_layouts as cp_layouts
from tests.training import test_gpt_layouts as gpt_layouts
from zoo.convert import io
from zoo.convert.errors import ConvertError
from zoo.convert.gpt import hf_to_zoo
from zoo.models.generate import Generator
from zoo.models.gpt import GPTConfig, GPTLoss, ParallelOptions, layer_specs
from zoo.models.specs import SpecSequential

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CASES = {
    "olmo2": lambda: hf_olmo2(),
    "olmo3": lambda: hf_olmo2("olmo3"),  # a window of 5 on its first layer
    "granite": lambda: hf_granite(),
    "neox": lambda: hf_neox(),
    "neox-sequential": lambda: hf_neox(use_parallel_residual=False, attention_bias=False),
}


def zoo_model(folder, par: ParallelOptions | None = None):
    """The zoo GPT of a zoo model folder, built in this process with its tensors."""
    cfg = GPTConfig.from_dict(io.read_config(folder)[1])
    model = SpecSequential(layer_specs(cfg, par or ParallelOptions())).eval()
    state, tensors = model.state_dict(), dict(io.iter_tensors(folder))
    assert sorted(state) == sorted(tensors)
    with torch.no_grad():
        for key, t in tensors.items():
            state[key][: t.shape[0]].copy_(t)  # padded vocabulary rows stay as they are
    return model, cfg


def pair(name, tmp_path, seed: int = 0):
    torch.manual_seed(seed)
    hf = CASES[name]().eval()
    randomize_(hf, seed)
    hf.save_pretrained(tmp_path / "hf")
    return hf, *zoo_model(hf_to_zoo(tmp_path / "hf", tmp_path / "zoo"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_greedy_generation_equal_transformers(name, tmp_path):
    hf, model, cfg = pair(name, tmp_path)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())  # norms and biases counted as HF has them
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))  # 20 > window 5
    with torch.no_grad():
        theirs, ours = hf(ids).logits, model(ids)[..., : cfg.vocab_size]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert ours.abs().max() > 1.0
    prompt = ids[:, :7]
    with torch.no_grad():
        greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(Generator(model).generate(prompt, max_new_tokens=10, eos_token_id=None, pad_token_id=0).tokens,
                       greedy)


def test_features_read_from_the_checkpoints(tmp_path):
    """The fields each architecture maps (so the logits above compare the features, not their absence)."""
    read = {}
    for name in ("olmo2", "olmo3", "granite", "neox"):
        torch.manual_seed(0)
        CASES[name]().save_pretrained(tmp_path / name)
        read[name] = io.read_config(hf_to_zoo(tmp_path / name, tmp_path / f"{name}-zoo"))[1]
    assert {k: read["olmo2"][k] for k in ("norm_placement", "qk_norm", "head_dim")} == {
        "norm_placement": "post", "qk_norm": "full", "head_dim": 24}
    assert (read["olmo3"]["sliding_window"], read["olmo3"]["layer_types"]) == (5, ["sliding_attention",
                                                                                   "full_attention"])
    assert (read["olmo3"]["rope_local_base_freq"], read["olmo3"]["rope_theta"],
            read["olmo3"]["rope_scaling"]["rope_type"]) == (1e4, 5e5, "yarn")
    assert {k: read["granite"][k] for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                            "logits_scaling", "add_bias", "mlp_bias")} == {
        "embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1, "logits_scaling": 2.5,
        "add_bias": True, "mlp_bias": False}
    assert {k: read["neox"][k] for k in ("use_parallel_residual", "activation", "normalization", "mlp_bias",
                                         "partial_rotary_factor")} == {
        "use_parallel_residual": True, "activation": "gelu_exact", "normalization": "layernorm", "mlp_bias": True,
        "partial_rotary_factor": 0.25}


def test_fused_head_and_loss_divide_by_logits_scaling():
    """The fused LM head + loss (hidden / s against the weight) gives the plain head's loss of logits / s, and the
    same gradients; without the division the loss would differ."""
    cfg = GPTConfig.from_preset("tiny-llama", logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.2)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, dims=1)
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = SpecSequential(layer_specs(cfg, ParallelOptions(fused_cross_entropy=fused)))
        loss = GPTLoss(cfg)(model(ids), labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_grads), (fused, fused_grads) = results
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)
    for name, g in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-4, atol=1e-7)
    unscaled = SpecSequential(layer_specs(GPTConfig.from_preset("tiny-llama", residual_multiplier=0.5,
                                                                attention_multiplier=0.2), ParallelOptions()))
    unscaled.load_state_dict(model.state_dict())
    assert abs(GPTLoss(cfg)(unscaled(ids), labels).item() - plain.item()) > 1e-3


@pytest.mark.parametrize("fields,message", [
    ({"attention_multiplier": 0.1, "query_pre_attn_scalar": 24}, "query_pre_attn_scalar and attention_multiplier "
                                                                  "both set the scores' scale"),
    ({"use_parallel_residual": True, "norm_placement": "post"}, "use_parallel_residual needs norm_placement 'pre'"),
    ({"norm_placement": "postnorm"}, "norm_placement must be one of"),
    ({"residual_multiplier": 0}, "residual_multiplier must be a positive number"),
    ({"logits_scaling": -1.0}, "logits_scaling must be a positive number"),
    ({"mlp_bias": "yes"}, "mlp_bias must be true, false or null"),
    ({"activation": "gelu_exact", "num_experts": 4}, "MoE layers have tanh-GELU experts only"),
])
def test_config_refusals(fields, message):
    with pytest.raises(ValueError, match=message) as err:
        GPTConfig.from_preset("tiny-llama", **fields)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name,edit,message", [
    # a rotary dim of int(16 x 0.0625) = 1 feature: odd, so no rotate-half pairs
    ("neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.0625}},
     r"RoPE needs an even rotary dim, got int\(head_dim 16 \* partial_rotary_factor 0.0625\) = 1"),
    ("neox", {"hidden_act": "gelu_new"}, "GPTNeoXForCausalLM: hidden_act 'gelu_new' is not supported"),
    ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                   "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     r"Olmo3ForCausalLM: rope_parameters\['sliding_attention'\] rope_type 'linear' is not supported"),
    ("olmo2", {"hidden_act": "gelu"}, "Olmo2ForCausalLM: hidden_act 'gelu' is not supported"),
])
def test_architecture_refusals(name, edit, message, tmp_path):
    torch.manual_seed(0)
    CASES[name]().save_pretrained(tmp_path / "hf")
    meta = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**meta, **edit}))
    with pytest.raises(ConvertError, match=message) as err:
        hf_to_zoo(tmp_path / "hf", tmp_path / "zoo")
    assert "\n" not in str(err.value) and not (tmp_path / "zoo").exists()


# Training: the tiny Llama of the layout tests with each block on top.
OLMO2 = ["model.norm_placement=post", "model.qk_norm=full"]
NEOX = ["model.use_parallel_residual=true", "model.partial_rotary_factor=0.5", "model.normalization=layernorm",
        "model.activation=gelu_exact",
        "model.add_bias=true", "model.residual_multiplier=0.5", "model.attention_multiplier=0.2",
        "model.logits_scaling=2.0", "model.embedding_multiplier=2.0", "training.fused_cross_entropy=true"]
BLOCKS = {"olmo2": OLMO2, "neox": NEOX}
LAYOUTS = ["tp2-sp", "pp2", "pp2-recompute", "dp2-zero2", "cp2-ulysses", "cp2-ring"]
_reference = {}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_block_trains_alike(dist_run, tmp_path_factory, block, layout):
    extra = BLOCKS[block]
    if layout.startswith("cp"):
        extra = [*extra, "training.steps=3"]
        if block not in _reference:
            _reference[block] = dist_run(1, cp_layouts.train_case, "llama", extra,
                                         str(tmp_path_factory.mktemp("ref")))[0]
        expected = _reference[block]
        world, overrides = cp_layouts.LAYOUTS[layout]
        runs = dist_run(world, cp_layouts.train_case, "llama", overrides + extra, str(tmp_path_factory.mktemp(layout)))
    else:
        expected = gpt_layouts.layout_run(dist_run, "llama", "single", extra)[0][0]
        runs = gpt_layouts.layout_run(dist_run, "llama", layout, extra)[0]
        plain = gpt_layouts.layout_run(dist_run, "llama", "single")[0][0]
        assert abs(expected[0] - plain[0]) > 1e-3, "the block's fields must change the model"
    for rank_losses in runs:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert len(expected) == 3 and expected[-1] < expected[0], f"the reference run must learn: {expected}"


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_block_trains_in_bf16(dist_run, block):
    """bf16 (DeepSpeed's bf16 optimizer, zoo's fp32 norm statistics) in one process: finite, within 2% of fp32 (as
    tests/training/test_gpt_layouts.py's bf16 runs)."""
    fp32 = gpt_layouts.layout_run(dist_run, "llama", "single", BLOCKS[block])[0][0]
    bf16 = gpt_layouts.layout_run(dist_run, "llama", "single", [*BLOCKS[block], "training.precision=bf16"])[0][0]
    assert all(torch.isfinite(torch.tensor(bf16))) and bf16 != fp32  # bf16 did run
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=2e-2, atol=0)
