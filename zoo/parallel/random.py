"""Random number streams for tensor parallelism (Megatron-LM's RNG tracker).

Two streams exist on every rank:

- the default generator, seeded with ``seed`` on every rank: dropout on replicated activations (after the
  row-parallel all-reduce, in embeddings) draws the same mask on all TP ranks, as if computed once;
- the tensor-parallel stream, seeded with ``seed + 2718 + tp_rank``: dropout on TP-sharded activations
  (attention probabilities of this rank's heads) draws a different mask per shard, as a single process would
  draw different values for different heads.

Both streams depend only on ``seed`` and the TP rank, so data-parallel replicas agree and runs repeat.

With context parallelism each CP rank holds other tokens, so both streams are offset by ``cp_rank`` (a large odd
stride, far from the TP offsets): hidden dropout draws another mask per CP rank, as one process draws other values
for other positions. At ``cp_rank = 0`` (and so without CP) the seeds are exactly those above.

The tracker is DeepSpeed's own (``deepspeed.runtime.activation_checkpointing.checkpointing``): DeepSpeed's
activation checkpointing saves and restores exactly this tracker around recomputation, so a recomputed block
draws the same dropout masks as its first forward pass.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

TENSOR_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's (and Megatron's) name for the stream
_TP_SEED_OFFSET = 2718
_CP_SEED_STRIDE = 1_000_003  # per CP rank, on both streams


def get_rng_tracker():
    """The tracker holding the tensor-parallel stream (DeepSpeed's, shared with activation checkpointing)."""
    return ds_checkpointing.get_cuda_rng_tracker()


def model_parallel_seed(seed: int, tp_rank: int = 0, cp_rank: int = 0) -> None:
    """Seed Python, NumPy, the default torch generators and the tensor-parallel stream.

    Call it on every rank with the same ``seed``; ``tp_rank`` and ``cp_rank`` come from the grid. Python and NumPy
    get ``seed`` on every rank; the torch streams are offset by the CP rank (module docstring).
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch_seed = seed + _CP_SEED_STRIDE * cp_rank
    torch.manual_seed(torch_seed)
    get_accelerator().manual_seed_all(torch_seed)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(TENSOR_PARALLEL_RNG, torch_seed + _TP_SEED_OFFSET + tp_rank)


@contextlib.contextmanager
def tensor_parallel_rng(enabled: bool = True):
    """Run the body (e.g. dropout on sharded activations) on the tensor-parallel stream.

    Outside a seeded run (no stream registered) the default generator is used, so layers still work in a
    plain process that never called :func:`model_parallel_seed`. ``enabled=False`` (nothing random in the body,
    e.g. attention without dropout) does nothing: switching streams copies the tracker's state dict, which
    ``torch.compile`` cannot trace, so a compiled block must not switch when it draws nothing.
    """
    if not enabled:
        yield
        return
    tracker = get_rng_tracker()
    if TENSOR_PARALLEL_RNG not in tracker.get_states():
        yield
        return
    with tracker.fork(TENSOR_PARALLEL_RNG):
        yield


def configure_activation_checkpointing(grid=None, **kwargs) -> None:
    """Point DeepSpeed's activation checkpointing at the TP group of ``grid`` (a ParallelGrid or None)."""
    ds_checkpointing.configure(mpu_=grid, **kwargs)


def checkpoint(function, *args):
    """Recompute ``function(*args)`` in the backward pass, restoring both RNG streams (DeepSpeed's checkpoint)."""
    return ds_checkpointing.checkpoint(function, *args)
