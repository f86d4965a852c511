"""q/k RMSNorm under tensor parallelism: attention at tp=2 equals the tp=1 layer built from the same seed.

"head" (Qwen3): one weight [d] for all heads, replicated; TP ranks hold other heads, so its gradient is summed over
TP. "full" (OLMoE): the weight [n*d] is sharded with the heads, and the sum of squares over all heads is
all-reduced. The norm weights are randomised (ones would hide a mis-sliced or mis-summed weight).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.parallel.helpers import assert_close, chunk, gen
from tests.parallel.test_expert_dispatch import _destroy, _groups
from zoo.models.gpt import GPTAttention, GPTConfig, ParallelOptions
from zoo.parallel.layers import scaled_init_method_normal

B, S = 2, 8


def assert_close_sum(actual, expected, what):
    """A weight's gradient: a sum over every token (and head, for the norms) that tp=2 adds in another order, so a
    few ulps of the sum apart, not 1e-6 (a mis-sliced or mis-summed weight is off by far more)."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def qk_norm_case(kind: str):
    tp_group, _, single, made = _groups(2, 1)
    try:
        cfg = GPTConfig.from_preset("tiny-llama", qk_norm=kind, head_dim=24, initializer_range=0.2)
        out_init = scaled_init_method_normal(cfg.initializer_range, cfg.num_hidden_layers)
        layers = {}
        for name, group in (("tp", tp_group), ("ref", single)):
            torch.manual_seed(0)
            layers[name] = GPTAttention(cfg, ParallelOptions(False, group), out_init)
        att, ref = layers["tp"], layers["ref"]
        rank, tp = dist.get_rank(tp_group), 2
        with torch.no_grad():
            for norm in ("q_norm", "k_norm"):
                full = getattr(ref, norm).weight
                full.copy_(1 + 0.3 * torch.randn(full.shape, generator=gen(7)))
                getattr(att, norm).weight.copy_(full if kind == "head" else chunk(full, 0, rank, tp))
        x = torch.randn(B, S, cfg.hidden_size, generator=gen(1))
        dy = torch.randn(B, S, cfg.hidden_size, generator=gen(2))
        x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_tp, y_ref = att(x_tp), ref(x_ref)
        y_tp.backward(dy)
        y_ref.backward(dy)
        assert_close(y_tp, y_ref, "output")
        assert_close(x_tp.grad, x_ref.grad, "input grad")
        for norm in ("q_norm", "k_norm"):
            g_ref = getattr(ref, norm).weight.grad
            assert g_ref.abs().max() > 1e-3
            assert_close_sum(getattr(att, norm).weight.grad, g_ref if kind == "head" else chunk(g_ref, 0, rank, tp),
                             norm)
        assert_close_sum(att.qkv.weight.grad, chunk(ref.qkv.weight.grad, 0, rank, tp), "qkv grad")
        return True
    finally:
        _destroy(made)


@pytest.mark.parametrize("kind", ["head", "full"])
def test_qk_norm_tp2_equals_tp1(dist_run, kind):
    assert all(dist_run(2, qk_norm_case, kind))
