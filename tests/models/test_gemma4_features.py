"""Gemma 4's block features in zoo's GPT (``global_head_dim`` / ``num_global_key_value_heads`` on the full-attention
layers, ``attention_k_eq_v``, ``v_norm``, ``layer_scalar``, proportional RoPE, through the Gemma 4 adapter's config
mapping and per-layer table): logits equal transformers' Gemma4ForCausalLM (eager attention) on the same weights,
greedy generation past the window equals HF's, the refusals are one line each, and a tiny model with the features
trains the same at tp2 + SP, pp2, dp2 under ZeRO-2 and cp2 (Ulysses and ring) as in one process (fp32, 1e-5), and
at tp2 + SP with its full layers' one kv head replicated.
"""

from __future__ import annotations

import pytest
import torch

from tests.convert.test_hf_gpt import hf_gemma4, randomize_
from tests.training import test_attention_layouts as attention_layouts
from zoo.convert.errors import ConvertError
from zoo.convert.hf.gemma4 import groups, to_zoo
from zoo.convert.tables import rows_of
from zoo.models.generate import Generator
from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs
from zoo.models.specs import SpecSequential

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def gemma4_pair(seed: int = 0, **overrides):
    """A random tiny HF Gemma 4 (tests/convert/test_hf_gpt.py's) and zoo's GPT loaded through the adapter's rows."""
    torch.manual_seed(seed)
    hf = hf_gemma4(**overrides).eval()
    randomize_(hf, seed)
    cfg = to_zoo(hf.config)
    model = SpecSequential(layer_specs(cfg, ParallelOptions())).eval()
    zoo_sd, hf_sd = model.state_dict(), hf.state_dict()
    rows = rows_of(groups(cfg))
    with torch.no_grad():
        for r in rows:
            value = r.to_zoo(*(hf_sd[k] for k in r.hf))
            zoo_sd[r.zoo][: value.shape[0]].copy_(value)  # the padded vocabulary's extra rows stay as they are
    assert {r.zoo for r in rows} == set(zoo_sd)
    assert {k for r in rows for k in r.hf} == set(hf_sd) - {"lm_head.weight"}  # tied: the embedding
    return hf, model, cfg


def test_the_features_are_on_and_the_layers_differ():
    _, model, cfg = gemma4_pair()
    assert (cfg.global_head_dim, cfg.num_global_key_value_heads, cfg.attention_k_eq_v, cfg.v_norm) == (32, 1, True,
                                                                                                       True)
    sliding, full = getattr(model, "1").attention, getattr(model, "2").attention  # sliding, full, sliding, full
    assert (sliding.head_dim, sliding.num_groups_local, sliding.kv_rows) == (16, 2, 2)
    assert (full.head_dim, full.num_groups_local, full.kv_rows) == (32, 1, 1)
    assert cfg.num_parameters() == sum(p.numel() for n, p in model.named_parameters()) - (
        cfg.padded_vocab_size() - cfg.vocab_size) * cfg.hidden_size


@pytest.mark.parametrize("tp", [1, 2])
def test_the_planner_counts_each_layers_tensors(tp):
    """zoo.plan prices each block with its own attention shapes: its per-rank tensors are the built model's (the
    full layers' wider heads, one kv head replicated at tp 2, k = v), so memory and FLOPs follow the layer type."""
    from zoo.plan.estimate import block_tensors

    _, model, cfg = gemma4_pair()
    for i in range(cfg.num_hidden_layers):
        attention = getattr(model, str(i + 1)).attention
        d, nkv = attention.head_dim, cfg.layer_kv_heads(i)
        kv = attention.kv_rows * d * cfg.hidden_size
        qkv = [cfg.num_attention_heads * d * cfg.hidden_size // tp, kv] if tp > nkv else [
            (cfg.num_attention_heads * d + attention.kv_rows * nkv * d) * cfg.hidden_size // tp]
        assert block_tensors(cfg, i, tp)[0][:len(qkv)] == qkv, i
        if tp == 1:
            block = getattr(model, str(i + 1))
            assert sum(block_tensors(cfg, i, 1)[0]) == sum(p.numel() for p in block.parameters()), i


def test_logits_equal_transformers_gemma4():
    hf, model, cfg = gemma4_pair()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))  # 24 > window 5
    with torch.no_grad():
        theirs, ours = hf(ids).logits, model(ids)[..., : cfg.vocab_size]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert ours.abs().max() > 1.0  # not washed out by the soft cap: worth comparing


def test_greedy_generation_equals_transformers_gemma4():
    hf, model, cfg = gemma4_pair(seed=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    ours = Generator(model).generate(ids, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.tokens, theirs)


@pytest.mark.parametrize("overrides,match", [
    ({"hidden_size_per_layer_input": 8}, r"hidden_size_per_layer_input=8 \(per-layer input embeddings\)"),
    ({"num_kv_shared_layers": 2}, r"num_kv_shared_layers=2 \(key/value sharing across layers\)"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16},
     "enable_moe_block=True"),
    ({"use_bidirectional_attention": "vision"}, "use_bidirectional_attention='vision'"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
])
def test_what_zoo_does_not_compute_is_refused_in_one_line(overrides, match):
    from transformers import Gemma4TextConfig

    base = hf_gemma4().config.to_dict()
    base.pop("per_layer_config")
    c = Gemma4TextConfig(**{**base, **overrides, "global_head_dim": 32, "num_global_key_value_heads": 1})
    with pytest.raises(ConvertError, match=match) as err:
        to_zoo(c)
    assert "\n" not in str(err.value) and str(err.value).startswith("Gemma4ForCausalLM: ")


# Gemma 4's block on the tiny Llama of the layout tests: sandwich norms, GeGLU, per-head q/k norm, the weightless v
# norm, layer scalars, and full layers (layer 1 of test_attention_layouts' layer_types) with heads twice as wide and
# k = v; scores unscaled. Two kv heads on every layer, so tp 2 splits them.
GEMMA4 = ["model.norm_placement=sandwich", "model.activation=geglu", "model.qk_norm=head", "model.v_norm=true",
          "model.layer_scalar=true", "model.global_head_dim=32", "model.attention_k_eq_v=true",
          "model.embedding_multiplier=8.0", "model.tie_word_embeddings=true", "model.rope_local_base_freq=10000.0",
          "model.rope_theta=1000000.0", "model.rope_scaling={rope_type: proportional, partial_rotary_factor: 0.5}"]
LAYOUTS = ["tp2-sp", "pp2", "dp2-zero2", "cp2-ulysses", "cp2-ring"]
_reference = {}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gemma4_like_model_trains_alike(dist_run, tmp_path_factory, layout):
    cp = layout.startswith("cp")
    extra = [*(attention_layouts.CP if cp else attention_layouts.DENSE), *GEMMA4, "model.query_pre_attn_scalar=1"]
    attention_layouts.assert_trains_alike(*attention_layouts.layout_and_reference(dist_run, tmp_path_factory, layout,
                                                                                  extra, _reference))


def test_bad_fields_are_one_line():
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by num_global_key_value_heads 3"):
        GPTConfig.from_preset("tiny-llama", num_global_key_value_heads=3,
                              layer_types=["full_attention"] * 4)
    with pytest.raises(ValueError, match="num_global_key_value_heads 3 and tp 2: one must divide the other"):
        GPTConfig.from_preset("tiny-llama", num_attention_heads=6, head_dim=16,
                              num_global_key_value_heads=3).check_layout(2)
    GPTConfig.from_preset("tiny-llama", num_global_key_value_heads=1).check_layout(2)  # replicated: allowed


def test_gemma4_full_layers_with_one_kv_head_train_alike_at_tp2(dist_run):
    """The full layers' single kv head (k = v) replicated over both TP ranks (zoo.parallel.layers.GroupedQKVLinear
    with its k rows alone), with sequence parallelism: the one-process losses."""
    extra = [*attention_layouts.DENSE, *GEMMA4, "model.query_pre_attn_scalar=1", "model.num_global_key_value_heads=1"]
    attention_layouts.assert_trains_alike(*attention_layouts.layout_and_reference(dist_run, None, "tp2-sp", extra, {}))
