"""One attention function behind every GPT layer: causal, sliding windows, logit soft-capping, any query scale,
grouped-query heads; it chooses the kernel (:func:`choose_kernel`, the only place that does).

Notation: b batch, nq / nkv query / key-value heads, g = nq / nkv queries per kv head, s queries, t keys, d head dim.

What is attended (HF transformers 5.24 ``masking_utils``: ``causal_mask_function`` and ``sliding_window_overlay``,
as Mistral and Gemma 2 use them). Query i sits at position ``q_offset + i``, key j at position j:

    causal:       j <= q_offset + i
    window W:     j >  q_offset + i - W      (a query sees itself and the W - 1 keys before it)
    attn_mask:    attn_mask[..., i, j]       (boolean, True = attend)

all and-ed. The scores are S = scale q.k with scale = 1/sqrt(d) unless given (Gemma 2: query_pre_attn_scalar^-1/2);
soft-capping (Gemma 2) replaces them by c tanh(S / c) after the scaling and before the mask.

Kernels:
- ``sdpa``: ``F.scaled_dot_product_attention``, exactly the call the layers made before this module, for everything
  without a window, a soft cap or a log-sum-exp (a window that cannot bind, W >= q_offset + s, counts as none).
- ``flex``: FlexAttention (``torch.nn.attention.flex_attention``) on CUDA: the window as a block mask (blocks wholly
  outside it are skipped), the soft cap as a score_mod; compiled once, block masks kept per shape.
- ``blocked``: every other case: on CPU (FlexAttention has no CPU backward in torch 2.13, and SDPA with a boolean
  window mask still pays the full s x t), with dropout, with an explicit mask (generation). Each block of queries
  meets only the contiguous range of keys its window and causality allow, so the cost grows with s x (W + block),
  not s x t: per block SDPA with the block's mask where it can (no soft cap), else the scores written out in plain
  torch (a stable softmax per query block over that range, autograd's backward). Both are held to the definition.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

KERNELS = ("sdpa", "flex", "blocked")
BLOCK_SIZE = 128  # queries per block of the blocked path, at least


def binding_window(window: int | None, s: int, q_offset: int = 0) -> int | None:
    """The window, or None where it cannot exclude a key: the farthest pair is q_offset + s - 1 apart."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be >= 1 (the query sees itself), got {window}")
    return window if window is not None and window < q_offset + s else None


def choose_kernel(q: torch.Tensor, *, causal: bool = True, window: int | None = None, softcap: float | None = None,
                  dropout_p: float = 0.0, q_offset: int = 0, attn_mask: torch.Tensor | None = None,
                  return_lse: bool = False) -> tuple[str, str]:
    """(kernel, why): which kernel :func:`attention` runs for this call, and the reason in a few words."""
    window = binding_window(window, q.shape[2], q_offset)
    plain = window is None and softcap is None and not return_lse
    if plain and not (causal and (q_offset or attn_mask is not None)):
        return "sdpa", "no window, soft cap or log-sum-exp: the fused kernel"
    if not q.is_cuda:
        return "blocked", "not on CUDA: FlexAttention has no CPU backward"
    if dropout_p > 0:
        return "blocked", "FlexAttention has no dropout"
    if attn_mask is not None or q_offset:
        return "blocked", "an explicit mask or a query offset (generation): no block mask per decoding step"
    return "flex", "a window or a soft cap on CUDA"


def attention(q, k, v, *, causal: bool = True, window: int | None = None, softcap: float | None = None,
              scale: float | None = None, dropout_p: float = 0.0, q_offset: int = 0,
              attn_mask: torch.Tensor | None = None, return_lse: bool = False, kernel: str | None = None):
    """Attention of q ``[b, nq, s, d]`` over k, v ``[b, nkv, t, d]`` -> ``[b, nq, s, d]`` (and the log-sum-exp of
    each query's scores ``[b, nq, s]``, fp32 at least, with ``return_lse``). The module docstring says what is
    attended.

    ``kernel`` forces one (tests, benchmarks); by default :func:`choose_kernel` picks it. Dropout (``dropout_p``)
    draws from the caller's generator, on SDPA's and the blocked path alike.
    """
    window = binding_window(window, q.shape[2], q_offset)
    kernel = kernel or choose_kernel(q, causal=causal, window=window, softcap=softcap, dropout_p=dropout_p,
                                     q_offset=q_offset, attn_mask=attn_mask, return_lse=return_lse)[0]
    if kernel == "sdpa":
        if window is not None or softcap is not None or return_lse or (causal and (q_offset or attn_mask is not None)):
            raise ValueError("the sdpa kernel takes no window, soft cap, log-sum-exp or causal offset/mask; "
                             "use kernel='blocked' or let attention() choose")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal,
                                              scale=scale, enable_gqa=q.shape[1] != k.shape[1])  # [b, nq, s, d]
    if kernel == "flex":
        return flex_attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale,
                              return_lse=return_lse)
    if kernel == "blocked":
        return blocked_attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale,
                                 dropout_p=dropout_p, q_offset=q_offset, attn_mask=attn_mask, return_lse=return_lse)
    raise ValueError(f"attention kernel must be one of {KERNELS}, got {kernel!r}")


# ---------------------------------------------------------------------------------------------------------------
# The blocked path (plain torch; CPU, and the reference)
# ---------------------------------------------------------------------------------------------------------------


def key_range(i0: int, i1: int, t: int, *, causal: bool, window: int | None, q_offset: int = 0) -> tuple[int, int]:
    """The keys ``[lo, hi)`` that queries ``[i0, i1)`` may see: from the first query's window start to the last
    query's own position (causal), clipped to ``[0, t)``."""
    lo = 0 if window is None else max(0, q_offset + i0 - window + 1)
    hi = t if not causal else min(t, q_offset + i1)
    return lo, max(lo, hi)


def _allowed(i0, i1, lo, hi, *, causal, window, q_offset, device) -> torch.Tensor | None:
    """Boolean ``[i1 - i0, hi - lo]``, True = attend, by causality and window; None where every pair is allowed
    (decided from the positions alone: no look at a tensor, so nothing waits on a device)."""
    first = q_offset + i0 - lo  # the first query's position minus the first key's
    causal_binds = causal and hi - lo - 1 > first  # some key lies after some query
    window_binds = window is not None and first + (i1 - i0 - 1) >= window  # some key before some query's window
    if not (causal_binds or window_binds):
        return None
    return _relative_mask(first, i1 - i0, hi - lo, causal_binds, window if window_binds else None, str(device))


@functools.lru_cache(maxsize=64)
def _relative_mask(first: int, rows: int, keys: int, causal: bool, window: int | None, device: str) -> torch.Tensor:
    """The mask of a block by its queries' distances to its keys; every block inside the sequence has the same one,
    so it is built once. Outside inference mode: SDPA and masked_fill keep it for the backward."""
    with torch.inference_mode(False):
        diff = first + torch.arange(rows, device=device)[:, None] - torch.arange(keys, device=device)  # [rows, keys]
        ok = diff >= 0 if causal else torch.ones(rows, keys, dtype=torch.bool, device=device)
        return ok & (diff < window) if window is not None else ok


def _query_blocks(q, k, v, bq, *, causal, window, q_offset):
    """``(i0, i1, lo, hi, q block, k block, v block)`` per block of bq queries. Keys are split once into blocks of bq
    and each query block gets the key blocks its range ``key_range`` touches, concatenated: autograd then sums each
    key block's gradient from the query blocks that used it and joins them once (slicing the whole k and v per
    block instead would write a full-size gradient per block, s^2 / bq in all)."""
    s, t = q.shape[2], k.shape[2]
    q_blocks, k_blocks, v_blocks = q.split(bq, dim=2), k.split(bq, dim=2), v.split(bq, dim=2)
    for n, q_block in enumerate(q_blocks):
        i0, i1 = n * bq, min((n + 1) * bq, s)
        lo, hi = key_range(i0, i1, t, causal=causal, window=window, q_offset=q_offset)
        first, last = lo // bq, max(lo // bq + 1, -(-hi // bq))
        yield (i0, i1, first * bq, min(t, last * bq), q_block, _join(k_blocks[first:last]),
               _join(v_blocks[first:last]))


def _join(blocks: tuple) -> torch.Tensor:
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)


def _mask5(attn_mask: torch.Tensor, nkv: int) -> torch.Tensor:
    """A boolean mask ``[s, t]``, ``[b, 1, s, t]`` or ``[b, nq, s, t]`` as ``[.., nkv, g, s, t]`` (broadcastable)."""
    if attn_mask.dim() == 2:
        return attn_mask
    b, h, s, t = attn_mask.shape
    return attn_mask.unsqueeze(2) if h == 1 else attn_mask.reshape(b, nkv, h // nkv, s, t)


def blocked_attention(q, k, v, *, causal: bool = True, window: int | None = None, softcap: float | None = None,
                      scale: float | None = None, dropout_p: float = 0.0, q_offset: int = 0,
                      attn_mask: torch.Tensor | None = None, return_lse: bool = False,
                      block_size: int | None = None, fused: bool | None = None):
    """:func:`attention` a block of queries at a time, each against the keys its window and causality allow.

    ``block_size`` queries per block (default: the window, at least :data:`BLOCK_SIZE`, so a block scores about 2W
    keys and there are s/W blocks). Per block, ``fused`` (the default where there is no soft cap and no log-sum-exp
    to return): SDPA with the block's boolean mask, its fused kernel and its backward on the block's keys only.
    Otherwise the scores written out (matmul, cap, mask, softmax in fp32 at least; autograd's backward), which the
    tests hold to the definition alongside the fused form. Memory: one ``[b, nq, block, keys]`` probability block
    per query block at most, s x (W + block) in all.
    """
    nq, s, nkv = q.shape[1], q.shape[2], k.shape[1]
    if nq % nkv:
        raise ValueError(f"{nq} query heads cannot share {nkv} key-value heads equally")
    window = binding_window(window, s, q_offset)
    fused = softcap is None and not return_lse if fused is None else fused
    if fused and (softcap is not None or return_lse):
        raise ValueError("the fused blocks (SDPA) take no soft cap and return no log-sum-exp; use fused=False")
    bq = block_size or max(BLOCK_SIZE, window or 0)
    if not fused:
        return _written_out(q, k, v, causal, window, softcap, scale, dropout_p, q_offset, attn_mask, return_lse, bq)
    outs = []
    for i0, i1, lo, hi, q_blk, k_blk, v_blk in _query_blocks(q, k, v, bq, causal=causal, window=window,
                                                             q_offset=q_offset):
        ok = _allowed(i0, i1, lo, hi, causal=causal, window=window, q_offset=q_offset, device=q.device)
        if attn_mask is not None:
            block = attn_mask[..., i0:i1, lo:hi]
            ok = block if ok is None else ok & block
        outs.append(F.scaled_dot_product_attention(q_blk, k_blk, v_blk, attn_mask=ok, dropout_p=dropout_p,
                                                   scale=scale, enable_gqa=nq != nkv))  # [b, nq, bq, d]
    return torch.cat(outs, dim=2)


def _written_out(q, k, v, causal, window, softcap, scale, dropout_p, q_offset, attn_mask, return_lse, bq):
    """The blocked path with its scores as plain tensors: what SDPA cannot do (soft cap, log-sum-exp)."""
    b, nq, _, d = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    scale = d ** -0.5 if scale is None else scale
    work = torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(work), k.to(work), v.to(work)
    mask5 = None if attn_mask is None else _mask5(attn_mask, nkv)
    outs, lses = [], []
    for i0, i1, lo, hi, q_blk, k_blk, v_blk in _query_blocks(q, k, v, bq, causal=causal, window=window,
                                                             q_offset=q_offset):
        # query head j = m g + u uses kv head m: a kv head's g query heads as one matrix of g * bq rows
        rows = q_blk.reshape(b, nkv, g * (i1 - i0), d)
        scores = torch.matmul(rows, k_blk.transpose(-1, -2)) * scale  # [b, nkv, g bq, keys]
        scores = scores.view(b, nkv, g, i1 - i0, hi - lo)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        ok = _allowed(i0, i1, lo, hi, causal=causal, window=window, q_offset=q_offset, device=q.device)
        if mask5 is not None:
            block = mask5[..., i0:i1, lo:hi]
            ok = block if ok is None else ok & block
        if ok is not None:
            scores = scores.masked_fill(~ok, float("-inf"))
        if return_lse:
            lses.append(torch.logsumexp(scores, dim=-1).reshape(b, nq, i1 - i0))
        p = torch.softmax(scores, dim=-1)
        if dropout_p > 0:
            p = F.dropout(p, dropout_p)
        out = torch.matmul(p.reshape(b, nkv, g * (i1 - i0), hi - lo), v_blk)  # [b, nkv, g bq, d]
        outs.append(out.view(b, nq, i1 - i0, d))
    out = torch.cat(outs, dim=2).to(q.dtype)
    return (out, torch.cat(lses, dim=2)) if return_lse else out


# ---------------------------------------------------------------------------------------------------------------
# FlexAttention (CUDA)
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _compiled_flex():
    """flex_attention compiled once (torch's advice: eager flex_attention materialises the scores); each new shape
    compiles once more, as any compiled function."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=False)


@functools.lru_cache(maxsize=64)
def _block_mask(s: int, t: int, causal: bool, window: int | None, device: str):
    """The causal/window mask as FlexAttention's block mask, built once per (shape, window) and shared by layers."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        ok = kv_idx <= q_idx if causal else kv_idx >= 0
        return ok & (kv_idx > q_idx - window) if window is not None else ok

    return create_block_mask(mask_mod, None, None, s, t, device=device)


@functools.lru_cache(maxsize=16)
def _softcap_mod(cap: float):
    """One score_mod per cap value (the same function object each call: no recompilation per layer)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod


def flex_attention(q, k, v, *, causal: bool = True, window: int | None = None, softcap: float | None = None,
                   scale: float | None = None, return_lse: bool = False):
    """:func:`attention` by FlexAttention (no dropout, no query offset, no explicit mask: :func:`choose_kernel`)."""
    s, t = q.shape[2], k.shape[2]
    window = binding_window(window, s)
    block_mask = _block_mask(s, t, causal, window, str(q.device)) if causal or window is not None else None
    score_mod = None if softcap is None else _softcap_mod(float(softcap))
    out = _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                           enable_gqa=q.shape[1] != k.shape[1], return_lse=return_lse)
    if return_lse:
        return out[0], out[1].float()
    return out
