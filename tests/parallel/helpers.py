"""Small helpers shared by the parallel tests (references are computed here, independently of zoo)."""

import torch
import torch.distributed as dist

from zoo.parallel.topology import initialize_model_parallel

TOL = dict(rtol=1e-6, atol=1e-6)


def grid_for(tp: int, pp: int = 1):
    """The grid in a worker; ``None`` (no torch.distributed at all) for tp=pp=1 in the pytest process."""
    if tp == pp == 1 and not dist.is_initialized():
        return None
    return initialize_model_parallel(tp, pp)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chunk(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Rank's contiguous 1/world slice of ``full`` along ``dim`` (the reference for every sharding)."""
    return full.chunk(world, dim=dim)[rank]


def assert_close(actual, expected, what=""):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")
