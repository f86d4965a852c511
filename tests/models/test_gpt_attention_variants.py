"""The GPT block's attention variants (sliding windows per layer, logit soft-capping, the query scale): their config
fields, HF transformers' logits and greedy generation with a window shorter than the sequence (Mistral: every layer;
Qwen2: ``layer_types`` mixing sliding and full layers), and the KV cache against the full forward with window and cap.

The HF models are tiny random ones moved off their init (``test_gpt_vs_transformers.randomize_``), their weights
copied through the converter's Llama key table (Mistral's and Qwen2's names are Llama's); the window is set on the
zoo config directly here. A dense Qwen3 (per-head q/k norm, head_dim apart, windows by layer_types) goes through
the converter's own config mapping and table, to compare greedy generation.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.models.test_gpt_vs_transformers import VOCAB, load_from_hf, max_logit_diff, randomize_, token_ids
from zoo.convert.hf import qwen3 as qwen3_adapter
from zoo.convert.hf.llama import table as llama_table
from zoo.models.generate import Generator
from zoo.models.gpt import GPTConfig, layer_specs
from zoo.models.specs import SpecSequential

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
WINDOW, SEQ = 7, 40
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def zoo_twin(hf, **attention) -> tuple[SpecSequential, GPTConfig]:
    theta = hf.config.rope_parameters["rope_theta"]
    cfg = GPTConfig.from_preset("tiny-llama", **SHAPE, norm_eps=1e-6, rope_theta=theta,
                                qkv_bias=isinstance(hf, Qwen2ForCausalLM), tie_word_embeddings=False, **attention)
    model = SpecSequential(layer_specs(cfg)).eval()
    load_from_hf(model, hf, llama_table(cfg), cfg)
    return model, cfg


def mistral(window=WINDOW, seed=0):
    torch.manual_seed(seed)
    hf = MistralForCausalLM(MistralConfig(**SHAPE, rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=window,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).eval()
    randomize_(hf, seed)
    return hf


def qwen2(layer_types, seed=0):
    torch.manual_seed(seed)
    hf = Qwen2ForCausalLM(Qwen2Config(**SHAPE, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=True,
                                      sliding_window=WINDOW, layer_types=layer_types,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})).eval()
    randomize_(hf, seed)
    assert hf.config.layer_types == layer_types
    return hf


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


def test_fields_round_trip_and_stay_out_of_plain_configs():
    cfg = GPTConfig.from_preset("tiny-llama", sliding_window=16, attn_logit_softcapping=50.0,
                                query_pre_attn_scalar=32.0,
                                layer_types=["sliding_attention", "full_attention"] * 2)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    assert [cfg.attention_window(i) for i in range(4)] == [16, None, 16, None]
    assert cfg.attention_scale == 32.0 ** -0.5
    plain = GPTConfig.from_preset("tiny-llama").to_dict()
    assert not {"sliding_window", "layer_types", "attn_logit_softcapping", "query_pre_attn_scalar"} & set(plain)
    # Mistral: a window and no layer_types windows every layer
    assert [GPTConfig.from_preset("tiny", sliding_window=8).attention_window(i) for i in range(4)] == [8] * 4


@pytest.mark.parametrize("fields,match", [
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"sliding_window": 8, "layer_types": ["sliding_attention"]}, "one type per layer \\(4\\)"),
    ({"sliding_window": 8, "layer_types": ["sliding_attention", "local"] * 2}, "unknown type\\(s\\) \\['local'\\]"),
    ({"layer_types": ["sliding_attention"] * 4}, "sliding_window is null; set sliding_window"),
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive number"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
])
def test_bad_fields_are_one_line(fields, match):
    with pytest.raises(ValueError, match=match) as err:
        GPTConfig.from_preset("tiny", **fields)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# HF transformers
# ---------------------------------------------------------------------------------------------------------------


def test_mistral_sliding_window_logits_match():
    hf = mistral()
    model, cfg = zoo_twin(hf, sliding_window=WINDOW)
    ids = token_ids(seq=SEQ)
    assert max_logit_diff(model, hf, cfg, ids) < 1e-4
    full, _ = zoo_twin(hf)  # the same weights without the window: far off, so the test has teeth
    assert max_logit_diff(full, hf, cfg, ids) > 1e-2


def test_qwen2_layer_types_logits_match():
    types = ["full_attention", "sliding_attention"]
    hf = qwen2(types)
    model, cfg = zoo_twin(hf, sliding_window=WINDOW, layer_types=types)
    ids = token_ids(seq=SEQ)
    assert max_logit_diff(model, hf, cfg, ids) < 1e-4
    swapped, _ = zoo_twin(hf, sliding_window=WINDOW, layer_types=types[::-1])
    assert max_logit_diff(swapped, hf, cfg, ids) > 1e-2


def assert_greedy_like_hf(model, hf, seed: int) -> None:
    """A 7-token prompt + 20 greedy tokens (past every window here): zoo's generator gives transformers' tokens,
    and not a degenerate repetition."""
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    ours = Generator(model).generate(ids, max_new_tokens=20, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(ours.tokens, theirs)
    assert min(len(set(row.tolist())) for row in ours.new_tokens) > 3


def test_mistral_greedy_generation_matches_past_the_window():
    """Prompt 7 + 20 new tokens with a window of 5: the cached path masks the whole cache by the window."""
    hf = mistral(window=5, seed=1)
    model, _ = zoo_twin(hf, sliding_window=5)
    assert_greedy_like_hf(model, hf, seed=4)


def test_qwen3_through_the_converter_generates_as_transformers():
    """Qwen3 with head_dim 24 != 64 / 4, q/k norm per head, a window of 5 on its second layer (max_window_layers 1):
    the converter's config and table give HF's logits, and greedy generation past the window is HF's."""
    torch.manual_seed(2)
    hf = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=24, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})).eval()
    randomize_(hf, 2)
    cfg = qwen3_adapter.to_zoo(hf.config)
    assert (cfg.head_dim, cfg.qk_norm, cfg.layer_types) == (24, "head", ["full_attention", "sliding_attention"])
    model = SpecSequential(layer_specs(cfg)).eval()
    load_from_hf(model, hf, qwen3_adapter.table(cfg), cfg)
    assert max_logit_diff(model, hf, cfg, token_ids(seq=SEQ)) < 1e-4
    assert_greedy_like_hf(model, hf, seed=5)


# ---------------------------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------------------------


def test_cached_steps_equal_full_forward_with_window_cap_and_scale():
    cfg = GPTConfig.from_preset("tiny-llama", sliding_window=5, layer_types=["sliding_attention", "full_attention"] * 2,
                                attn_logit_softcapping=3.0, query_pre_attn_scalar=10.0, initializer_range=0.15)
    torch.manual_seed(0)
    model = SpecSequential(layer_specs(cfg)).eval()
    gen = Generator(model)
    seq = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(seq)[..., : cfg.vocab_size]
    caches = gen.new_caches(2, seq.shape[1])
    with torch.inference_mode():
        for start, stop in [(0, 6), (6, 10)] + [(t, t + 1) for t in range(10, seq.shape[1])]:
            got = gen.logits(seq[:, start:stop], caches)
            assert (got - full[:, stop - 1]).abs().max() < 1e-5, (start, stop)


def _windowed_model():
    cfg = GPTConfig.from_preset("tiny-llama", sliding_window=5, layer_types=["sliding_attention", "full_attention"] * 2,
                                attn_logit_softcapping=3.0, initializer_range=0.15)
    torch.manual_seed(0)
    return SpecSequential(layer_specs(cfg)).eval(), cfg


@pytest.mark.parametrize("max_len", [24, 200])
def test_rolling_cache_of_a_windowed_layer_holds_its_window(max_len):
    """A sliding-window layer's cache holds W positions whatever the generation's length; a full layer's the
    whole sequence (and a window longer than the generation needs no rolling buffer)."""
    model, cfg = _windowed_model()
    caches = Generator(model).new_caches(2, max_len)
    d, nkv = cfg.head_dim, cfg.num_key_value_heads
    for i, cache in enumerate(caches):
        slots = 5 if cfg.attention_window(i) is not None else max_len
        assert cache.k.shape == cache.v.shape == (2, nkv, slots, d), i
    windowed = sum(c.k.numel() + c.v.numel() for i, c in enumerate(caches) if cfg.attention_window(i) is not None)
    assert windowed == 2 * 2 * (2 * nkv * 5 * d)  # two windowed layers, k and v: bounded by W, not max_len
    assert Generator(model).new_caches(2, 4)[0].k.shape[2] == 4  # W >= max_len: the plain cache


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_rolling_cache_equals_the_full_cache(padded):
    """Chunks and single steps well past the window (every slot overwritten several times): the rolling caches give
    the full caches' logits (up to rounding: the keys sit in other memory and, once the buffer wraps, another
    order), with left padding too."""
    model, cfg = _windowed_model()
    gen = Generator(model)
    seq = torch.randint(0, cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    pad = torch.tensor([0, 3]) if padded else None
    rolling, full = gen.new_caches(2, 30, pad), gen.new_caches(2, 30, pad, rolling=False)
    assert rolling[0].window == 5 and full[0].window is None
    with torch.inference_mode():
        for start, stop in [(0, 8), (8, 11), (11, 19)] + [(t, t + 1) for t in range(19, 30)]:
            a, b = gen.logits(seq[:, start:stop], rolling), gen.logits(seq[:, start:stop], full)
            assert (a - b).abs().max() < 1e-5, (start, stop)
            assert a.abs().max() > 0.1


def test_generation_with_rolling_caches_equals_recomputing():
    """generate() past the window many times over: the cached tokens (rolling caches) are those of recomputing every
    position from scratch (use_cache=False), left-padded rows included."""
    model, cfg = _windowed_model()
    ids = torch.randint(1, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[1] * 6, [0, 0] + [1] * 4])
    gen = Generator(model)
    cached = gen.generate(ids, max_new_tokens=25, attention_mask=mask)
    again = gen.generate(ids, max_new_tokens=25, attention_mask=mask, use_cache=False)
    assert torch.equal(cached.tokens, again.tokens) and cached.tokens.shape[1] == 31


def test_rolling_caches_at_tp2_equal_tp1(tmp_path, dist_run):
    """Each TP rank's rolling caches hold its own key-value heads: greedy and sampled tokens 20 steps past the
    window are tp=1's (the model through a model folder, as launch/generate.py loads it)."""
    from tests.models.test_generate import generate_from_folder, unpadded_tensors
    from zoo.convert.io import write_model_folder

    model, cfg = _windowed_model()
    folder = str(tmp_path / "model")
    write_model_folder(folder, "gpt", cfg.to_dict(), unpadded_tensors(model))
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(6))
    greedy1, sampled1 = generate_from_folder(folder, 1, ids, 20)
    assert greedy1.shape[1] == 26 and not torch.equal(greedy1, sampled1)
    for greedy2, sampled2 in dist_run(2, generate_from_folder, folder, 2, ids, 20):
        assert torch.equal(greedy2, greedy1) and torch.equal(sampled2, sampled1)
