"""zoo's RoPE (``zoo.models.rope``) against transformers: the inverse frequencies and attention factors of every
type against ``ROPE_INIT_FUNCTIONS``, the cos/sin tables against HF's rotary embedding module (its dynamic
LongRoPE switch included), partial rotary against Phi-3's ``apply_rotary_pos_emb``; the architectures that use
them (SmolLM3: NoPE layers, Phi-3: LongRoPE + partial rotary, Gemma 3: a theta per layer type) give transformers'
logits and greedy generations (Phi-3's across the LongRoPE switch, where the prefix is encoded again); one-line
refusals; and a NoPE + partial-rotary model (a tiny SmolLM3-like one) trains the same in every layout as in one
process (fp32, 1e-5 relative, 3 steps): tp2 + SP, pp2, dp2 under ZeRO-2, cp2 with Ulysses and ring attention.
"""

from __future__ import annotations

import pytest
import torch

from tests.convert.test_hf_gpt import hf_gemma3, hf_phi3, hf_smollm3, randomize_
from tests.models.test_gpt_vs_transformers import load_from_hf
from tests.training import test_attention_layouts as attention_layouts
from tests.training import test_gpt_layouts as gpt_layouts
from zoo.convert.errors import ConvertError
from zoo.convert.gpt import gpt_config_from_hf
from zoo.convert.hf import llama
from zoo.convert.registry import ARCHITECTURES
from zoo.convert.tables import rows_of
from zoo.models.generate import Generator
from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs
from zoo.models.rope import apply_rope, attention_factor, rope_inv_freq, rope_table
from zoo.models.specs import SpecSequential

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

THETA = 10000.0
LONG = {"rope_type": "longrope", "original_max_position_embeddings": 16,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.3, 4.0], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0,
                                                                                 19.0]}
# (rope_parameters less theta, partial_rotary_factor): every type zoo has, with the options that change it
ROPES = {
    "default": ({"rope_type": "default"}, 1.0),
    "default-partial": ({"rope_type": "default"}, 0.5),
    "linear": ({"rope_type": "linear", "factor": 3.0}, 1.0),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}, 1.0),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 1.0),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.3,
                     "mscale_all_dim": 0.8, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}, 1.0),
    "yarn-factor-given": ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                           "attention_factor": 1.25}, 1.0),
    "yarn-partial": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 0.5),
    "longrope": (LONG, 1.0),
    "longrope-factor": ({**LONG, "factor": 2.0}, 1.0),
    "longrope-partial": ({**LONG, "short_factor": LONG["short_factor"][:4], "long_factor": LONG["long_factor"][:4]},
                         0.5),
}


def hf_and_zoo_configs(params: dict, partial: float):
    """The same RoPE as a LlamaConfig (64 positions, head_dim 16) and as zoo's config read from it by the converter."""
    from transformers import LlamaConfig

    rope = {**params, "rope_theta": THETA, **({"partial_rotary_factor": partial} if partial != 1.0 else {})}
    c = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                    rope_parameters=rope)
    theta, scaling = llama.rope(c)
    cfg = GPTConfig.from_preset("tiny-llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                head_dim=16, max_position_embeddings=64, rope_theta=theta, rope_scaling=scaling,
                                partial_rotary_factor=llama.partial_rotary_factor(c))
    return c, cfg


def hf_frequencies(c, seq_len=None):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    kind = c.rope_parameters["rope_type"]
    if kind == "default":  # no init function: the models' own (Phi-3's reads partial_rotary_factor, Llama's not)
        return Phi3RotaryEmbedding.compute_default_rope_parameters(c)
    return ROPE_INIT_FUNCTIONS[kind](c, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("name", list(ROPES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(name):
    c, cfg = hf_and_zoo_configs(*ROPES[name])
    for seq_len in (None, 10, 40):  # longrope: short factors up to 16 positions, long ones past them
        inv_freq, factor = hf_frequencies(c, seq_len)
        torch.testing.assert_close(rope_inv_freq(cfg, seq_len=seq_len), inv_freq.float(), rtol=1e-6, atol=0)
        assert attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
    assert rope_inv_freq(cfg).shape == (int(16 * cfg.partial_rotary_factor) // 2,)
    if cfg.rope_scaling is not None:  # the scaling changes the frequencies or the factor: the comparison has teeth
        plain = GPTConfig.from_dict({**cfg.to_dict(), "rope_scaling": None})
        assert not torch.equal(rope_inv_freq(cfg, seq_len=40), rope_inv_freq(plain)) or attention_factor(cfg) != 1


@pytest.mark.parametrize("name", ["yarn-mscale", "longrope", "longrope-partial"])
def test_tables_equal_transformers_rotary_embedding(name):
    """cos/sin (times the attention factor) at 10 and at 40 positions, as HF's module computes them per forward
    (LongRoPE: its short set below original_max_position_embeddings, its long set past it)."""
    from transformers.models.phi3.modeling_phi3 import Phi3Config, Phi3RotaryEmbedding

    params, partial = ROPES[name]
    c = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=64, partial_rotary_factor=partial,
                   original_max_position_embeddings=params["original_max_position_embeddings"],
                   rope_parameters={**params, "rope_theta": THETA}) if "longrope" in name else \
        hf_and_zoo_configs(params, partial)[0]
    if "longrope" not in name:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
    else:
        Rotary = Phi3RotaryEmbedding
    _, cfg = hf_and_zoo_configs(params, partial)
    module = Rotary(c)
    for n in (10, 40):
        x = torch.zeros(1, n, 64)
        cos, sin = module(x, torch.arange(n)[None])
        ours = rope_table(cfg, n, "cpu", torch.float32)
        torch.testing.assert_close(ours[0][:n], cos[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(ours[1][:n], sin[0], rtol=0, atol=1e-5)
    assert not torch.allclose(rope_table(cfg, 10, "cpu", torch.float32)[0][:10], rope_table(cfg, 40, "cpu",
                              torch.float32)[0][:10]) or "longrope" not in name  # the switch shows


def test_partial_rotary_equals_phi3_and_passes_the_rest():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    _, cfg = hf_and_zoo_configs(*ROPES["default-partial"])
    cos, sin = rope_table(cfg, 12, "cpu", torch.float32)
    cos, sin = cos[:12], sin[:12]
    assert cos.shape == (12, 8)  # head_dim 16 x 0.5
    q, k = torch.randn(2, 3, 12, 16), torch.randn(2, 3, 12, 16)
    theirs = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    ours = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert torch.equal(ours[0][..., 8:], q[..., 8:]) and not torch.allclose(ours[0][..., :8], q[..., :8])


@pytest.mark.parametrize("fields,message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "ntk", "factor": 2.0}}, "rope_scaling type must be one of"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, r"needs \['original_max_position_embeddings'\]"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 3}}, r"unknown keys \['beta_fast'\]"),
    ({"rope_scaling": {**LONG, "short_factor": [1.0]}}, "need rotary_dim / 2 = 8 values each"),
    ({"partial_rotary_factor": 0.0}, r"partial_rotary_factor must be in \(0, 1\]"),
    ({"partial_rotary_factor": 0.45}, r"even rotary dim, got int\(head_dim 16 \* partial_rotary_factor 0.45\) = 7"),
    ({"no_rope_layers": [1, 0]}, r"no_rope_layers must list 1 \(RoPE\) or 0 \(NoPE\) per layer \(4\)"),
    ({"rope_local_base_freq": -1.0}, "rope_local_base_freq must be a positive number"),
])
def test_refusals_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as err:
        GPTConfig.from_preset("tiny-llama", **fields)
    assert "\n" not in str(err.value)


def test_converter_refusals_one_line():
    from transformers import Gemma3TextConfig, LlamaConfig

    partial = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.5})
    with pytest.raises(ConvertError, match="LlamaForCausalLM: partial_rotary_factor 0.5 is not supported"):
        gpt_config_from_hf("LlamaForCausalLM", partial)
    dynamic = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "dynamic", "rope_theta": THETA, "factor": 2.0})
    with pytest.raises(ConvertError, match="rope_type 'dynamic' is not supported"):
        gpt_config_from_hf("LlamaForCausalLM", dynamic)
    scaled_local = Gemma3TextConfig(num_hidden_layers=2, head_dim=16, hidden_size=64, num_attention_heads=4,
                                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                           "rope_theta": 1e4}})
    with pytest.raises(ConvertError, match=r"Gemma3ForCausalLM: rope_parameters\['sliding_attention'\] rope_type "
                                           "'linear' is not supported"):
        gpt_config_from_hf("Gemma3ForCausalLM", scaled_local)


# ---------------------------------------------------------------------------------------------------------------
# The architectures: logits and greedy generation equal transformers'
# ---------------------------------------------------------------------------------------------------------------

MAKERS = {"SmolLM3ForCausalLM": hf_smollm3, "Phi3ForCausalLM": hf_phi3, "Gemma3ForCausalLM": hf_gemma3}


def pair(arch: str, seed: int = 0, **fields):
    """A random tiny HF model of ``arch`` (tests/convert/test_hf_gpt.py's) and zoo's GPT with its weights; ``fields``
    change zoo's config (to show a feature matters)."""
    torch.manual_seed(seed)
    hf = MAKERS[arch]().eval()
    randomize_(hf, seed)
    cfg = GPTConfig.from_dict({**gpt_config_from_hf(arch, hf.config).to_dict(), **fields})
    model = SpecSequential(layer_specs(cfg, ParallelOptions())).eval()
    load_from_hf(model, hf, rows_of(ARCHITECTURES[arch].groups(cfg)), cfg)
    return hf, model, cfg


def max_diff(hf, model, cfg, seq: int) -> float:
    ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((model(ids)[..., : cfg.vocab_size] - hf(ids).logits).abs().max())


# What each feature changes, to show it matters: SmolLM3's NoPE layers, Phi-3's partial rotary, Gemma 3's local theta
WITHOUT = {"SmolLM3ForCausalLM": {"no_rope_layers": [1, 1, 1, 1]}, "Phi3ForCausalLM": {"partial_rotary_factor": 1.0,
           "rope_scaling": None}, "Gemma3ForCausalLM": {"rope_local_base_freq": None}}


@pytest.mark.parametrize("arch", list(MAKERS))
def test_logits_equal_transformers(arch):
    hf, model, cfg = pair(arch)
    for seq in (6, 24):  # Phi-3: below and past its LongRoPE switch at 8; windows of 5
        assert max_diff(hf, model, cfg, seq) < 1e-4, (arch, seq)
    hf, model, cfg = pair(arch, **WITHOUT[arch])
    assert max_diff(hf, model, cfg, 24) > 1e-2


@pytest.mark.parametrize("arch", list(MAKERS))
def test_greedy_generation_equals_transformers(arch):
    """5 prompt tokens, 10 new: past the windows, and across Phi-3's LongRoPE switch at 8 positions."""
    hf, model, cfg = pair(arch, seed=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    ours = Generator(model).generate(ids, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.tokens, theirs)


def test_longrope_generation_encodes_the_prefix_again_at_the_switch(monkeypatch):
    """Past original_max_position_embeddings the cached keys (encoded with the short factors) are stale: kept, the
    next logits differ from a full forward's. So the generator runs the whole sequence again once it outgrows the
    switch (as HF's Phi-3 drops its cache), then goes on one token at a time; the tokens equal those of a generation
    that recomputes everything at every step."""
    _, model, cfg = pair("Phi3ForCausalLM", seed=2)
    gen = Generator(model)
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))  # 8 = the switch
    with torch.inference_mode():
        caches = gen.new_caches(1, 12)
        gen.logits(ids, caches)
        nxt = torch.tensor([[7]])
        stale = gen.logits(nxt, caches)  # 9 positions, 8 of them encoded short
        full = gen.logits(torch.cat([ids, nxt], 1), gen.new_caches(1, 12))
    assert (stale - full).abs().max() > 1e-3
    fed, logits = [], Generator.logits
    monkeypatch.setattr(Generator, "logits", lambda self, x, c: fed.append(x.shape[1]) or logits(self, x, c))
    cached = gen.generate(ids[:, :5], max_new_tokens=6, eos_token_id=None)
    assert fed == [5, 1, 1, 1, 9, 1]  # 9 tokens > 8: all of them again
    fed.clear()
    assert torch.equal(cached.tokens, gen.generate(ids[:, :5], max_new_tokens=6, eos_token_id=None,
                                                   use_cache=False).tokens)


# ---------------------------------------------------------------------------------------------------------------
# Training: a NoPE + partial-rotary model in every layout
# ---------------------------------------------------------------------------------------------------------------

# On the layout tests' tiny Llama (4 layers, head_dim 16): NoPE on layers 1 and 3, half of each head rotating.
SMOL = ["model.no_rope_layers=[1,0,1,0]", "model.partial_rotary_factor=0.5"]
# Under CP also LongRoPE switching at 160 positions: between a rank's 128 and the sequence's 256, so a rank choosing
# its factor set by its own length (not the global one) would train another model; its attention factor given.
LONGROPE_CP = ("model.rope_scaling={rope_type: longrope, original_max_position_embeddings: 160, attention_factor: 1.1, "
               "short_factor: [1.0, 1.5, 2.0, 3.0], long_factor: [1.0, 3.0, 6.0, 12.0]}")
LAYOUTS = ["tp2-sp", "pp2", "dp2-zero2", "cp2-ulysses", "cp2-ring"]
_reference = {}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nope_partial_rotary_model_trains_alike(dist_run, tmp_path_factory, layout):
    cp = layout.startswith("cp")  # 256 tokens over 2 ranks: the global positions and length pick the tables' rows
    extra = [*SMOL, LONGROPE_CP, "training.steps=3"] if cp else SMOL
    runs, expected = attention_layouts.layout_and_reference(dist_run, tmp_path_factory, layout, extra, _reference)
    if not cp:
        assert expected != gpt_layouts.reference(dist_run, "llama"), "NoPE and partial rotary change the run"
    attention_layouts.assert_trains_alike(runs, expected)
