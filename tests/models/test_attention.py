"""The one attention function (zoo.models.attention) against a dense reference written from the definition.

The reference builds the whole ``[s, t]`` mask from positions (causal: j <= q_offset + i; window W: j > q_offset + i
- W, as HF's ``sliding_window_overlay``), scores in float64, tanh soft-capping after the scale and before the mask,
one softmax. The blocked path must equal it forward and backward (q, k, v gradients) for windows shorter than,
equal to and longer than s, GQA, soft-capping on and off, a custom scale, and block sizes that do and do not divide
s; plain causal attention must still be SDPA's exact call.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from zoo.models.attention import attention, blocked_attention, choose_kernel, key_range


def dense_reference(q, k, v, *, causal=True, window=None, softcap=None, scale=None, q_offset=0, attn_mask=None):
    """Attention from its definition: explicit mask, tanh cap, one softmax over all t keys; (out, lse)."""
    _, nq, s, d = q.shape
    nkv, t = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)  # [b, nq, t, d]
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(s)[:, None] + q_offset
    j = torch.arange(t)
    ok = torch.ones(s, t, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= j > i - window
    if attn_mask is not None:
        ok = ok & attn_mask
    scores = scores.masked_fill(~ok, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def qkv(b=2, nq=4, nkv=2, s=40, t=None, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = s if t is None else t
    shapes = (b, nq, s, d), (b, nkv, t, d), (b, nkv, t, d)
    return tuple((torch.randn(*shape, generator=g, dtype=dtype) * 1.5).requires_grad_() for shape in shapes)


def grads(out, inputs, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, dout)


S = 40
CASES = [  # (window, softcap, scale, nq/nkv, block_size)
    (7, None, None, (4, 2), 16),  # window << s, GQA, a block size that does not divide s
    (7, 5.0, None, (4, 4), 8),  # soft cap, multi-head, block size divides s
    (16, 2.0, 0.3, (4, 1), 16),  # window = block size, one kv head, custom scale
    (S, None, None, (4, 2), 16),  # window = s: binds nothing
    (S - 1, 5.0, None, (4, 2), 13),  # the one window just shorter than s
    (100, 3.0, 0.2, (4, 2), 16),  # window > s
    (None, 4.0, None, (4, 2), 7),  # soft cap alone
    (None, None, 0.5, (2, 2), 64),  # custom scale alone, one block
    (1, None, None, (4, 2), 16),  # each query sees itself only
]


@pytest.mark.parametrize("window,softcap,scale,heads,block", CASES)
def test_blocked_equals_dense_forward_and_backward(window, softcap, scale, heads, block):
    """Both forms of the blocked path: the scores written out (with the log-sum-exp) and, without a cap, SDPA per
    block with the block's mask."""
    q, k, v = qkv(nq=heads[0], nkv=heads[1], s=S)
    kw = {"window": window, "softcap": softcap, "scale": scale}
    ref, ref_lse = dense_reference(q, k, v, **kw)
    ref_grads = grads(ref, (q, k, v))
    out, lse = blocked_attention(q, k, v, block_size=block, return_lse=True, fused=False, **kw)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    forms = [out] + ([blocked_attention(q, k, v, block_size=block, fused=True, **kw)] if softcap is None else [])
    for out in forms:
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for ours, theirs in zip(grads(out, (q, k, v)), ref_grads):
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


def test_window_and_cap_change_the_result():
    """The cases above cannot pass on a window or cap that does nothing: both move the output."""
    q, k, v = qkv(s=S)
    full = dense_reference(q, k, v)[0]
    assert (blocked_attention(q, k, v, window=7) - full).abs().max() > 1e-2
    assert (blocked_attention(q, k, v, softcap=2.0) - full).abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 5])
def test_offset_queries_and_an_explicit_mask_as_generation_uses_them(window):
    """Queries after a cache of ``past`` keys (q_offset), with a padding mask per row, and one decoding query."""
    past, s = 12, 5
    q, k, v = qkv(s=s, t=past + s)
    pad = torch.ones(2, 1, s, past + s, dtype=torch.bool)
    pad[1, :, :, :3] = False  # row 1: three padding keys
    kw = {"window": window, "q_offset": past}
    for softcap in (3.0, None):  # written out, and SDPA per block
        out = blocked_attention(q, k, v, attn_mask=pad, block_size=2, softcap=softcap, **kw)
        for row in range(2):
            ref = dense_reference(q[row:row + 1], k[row:row + 1], v[row:row + 1], attn_mask=pad[row, 0],
                                  softcap=softcap, **kw)[0]
            torch.testing.assert_close(out[row:row + 1], ref, rtol=1e-12, atol=1e-12)
    one = attention(q[:, :, -1:], k, v, causal=False, q_offset=past + s - 1, window=window)
    torch.testing.assert_close(one, dense_reference(q[:, :, -1:], k, v, q_offset=past + s - 1, window=window)[0])


def test_key_range_grows_with_the_window_not_the_sequence():
    """A query block of 128 with W = 512 meets 639 keys wherever it sits; the causal block sees its prefix."""
    assert key_range(3968, 4096, 4096, causal=True, window=512) == (3457, 4096)
    assert key_range(0, 128, 4096, causal=True, window=512) == (0, 128)
    assert key_range(3968, 4096, 4096, causal=True, window=None) == (0, 4096)


def test_plain_causal_is_sdpa_bit_for_bit():
    q, k, v = qkv(dtype=torch.float32)
    assert choose_kernel(q)[0] == "sdpa"
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(attention(q, k, v), expected)
    # a window that cannot bind (W >= s) is no window: the same call
    assert choose_kernel(q, window=S)[0] == "sdpa" and torch.equal(attention(q, k, v, window=S), expected)


def test_the_kernel_choice_says_why():
    q = torch.zeros(1, 2, 16, 8)
    assert choose_kernel(q, window=4) == ("blocked", "not on CUDA: FlexAttention has no CPU backward")
    assert choose_kernel(q, softcap=30.0)[0] == "blocked"
    assert choose_kernel(q, return_lse=True)[0] == "blocked"
    assert choose_kernel(q, causal=False, q_offset=3)[0] == "sdpa"  # one decoding query: no causal offset needed
    assert choose_kernel(q, q_offset=3)[0] == "blocked"  # SDPA's is_causal aligns queries to the first key
    with pytest.raises(ValueError, match="sliding window must be >= 1"):
        attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="sdpa kernel takes no window"):
        attention(q, q, q, window=4, kernel="sdpa")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention runs on CUDA")
@pytest.mark.parametrize("window,softcap", [(64, None), (64, 30.0), (None, 30.0)])
def test_flex_equals_blocked_on_cuda(window, softcap):
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv(nq=4, nkv=2, s=256, d=64, dtype=torch.float32))
    assert choose_kernel(q, window=window, softcap=softcap)[0] == "flex"
    out = attention(q, k, v, window=window, softcap=softcap)
    ref = blocked_attention(q, k, v, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_dropout_on_the_blocked_path(softcap):
    """Dropout with a window: SDPA's own per block (no cap), F.dropout on the probabilities (cap); from the caller's
    generator, so a seed repeats it, and p=0 is the plain result."""
    q, k, v = qkv(dtype=torch.float32)
    kw = {"window": 7, "softcap": softcap}
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(attention(q, k, v, dropout_p=0.5, **kw))
    assert torch.equal(runs[0], runs[1]) and torch.isfinite(runs[0]).all()
    assert (runs[0] - attention(q, k, v, **kw)).abs().max() > 1e-2
