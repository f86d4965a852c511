"""From a rank's shard of a tensor-parallel parameter to the full tensor, and back to which rows it holds.

A sharded parameter carries ``partition_dim`` and ``partition_stride`` (``layers.set_tensor_model_parallel_
attributes``). With stride 1 rank r of p holds the r-th contiguous chunk of that dimension; with stride k the
dimension is cut into k*p blocks and rank r holds blocks r, r+p, ..., r+(k-1)p (``layers.shard_master_weight``).
These helpers invert that rule, so checkpoints can be written layout-free and read back into any tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zoo.parallel.topology import group_rank_and_size


def is_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def shard_ranges(full_size: int, rank: int, world: int, stride: int = 1) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges of the partitioned dimension that ``rank`` holds, in the order it holds them."""
    if full_size % (world * stride):
        raise ValueError(f"a dimension of {full_size} cannot be split into {world} ranks x stride {stride}")
    block = full_size // (world * stride)
    return [((rank + j * world) * block, (rank + j * world + 1) * block) for j in range(stride)]


def full_tensor(local: torch.Tensor, partition_dim: int, stride: int, tp_group) -> torch.Tensor:
    """All-gather ``local`` over ``tp_group`` and put its blocks back in the full tensor's order (every rank gets
    it)."""
    rank, world = group_rank_and_size(tp_group)
    if world == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.detach().contiguous(), group=tp_group)
    pieces = [p.chunk(stride, dim=partition_dim) for p in parts]  # pieces[r][j] is block r + j*world
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(world)], dim=partition_dim)


def gather_shards(local: torch.Tensor, tp_group) -> list[torch.Tensor]:
    """Every TP rank's ``local`` (the same shape on each), indexed by TP rank: an all-gather over ``tp_group``
    (a copy of ``local`` alone without one)."""
    world = group_rank_and_size(tp_group)[1]
    if world == 1:
        return [local.detach().clone()]
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.detach().contiguous(), group=tp_group)
    return parts


def gather_objects(obj, group=None) -> list:
    """``all_gather_object`` that also works without torch.distributed (a world of one)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_ints(values: list[int], group=None) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), indexed by rank: one small int64 ``all_gather`` on
    the accelerator (NCCL needs device tensors, gloo takes them too); a world of one without torch.distributed."""
    if not dist.is_initialized():
        return [list(values)]
    from deepspeed.accelerator import get_accelerator

    local = torch.tensor(values, dtype=torch.int64, device=get_accelerator().current_device_name())
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return [p.tolist() for p in parts]


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
