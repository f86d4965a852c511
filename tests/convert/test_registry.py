"""Every registered HF architecture goes through the same generic code path: hf-to-zoo, verify at tp 1 in this
process, zoo-to-hf bit-exact with the original tensors (``zoo.convert.registry``); a causal LM's export loads in
transformers as the same model (the same logits).

Each case is a tiny random model made from its own transformers / diffusers config class, the same small models
the per-family tests use (tests/convert/test_hf_gpt.py, test_hf_moe.py, test_hf_bert.py, test_diffusers_cli.py).
An architecture registered without an entry in ``MODELS`` fails :func:`test_every_architecture_has_a_case`, so
adding one means adding its line here (docs/adding-a-model.md). ``VARIANTS`` are further cases of a class (a
feature off where ``MODELS`` has it on). Windows are shorter than verify's 16 tokens (``WINDOW``), so they bite.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.convert import test_diffusers_cli as unet_cases
from tests.convert import test_hf_bert as bert_cases
from tests.convert import test_hf_gpt as gpt_cases
from tests.convert import test_hf_moe as moe_cases
from zoo.convert.cli import main
from zoo.convert.errors import ConvertError
from zoo.convert.gpt import export_architecture
from zoo.convert.registry import ARCHITECTURES, FAMILIES, hf_family
from zoo.models.gpt import FAMILY, GPTConfig

TOL = 1e-4
WINDOW = 5  # < verify's default --seq 16
CONVERT = Path(__file__).resolve().parents[2] / "zoo" / "convert"


def _randomized(model, seed: int = 0):
    gpt_cases.randomize_(model, seed)
    return model.eval()


# One tiny model per registered HF class: how to make it.
MODELS = {
    "GPT2LMHeadModel": lambda: _randomized(gpt_cases.hf_gpt2()),
    "LlamaForCausalLM": lambda: _randomized(gpt_cases.hf_llama(tied=False)),
    "MistralForCausalLM": lambda: _randomized(gpt_cases.hf_llama(arch="mistral", sliding_window=WINDOW)),
    # layer_types mixed, in an order max_window_layers cannot say: the list is what is read and written
    "Qwen2ForCausalLM": lambda: _randomized(gpt_cases.hf_llama(
        arch="qwen2", use_sliding_window=True, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"])),
    # head_dim 24 != 64 / 4; the window on the layers from max_window_layers 1 on (layer_types derived)
    "Qwen3ForCausalLM": lambda: _randomized(gpt_cases.hf_llama(
        arch="qwen3", head_dim=24, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "MixtralForCausalLM": lambda: _randomized(moe_cases.hf_model("mixtral")),
    "Qwen2MoeForCausalLM": lambda: _randomized(moe_cases.hf_model("qwen2-moe")),
    "Qwen3MoeForCausalLM": lambda: _randomized(moe_cases.hf_model("qwen3-moe")),
    "OlmoeForCausalLM": lambda: _randomized(moe_cases.hf_model("olmoe")),
    "Gemma2ForCausalLM": lambda: _randomized(gpt_cases.hf_gemma2()),
    # post-norm, q/k norm over the projection, head_dim 24 != 64 / 4; OLMo 3 with a window on its first layer
    "Olmo2ForCausalLM": lambda: _randomized(gpt_cases.hf_olmo2()),
    "Olmo3ForCausalLM": lambda: _randomized(gpt_cases.hf_olmo2("olmo3")),
    "GraniteForCausalLM": lambda: _randomized(gpt_cases.hf_granite()),  # four multipliers, q/k/v/o biases
    "GPTNeoXForCausalLM": lambda: _randomized(gpt_cases.hf_neox()),  # parallel residual, exact GELU, biases
    "Gemma3ForCausalLM": lambda: _randomized(gpt_cases.hf_gemma3()),
    "Phi3ForCausalLM": lambda: _randomized(gpt_cases.hf_phi3()),
    "SmolLM3ForCausalLM": lambda: _randomized(gpt_cases.hf_smollm3()),
    "Gemma4ForCausalLM": lambda: _randomized(gpt_cases.hf_gemma4()),
    "BertModel": lambda: bert_cases.hf_model("BertModel"),
    "BertForMaskedLM": lambda: bert_cases.hf_model("BertForMaskedLM"),
    "BertForPreTraining": lambda: bert_cases.hf_model("BertForPreTraining"),
    "BertForSequenceClassification": lambda: bert_cases.hf_model("BertForSequenceClassification"),
    "UNet2DModel": lambda: unet_cases.random_unet2d(),
}
# Further cases of a class, "<class>:<what>": head_dim apart, without the window (Mistral exports back as Llama), tied.
VARIANTS = {
    "LlamaForCausalLM:head-dim": lambda: _randomized(gpt_cases.hf_llama(head_dim=24)),
    "MistralForCausalLM:no-window": lambda: _randomized(gpt_cases.hf_llama(arch="mistral", sliding_window=None)),
    "Qwen2ForCausalLM:no-window": lambda: _randomized(gpt_cases.hf_llama(arch="qwen2", use_sliding_window=False)),
    "Qwen3ForCausalLM:tied-no-window": lambda: _randomized(gpt_cases.hf_llama(arch="qwen3", tied=True, kv_heads=1,
                                                                              head_dim=16)),
    "Olmo2ForCausalLM:bias-tied": lambda: _randomized(gpt_cases.hf_olmo2(attention_bias=True, tie_word_embeddings=True,
                                                                        head_dim=16)),
    "GraniteForCausalLM:mlp-bias": lambda: _randomized(gpt_cases.hf_granite(attention_bias=False, mlp_bias=True,
                                                                            attention_multiplier=1.0)),
    "GPTNeoXForCausalLM:sequential-no-attention-bias": lambda: _randomized(gpt_cases.hf_neox(
        use_parallel_residual=False, attention_bias=False)),
    # Llama reads and writes YaRN (its attention factor from mscale / mscale_all_dim) and LongRoPE (switching at 8
    # positions, inside verify's 16), both past their original length here.
    "LlamaForCausalLM:yarn": lambda: _randomized(gpt_cases.hf_llama(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 16.0, "mscale": 1.2, "mscale_all_dim": 0.7})),
    "LlamaForCausalLM:longrope": lambda: _randomized(gpt_cases.hf_llama(rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
        "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0], "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0,
                                                                                20.0]})),
    # The MoE models of MODELS have windows (test_hf_moe.hf_model); these without
    "MixtralForCausalLM:no-window": lambda: _randomized(moe_cases.hf_model("mixtral", window=None)),
    "Qwen2MoeForCausalLM:no-window": lambda: _randomized(moe_cases.hf_model("qwen2-moe", window=None)),
    "Qwen3MoeForCausalLM:no-window": lambda: _randomized(moe_cases.hf_model("qwen3-moe", window=None)),
    "GraniteForCausalLM:mlp-bias-tied": lambda: _randomized(gpt_cases.hf_granite(
        attention_bias=False, mlp_bias=True, attention_multiplier=1.0, tie_word_embeddings=True)),
    "GPTNeoXForCausalLM:sequential-no-attention-bias-tied": lambda: _randomized(gpt_cases.hf_neox(
        use_parallel_residual=False, attention_bias=False, tie_word_embeddings=True)),
}


def test_every_architecture_has_a_case():
    assert sorted(MODELS) == ARCHITECTURES.names(), "give every registered HF architecture a line in MODELS"


def test_every_family_an_architecture_imports_into_is_convertible():
    assert {ARCHITECTURES[name].family for name in ARCHITECTURES} <= set(FAMILIES)


def hf_tensors(folder: Path) -> dict:
    return {k: t for f in sorted(folder.glob("*.safetensors")) for k, t in load_file(f).items()}


def cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    return rc, out.out


def same_causal_lm(src: Path, out: Path) -> None:
    """The exported folder loads in transformers as the original model: its logits over 20 tokens (past the
    windows), of the same class unless a windowless Mistral came back as Llama."""
    from transformers import AutoModelForCausalLM

    a, b = (AutoModelForCausalLM.from_pretrained(f).eval() for f in (src, out))
    windowless = getattr(a.config, "sliding_window", None) is None
    assert type(b) is type(a) or (type(a).__name__, type(b).__name__, windowless) == (
        "MistralForCausalLM", "LlamaForCausalLM", True)
    ids = torch.randint(0, a.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(a(ids).logits, b(ids).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", sorted(MODELS) + sorted(VARIANTS))
def test_import_verify_export(case, tmp_path, capsys, monkeypatch):
    """hf-to-zoo picks the architecture's family from the registry, verify (tp 1, this process) finds the same
    outputs, zoo-to-hf writes every original tensor back bit for bit (and a causal LM the same model)."""
    name = case.split(":")[0]
    if ARCHITECTURES[name].library == "diffusers":
        pytest.importorskip("diffusers")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ZOO_WORLD_OF_ONE"):
        monkeypatch.delenv(var, raising=False)  # restored afterwards: verify makes this process a world of one
    src, zoo, out = tmp_path / "hf", tmp_path / "zoo", tmp_path / "back"
    torch.manual_seed(0)
    {**MODELS, **VARIANTS}[case]().save_pretrained(src)
    assert hf_family(src) == ARCHITECTURES[name].family

    cli(capsys, "hf-to-zoo", "--src", src, "--out", zoo)
    lines = cli(capsys, "verify", "--hf", src, "--zoo", zoo)[1].strip().splitlines()
    m = re.fullmatch(r"max_abs_diff=(\S+)", lines[-1])
    assert m and float(m.group(1)) < TOL, lines[-3:]
    cli(capsys, "zoo-to-hf", "--src", zoo, "--out", out)

    original, exported = hf_tensors(src), hf_tensors(out)
    assert sorted(exported) == sorted(original)
    for key, t in original.items():
        assert exported[key].dtype == t.dtype and torch.equal(exported[key], t), key
    if ARCHITECTURES[name].family == FAMILY:
        same_causal_lm(src, out)


MIXED = ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("fields,arch", [
    ({}, "LlamaForCausalLM"),
    ({"head_dim": 24}, "LlamaForCausalLM"),
    ({"sliding_window": 8}, "MistralForCausalLM"),
    ({"sliding_window": 8, "layer_types": ["sliding_attention"] * 4}, "MistralForCausalLM"),
    ({"qkv_bias": True}, "Qwen2ForCausalLM"),
    ({"qkv_bias": True, "sliding_window": 8, "layer_types": MIXED}, "Qwen2ForCausalLM"),
    ({"qk_norm": "head"}, "Qwen3ForCausalLM"),
    ({"qk_norm": "head", "head_dim": 24, "sliding_window": 8, "layer_types": MIXED}, "Qwen3ForCausalLM"),
    ({"qk_norm": "head", "num_experts": 4, "add_bias": False}, "Qwen3MoeForCausalLM"),
    ({"num_experts": 4, "sliding_window": 8}, "MixtralForCausalLM"),
    ({"qk_norm": "head", "num_experts": 4, "sliding_window": 8}, "Qwen3MoeForCausalLM"),
    ({"qkv_bias": True, "num_experts": 4, "num_shared_experts": 1, "shared_expert_gate": True, "sliding_window": 8,
      "layer_types": MIXED}, "Qwen2MoeForCausalLM"),
    # no class holds these: refused in one line naming the fields
    ({"sliding_window": 8, "layer_types": MIXED}, None),
    ({"qkv_bias": True, "head_dim": 24}, None),
    ({"qk_norm": "full"}, None),
    ({"attn_logit_softcapping": 30.0}, None),
    # Llama's blocks with one of Gemma 2's features: no class computes that either
    ({"norm_placement": "sandwich"}, None),
    ({"norm_weight_offset": 1.0}, None),
    ({"final_logit_softcapping": 30.0}, None),
    # OLMo 2 / 3, Granite and NeoX blocks (tests/models/test_block_features.py); plain Llama features otherwise
    ({"norm_placement": "post", "qk_norm": "full"}, "Olmo2ForCausalLM"),
    ({"norm_placement": "post", "qk_norm": "full", "sliding_window": 8, "layer_types": MIXED}, "Olmo3ForCausalLM"),
    ({"residual_multiplier": 0.5}, "GraniteForCausalLM"),
    ({"embedding_multiplier": 8.0}, "GraniteForCausalLM"),  # Granite's multipliers at 1 but this one
    ({"attention_multiplier": 0.1, "add_bias": True, "mlp_bias": True}, "GraniteForCausalLM"),
    ({"logits_scaling": 2.0}, "GraniteForCausalLM"),
    ({"normalization": "layernorm", "activation": "gelu_exact", "num_key_value_heads": 4, "add_bias": True,
      "use_parallel_residual": True}, "GPTNeoXForCausalLM"),
    ({"norm_placement": "post"}, None),  # OLMo 2 always norms q and k
    ({"use_parallel_residual": True}, None),  # a SwiGLU RMSNorm NeoX block: no class
    ({"mlp_bias": True}, None),  # MLP biases alone are Granite's only with one of its multipliers
    ({"logits_scaling": 2.0, "sliding_window": 8}, None),
    # RoPE variants: NoPE layers go to SmolLM3, a partial rotary factor to Phi-3 (not with linear scaling); a local
    # theta needs Gemma 3's block
    ({"no_rope_layers": [1, 0, 1, 1]}, "SmolLM3ForCausalLM"),
    ({"partial_rotary_factor": 0.5}, "Phi3ForCausalLM"),
    ({"partial_rotary_factor": 0.5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None),
    ({"rope_local_base_freq": 1e4, "sliding_window": 8, "layer_types": MIXED}, None),
    # Llama's blocks with one of Gemma 4's: the weightless v norm, the layer scalars
    ({"v_norm": True}, None),
    ({"layer_scalar": True}, None),
])
def test_export_class_by_features(fields, arch):
    """A zoo GPT exports as the first registered class whose ``exports`` takes it: windows go to Mistral (every
    layer) or Qwen2 / Qwen3 (any layers), per-head q/k norm to Qwen3, and Llama keeps only the plain ones."""
    cfg = GPTConfig.from_preset("tiny-llama", **fields)
    if arch is not None:
        assert export_architecture(cfg).name == arch
        return
    with pytest.raises(ConvertError, match="matches no HF architecture") as err:
        export_architecture(cfg)
    message = str(err.value)
    assert "\n" not in message and f"qk_norm={cfg.qk_norm}, sliding_window={cfg.sliding_window}" in message



@pytest.mark.parametrize("fields", [{"num_experts": 4}, {"qk_norm": "head", "num_experts": 4}],
                         ids=["Mixtral", "Qwen3-MoE"])
def test_moe_windows_that_differ_by_layer_are_refused(fields):
    """Mixtral and Qwen3-MoE slide on every layer or none: a zoo MoE GPT with per-layer windows exports as neither
    (one line naming what the class needs); Qwen2-MoE holds it (above)."""
    cfg = GPTConfig.from_preset("tiny-llama", **fields, sliding_window=8, layer_types=MIXED)
    with pytest.raises(ConvertError, match="it needs one sliding_window on every layer or none") as err:
        export_architecture(cfg)
    assert "\n" not in str(err.value)
