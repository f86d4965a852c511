"""A forward pass through a pipeline without DeepSpeed's engine, for inference and checks.

``PipelineModule.forward(x)`` runs only this stage's layers. To run the whole model once, stage 0 feeds it the
input, each stage sends its output to the same TP/DP coordinate of the next stage (``grid.pp_ranks``), and the
last stage holds the result, as in GPipe's (arXiv 1811.06965) forward with one micro-batch. No gradients flow,
so there is no backward counterpart: everything runs under ``torch.no_grad()``.

A tensor travels with a small header ``[dtype code, ndim, sizes...]`` so the receiver needs no prior knowledge of
its shape (hidden states between blocks, logits at the end).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
_MAX_DIMS = 8


def send_tensor(t: torch.Tensor, dst: int) -> None:
    """Blocking send of ``t`` (header, then payload) to global rank ``dst``."""
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"send_tensor handles up to {_MAX_DIMS} dimensions, got {t.dim()}")
    header = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64, device=t.device)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header, dst)
    dist.send(t.contiguous(), dst)


def recv_tensor(src: int, device="cpu") -> torch.Tensor:
    """Blocking receive of a tensor sent by :func:`send_tensor` from global rank ``src``."""
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, src)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    out = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(out, src)
    return out


def move_tensor(t: torch.Tensor | None, src: int, dst: int, device="cpu") -> torch.Tensor | None:
    """Global rank ``src`` hands ``t`` to global rank ``dst``; returns it there (``t`` itself when src == dst),
    None on every other rank. Only src and dst need to call it."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if src == dst:
        return t if rank == src else None
    if rank == src:
        send_tensor(t, dst)
    elif rank == dst:
        return recv_tensor(src, device)
    return None


@torch.no_grad()
def pipeline_forward(module, x, grid, device="cpu"):
    """Run ``x`` through every stage of ``module`` (a ``PipelineModule`` on ``grid``); every rank of the grid
    calls it. Returns the last stage's output there, None on other stages. ``x`` is only read on stage 0."""
    if grid is None or grid.pp == 1:
        return module(x)
    stage, ranks = grid.pp_rank, grid.pp_ranks
    if stage > 0:
        x = recv_tensor(ranks[stage - 1], device)
    out = module(x)
    if stage < grid.pp - 1:
        send_tensor(out, ranks[stage + 1])
        return None
    return out
