"""Context parallelism: one sequence split over the ranks of a CP group, attention computed across them.

Every layer but attention works token by token and runs unchanged on this rank's tokens; attention needs every
key, and two algorithms bring them. Notation: b batch, s the whole sequence, cp the group size, s_l = s/cp this
rank's tokens, nq / nkv query / key-value heads, g = nq/nkv queries per kv head, d head dim, c = s/(2 cp) a ring
chunk. Positions are global (0 .. s-1); the loss is the mean over all s positions (:func:`context_parallel_mean`).

Ulysses (DeepSpeed-Ulysses, Jacobs et al., arXiv 2309.14509). Rank i holds positions [i s_l, (i+1) s_l). An
all-to-all turns q, k, v ``[b, n, s_l, d]`` (all heads, this rank's positions) into ``[b, n/cp, s, d]`` (the whole
sequence, this rank's heads); attention runs per head as in one process, and a second all-to-all turns the output
back. The head count bounds cp: cp must divide nq, and kv heads are replicated to lcm(nkv, cp) where cp does not
divide nkv (as DeepSpeed's HF path does), so each rank's query heads meet their own kv heads.

Ring attention (Liu et al., arXiv 2310.01889; blockwise as FlashAttention, arXiv 2205.14135). Each rank keeps its
queries and passes its key/value block around the ring; after cp steps every query has met every block. Blocks
merge exactly through their log-sum-exps L = log sum_k exp(S_k) (S the scaled scores q.k):

    L = log(exp(L_a) + exp(L_b)),    O = exp(L_a - L) O_a + exp(L_b - L) O_b

The backward recomputes a block's probabilities from the final L, P = exp(S - L), and with D = rowsum(dO o O)
(FlashAttention-2, arXiv 2307.08691, Alg. 2):

    dV = P^T dO,   dP = dO V^T,   dS = P o (dP - D),   dQ = scale dS K,   dK = scale dS^T Q

dQ stays with its queries; dK, dV travel around the ring with their block and reach its owner after cp steps.

Load balance (Megatron-Core's causal split for context parallelism). With a contiguous split the causal mask leaves
rank 0 one block of work and rank cp-1 cp blocks. The ring layout cuts the sequence into 2 cp chunks and rank i
holds chunks i and 2cp-1-i, an early one and a late one, in that order. A chunk sees earlier chunks fully, itself
causally, later ones not at all, so at ring step t, with the block of rank j = (i - t) mod cp:

    j == i:  both local chunks against both, causally        c (2c + 1) pairs
    j <  i:  both local chunks against j's first chunk        2c^2 pairs (j's second chunk is later than both)
    j >  i:  the local second chunk against both of j's       2c^2 pairs (the first local chunk is earlier than both)

and every rank attends c (2c + 1) + (cp - 1) 2c^2 pairs; the fully masked halves are never computed.

Sliding windows and soft-capping (zoo.models.attention's semantics: a query at p sees keys p - W < j <= p; scores
c tanh(S / c)). With a window, each of a rank's two chunks meets each of the visiting block's two chunks by their
global positions, and a chunk pair wholly outside the window is skipped (the block still travels on), so a rank
computes about s_l x W pairs, not s_l x s / 2. The cap enters the backward through its derivative:
dS_raw = dS o (1 - tanh^2(S_raw / c)).

The ring's blocks are plain torch matmuls in fp32 (scores ``[b, nkv, g, rows, keys]`` materialised per block); a
fused kernel that returns the log-sum-exp (flash-attn's ``return_lse``) is the drop-in for long sequences on GPUs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zoo.parallel.mappings import all_to_all_scatter_gather
from zoo.parallel.topology import group_rank_and_size

ALGORITHMS = ("ulysses", "ring")


# ---------------------------------------------------------------------------------------------------------------
# How a sequence is split
# ---------------------------------------------------------------------------------------------------------------


def check_sequence_split(s: int, cp: int, algorithm: str) -> None:
    """One line where the sequence cannot be split: s must be a multiple of cp (ulysses) or of 2 cp (ring)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"context-parallel algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    parts = cp if algorithm == "ulysses" else 2 * cp
    if s % parts:
        why = "" if algorithm == "ulysses" else " (ring: 2 chunks per rank, for the causal load balance)"
        raise ValueError(f"sequence length {s} is not divisible by {parts} = {'cp' if parts == cp else '2*cp'} "
                         f"at cp={cp}{why}; use a sequence length that is a multiple of {parts}")


def sequence_positions(s: int, cp_rank: int, cp: int, algorithm: str, device=None) -> torch.Tensor:
    """The global positions ``[s/cp]`` of the tokens rank ``cp_rank`` holds, in the order it holds them."""
    check_sequence_split(s, cp, algorithm)
    if algorithm == "ulysses":
        s_l = s // cp
        return torch.arange(cp_rank * s_l, (cp_rank + 1) * s_l, device=device)
    c = s // (2 * cp)
    first, second = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat((torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)))


def check_ulysses_heads(nq: int, cp: int) -> None:
    """One line where Ulysses cannot split the query heads (of one TP rank) over cp ranks."""
    if nq % cp:
        raise ValueError(f"Ulysses splits the {nq} query heads (of one TP rank) over cp={cp} ranks and {cp} does not "
                         f"divide {nq}; use a cp that divides it or cp_algorithm='ring'")


def split_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp: int, algorithm: str) -> torch.Tensor:
    """This rank's share of ``x`` along the sequence dimension ``dim``: positions :func:`sequence_positions`."""
    check_sequence_split(x.shape[dim], cp, algorithm)
    if algorithm == "ulysses":
        return x.chunk(cp, dim=dim)[cp_rank].contiguous()
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]), dim=dim)


# ---------------------------------------------------------------------------------------------------------------
# Ulysses
# ---------------------------------------------------------------------------------------------------------------


def ulysses_attention(q, k, v, group, *, causal: bool = True, dropout_p: float = 0.0, scale: float | None = None,
                      attend=None):
    """Attention over the whole sequence, heads split over the CP group (contiguous layout).

    q ``[b, nq, s_l, d]``, k, v ``[b, nkv, s_l, d]`` -> ``[b, nq, s_l, d]``. Dropout draws from the caller's
    generator on this rank's heads (run it under a stream that differs per rank). ``attend(q, k, v)``, if given,
    replaces SDPA (and ``causal``, ``dropout_p``, ``scale``): the model's own attention function, whose windows and
    soft caps apply unchanged, since each rank holds the whole sequence of its heads.
    """
    cp = group_rank_and_size(group)[1]
    nq, nkv = q.shape[1], k.shape[1]
    if cp > 1:
        check_ulysses_heads(nq, cp)
        if nkv % cp:  # each kv head copied r times stays next to its copies: query head j still meets j // (nq/nkv)
            r = math.lcm(nkv, cp) // nkv
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)  # [b, lcm(nkv, cp), s_l, d]
        q, k, v = (all_to_all_scatter_gather(t, 1, 2, group) for t in (q, k, v))  # [b, n/cp, s, d]
    if attend is not None:
        out = attend(q, k, v)  # [b, nq/cp, s, d]
    else:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])  # [b, nq/cp, s, d]
    return all_to_all_scatter_gather(out, 2, 1, group) if cp > 1 else out  # [b, nq, s_l, d]


# ---------------------------------------------------------------------------------------------------------------
# Ring
# ---------------------------------------------------------------------------------------------------------------


def _ring_block(rank: int, step: int, cp: int, s_l: int, causal: bool) -> tuple[slice, slice, bool]:
    """What rank ``rank`` computes at ring step ``step``: (its query rows, the block's key rows, causal)."""
    every = slice(0, s_l)
    if not causal:
        return every, every, False
    j = (rank - step) % cp
    if j == rank:
        return every, every, True
    half = s_l // 2
    return (every, slice(0, half), False) if j < rank else (slice(half, s_l), every, False)


def ring_attended_pairs(s: int, cp: int, causal: bool = True) -> list[int]:
    """Per rank, the (query, key) pairs ring attention computes on the ring layout (causal: the balanced split)."""
    check_sequence_split(s, cp, "ring")
    s_l, counts = s // cp, []
    for rank in range(cp):
        n = 0
        for step in range(cp):
            rows, keys, diagonal = _ring_block(rank, step, cp, s_l, causal)
            nq, nk = rows.stop - rows.start, keys.stop - keys.start
            n += nq * (nq + 1) // 2 if diagonal else nq * nk
        counts.append(n)
    return counts


def _ring_pieces(rank: int, step: int, cp: int, s_l: int, causal: bool, window: int | None, device=None) -> list:
    """What rank ``rank`` computes at ring step ``step``: ``(query rows, key rows, allowed)`` pieces, ``allowed``
    None (every pair) or a boolean ``[rows, keys]``; pieces wholly outside the window are left out.

    Without a window, the one block of :func:`_ring_block`. With one (causal only), each of this rank's two chunks
    against each of the visiting block's two, placed by their global positions: a query at p sees keys at p - W < j
    <= p; a chunk pair with no such key costs nothing (its K/V still travel on, for the ranks after), one partly
    inside is cut to the rows and keys that meet (about W x W at two chunks' near corner).
    """
    if window is None:
        rows, keys, diagonal = _ring_block(rank, step, cp, s_l, causal)
        n = rows.stop - rows.start
        return [(rows, keys, torch.ones(n, n, dtype=torch.bool, device=device).tril() if diagonal else None)]
    c, j = s_l // 2, (rank - step) % cp
    pieces = []
    for a, q_start in enumerate((rank * c, (2 * cp - 1 - rank) * c)):  # the global starts of this rank's chunks
        for b, k_start in enumerate((j * c, (2 * cp - 1 - j) * c)):
            offset = q_start - k_start  # query minus key position at the chunks' first rows; pairs: offset +- (c-1)
            if offset + c - 1 < 0 or offset - c + 1 > window - 1:
                continue
            if offset - c + 1 >= 0 and offset + c - 1 <= window - 1:
                pieces.append((slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c), None))
                continue
            # only the rows and keys that meet some pair 0 <= offset + r - t < W: a box at the chunks' near corner
            r0, r1 = max(0, -offset), min(c, window - offset + c - 1)
            t0, t1 = max(0, offset - window + 1), min(c, offset + c)
            diff = offset + torch.arange(r0, r1, device=device)[:, None] - torch.arange(t0, t1, device=device)
            pieces.append((slice(a * c + r0, a * c + r1), slice(b * c + t0, b * c + t1), (diff >= 0) & (diff < window)))
    return sorted(pieces, key=lambda p: p[0] != p[1])  # the own diagonal first: every row starts finite


def _scores(q, k, scale, allowed, softcap):
    """q ``[b, nkv, g, rows, d]``, k ``[b, nkv, keys, d]`` -> scores ``[b, nkv, g, rows, keys]``: scaled, capped
    (c tanh(S / c)), then masked where ``allowed`` is False; and tanh(S / c) (None without a cap) for the backward."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s, t


def _block_forward(q, k, v, scale, allowed, softcap):
    s = _scores(q, k, scale, allowed, softcap)[0]
    lse = torch.logsumexp(s, dim=-1)  # [b, nkv, g, rows]; -inf on a row the window leaves without keys here
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))  # such a row: all zeros
    return torch.matmul(p, v.unsqueeze(2)), lse  # [b, nkv, g, rows, d]


def _block_backward(q, k, v, dout, lse, delta, scale, allowed, softcap):
    s, t = _scores(q, k, scale, allowed, softcap)
    p = torch.exp(s - lse.unsqueeze(-1))  # [b, nkv, g, rows, keys]
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)  # [b, nkv, keys, d]: summed over the g query heads
    dp = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    if t is not None:  # d(c tanh(S / c)) / dS = 1 - tanh^2
        ds = ds * (1 - t * t)
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale  # [b, nkv, g, rows, d]
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale  # [b, nkv, keys, d]
    return dq, dk, dv


def _ring_send_recv(send: torch.Tensor, group):
    """Post: ``send`` to the next rank of the group, a tensor like it from the previous one. -> (recv, requests)."""
    rank, world = group_rank_and_size(group)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)
    recv = torch.empty_like(send)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prev, group)])
    return recv, reqs


def _wait(reqs):
    for req in reqs:
        req.wait()


class _RingAttention(torch.autograd.Function):
    """q ``[b, nkv, g, s_l, d]``, kv ``[2, b, nkv, s_l, d]`` (keys and values stacked: one message per step)."""

    @staticmethod
    def forward(ctx, q, kv, group, causal, scale, window, softcap):
        rank, cp = group_rank_and_size(group)
        s_l = q.shape[-2]
        q32 = q.float()
        out = torch.zeros_like(q32)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # [b, nkv, g, s_l]
        block = kv
        for step in range(cp):
            if step < cp - 1:  # the next block travels while this one is computed
                incoming, reqs = _ring_send_recv(block, group)
            for rows, keys, allowed in _ring_pieces(rank, step, cp, s_l, causal, window, q.device):
                k, v = block[0, :, :, keys].float(), block[1, :, :, keys].float()
                o_blk, l_blk = _block_forward(q32[..., rows, :], k, v, scale, allowed, softcap)
                l_old = lse[..., rows]
                l_new = torch.logaddexp(l_old, l_blk)  # the diagonal comes first: no row is -inf on both sides
                out[..., rows, :] = (out[..., rows, :] * torch.exp(l_old - l_new).unsqueeze(-1)
                                     + o_blk * torch.exp(l_blk - l_new).unsqueeze(-1))
                lse[..., rows] = l_new
            if step < cp - 1:
                _wait(reqs)
                block = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.window, ctx.softcap = group, causal, scale, window, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        group, causal, scale, window, softcap = ctx.group, ctx.causal, ctx.scale, ctx.window, ctx.softcap
        rank, cp = group_rank_and_size(group)
        s_l = q.shape[-2]
        q32, dout32 = q.float(), dout.float()
        delta = (dout32 * out.float()).sum(-1)  # D = rowsum(dO o O): [b, nkv, g, s_l]
        dq = torch.zeros_like(q32)
        block, dkv_reqs, dkv_in = kv, [], None
        for step in range(cp):
            if step < cp - 1:
                incoming, reqs = _ring_send_recv(block, group)
            # This block's dK, dV so far: the previous ranks' share arrives with it (step 0: it is ours, none yet).
            _wait(dkv_reqs)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device) if step == 0 else dkv_in
            for rows, keys, allowed in _ring_pieces(rank, step, cp, s_l, causal, window, q.device):
                k, v = block[0, :, :, keys].float(), block[1, :, :, keys].float()
                dq_blk, dk, dv = _block_backward(q32[..., rows, :], k, v, dout32[..., rows, :], lse[..., rows],
                                                 delta[..., rows], scale, allowed, softcap)
                dq[..., rows, :] += dq_blk
                dkv[0, :, :, keys] += dk
                dkv[1, :, :, keys] += dv
            dkv_in, dkv_reqs = _ring_send_recv(dkv, group)  # after the last step it reaches the block's owner
            if step < cp - 1:
                _wait(reqs)
                block = incoming
        _wait(dkv_reqs)
        return dq.to(q.dtype), dkv_in.to(kv.dtype), None, None, None, None, None


def ring_attention(q, k, v, group, *, causal: bool = True, scale: float | None = None, window: int | None = None,
                   softcap: float | None = None):
    """Attention over the whole sequence, key/value blocks passed around the CP group (ring layout when causal).

    q ``[b, nq, s_l, d]``, k, v ``[b, nkv, s_l, d]`` -> ``[b, nq, s_l, d]``; any nq divisible by nkv, any cp.
    Forward: cp steps of ``batch_isend_irecv`` to the next rank, each overlapped with a block's attention, merged by
    log-sum-exp in fp32. Backward: the blocks go around again, dQ accumulates here, dK and dV travel home.
    ``window`` (causal only: a query at p sees keys p - W < j <= p) skips the chunk pairs wholly outside it;
    ``softcap`` scores c tanh(S / c) after the scale, before the mask (zoo.models.attention's semantics).
    """
    rank, cp = group_rank_and_size(group)
    b, nq, s_l, d = q.shape
    nkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if window is not None and not causal:
        raise ValueError("ring attention takes a sliding window with causal attention only; set causal=True")
    if window is not None and window >= s_l * cp:
        window = None  # no query is that far from a key
    if nq % nkv:
        raise ValueError(f"{nq} query heads cannot share {nkv} key-value heads equally")
    q5 = q.reshape(b, nkv, nq // nkv, s_l, d)  # query head j = m g + u uses kv head m
    if cp == 1:
        if window is None and softcap is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=nq != nkv)
        diff = torch.arange(s_l, device=q.device)[:, None] - torch.arange(s_l, device=q.device)  # autograd's backward
        allowed = None if not causal else (diff >= 0) & (diff < (s_l if window is None else window))
        return _block_forward(q5, k, v, scale, allowed, softcap)[0].to(q.dtype).reshape(b, nq, s_l, d)
    if causal:
        check_sequence_split(s_l * cp, cp, "ring")
    out = _RingAttention.apply(q5, torch.stack((k, v)), group, causal, scale, window, softcap)
    return out.reshape(b, nq, s_l, d)


# ---------------------------------------------------------------------------------------------------------------
# The loss over the whole sequence
# ---------------------------------------------------------------------------------------------------------------


class _ContextParallelMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_sum, local_count, group):
        totals = torch.stack((local_sum.detach().float(), local_count.float()))
        dist.all_reduce(totals, group=group)
        ctx.scale = group_rank_and_size(group)[1] / totals[1].clamp(min=1)
        return (totals[0] / totals[1].clamp(min=1)).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None


def context_parallel_mean(local_sum: torch.Tensor, local_count: torch.Tensor, group) -> torch.Tensor:
    """The mean over the CP group's tokens: sum of ``local_sum`` / sum of ``local_count`` (at least 1).

    Forward: all-reduce both over the group; every rank gets the mean of the whole sequence. Backward: ``local_sum``
    gets cp / global_count, so the gradients the ranks compute, *averaged* over the CP group (as a trainer's dp x cp
    gradient all-reduce does), are the gradient of the whole sequence's mean. A trainer that sums over cp instead
    divides by cp. A group of one: ``local_sum / max(local_count, 1)``.
    """
    if group_rank_and_size(group)[1] == 1:
        return local_sum / local_count.clamp(min=1)
    return _ContextParallelMean.apply(local_sum, local_count, group)
