"""The FLOP count against Megatron-LM's closed form and against a count done by hand for GQA + SwiGLU."""

import pytest

from zoo.models.gpt import GPTConfig
from zoo.training.metrics import peak_tflops, training_flops_per_token


@pytest.mark.parametrize("preset,s", [("gpt2-124m", 1024), ("gpt2-1.5b", 2048), ("tiny", 64)])
def test_gpt2_shapes_reduce_to_megatron_formula(preset, s):
    c = GPTConfig.from_preset(preset)
    B, l, h, V = 8, c.num_hidden_layers, c.hidden_size, c.vocab_size
    megatron = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))  # with activation recomputation
    assert training_flops_per_token(c, s, recompute=True) * B * s == pytest.approx(megatron, rel=1e-12)


def test_llama_gqa_swiglu_count():
    c = GPTConfig.from_preset("llama-1b")  # h 2048, 32 q heads, 8 kv heads, d 64, f 8192, 16 layers
    s, h, d, f, V, L = 4096, 2048, 64, 8192, 128256, 16
    per_layer = 2 * h * (32 + 16) * d + 2 * 32 * d * h + 4 * s * 32 * d + 3 * 2 * h * f
    assert training_flops_per_token(c, s) == 3 * (L * per_layer + 2 * h * V)


def test_peak_known_only_for_16bit_on_known_devices():
    assert peak_tflops("NVIDIA H200", "bf16") == 989.5
    assert peak_tflops("NVIDIA H200", "fp32") is None
    assert peak_tflops(None, "bf16") is None


def test_moe_counts_active_parameters_only():
    """A MoE layer costs its router, the top-k experts a token goes to and the shared expert, not all E experts:
    apart from attention scores and the head, a forward is 2 FLOPs per active weight."""
    from zoo.training.metrics import forward_flops_per_token

    c, s = GPTConfig.from_preset("tiny-moe"), 64
    h, L, nq, d, V = c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim, c.vocab_size
    norms = (2 * L + 1) * h
    weights = c.num_parameters(include_embeddings=False, active=True) - norms
    assert forward_flops_per_token(c, s) == 2 * weights + L * 4 * s * nq * d + 2 * h * V
    assert weights < c.num_parameters(include_embeddings=False) - norms, "only 2 of 8 experts are active"
    # Qwen2-MoE-like: blocks 1 and 3 sparse (8 experts of width 32, top-2, a gated shared expert of width 64).
    q = GPTConfig.from_preset("tiny-moe-shared")
    attention = 2 * h * (4 + 2 * 2) * d + 2 * 4 * d * h + 4 * s * 4 * d
    dense, sparse = 3 * 2 * h * 176, 2 * h * 8 + 2 * 3 * 2 * h * 32 + 3 * 2 * h * 64 + 2 * h
    assert forward_flops_per_token(q, s) == 4 * attention + 2 * dense + 2 * sparse + 2 * h * V


def test_a_sliding_window_layer_counts_its_window():
    """A layer with a window W < s counts 4 W nq d of attention per token (its W keys per query, in full as the
    causal ones are), a full layer 4 s nq d; a window as long as the sequence changes nothing."""
    from zoo.training.metrics import forward_flops_per_token

    s, types = 64, ["sliding_attention", "full_attention"] * 2
    full = GPTConfig.from_preset("tiny-llama")
    windowed = GPTConfig.from_preset("tiny-llama", sliding_window=8, layer_types=types)
    nq, d = full.num_attention_heads, full.head_dim
    assert forward_flops_per_token(full, s) - forward_flops_per_token(windowed, s) == 2 * 4 * (s - 8) * nq * d
    assert forward_flops_per_token(GPTConfig.from_preset("tiny-llama", sliding_window=s), s) == \
        forward_flops_per_token(full, s)
