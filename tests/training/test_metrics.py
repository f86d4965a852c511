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
