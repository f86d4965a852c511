"""Tensor-parallel layers (Megatron-LM, arXiv 1909.08053, Sec. 3).

- ``ColumnParallelLinear``: Y = XA + b, with A split along its columns (output features) as
  A = [A_1, ..., A_p]; rank i computes Y_i = X A_i + b_i.
- ``RowParallelLinear``: Y = XA + b, with A split along its rows (input features) as A = [A_1; ...; A_p] and
  X = [X_1, ..., X_p]; rank i computes X_i A_i, the partial sums are all-reduced, and b is added once.
- ``VocabParallelEmbedding``: the table split along the vocabulary; each rank looks up the ids it owns, writes
  zeros for the others, and the partial results are all-reduced.

Weights are stored like ``nn.Linear`` (``[out, in]``), so "columns of A" are rows of ``weight`` (partition_dim 0).

Initialization: every rank builds the *full* master weight from the current RNG state on the CPU and keeps its
slice, so a model built at tp=N with a seed is exactly the tp=1 model with that seed, cut into pieces
(Megatron's ``use_cpu_initialization``). Sharded parameters carry ``tensor_model_parallel``,
``partition_dim`` and ``partition_stride``, which DeepSpeed reads to count each shard once in the gradient norm.

With ``sequence_parallel=True`` (arXiv 2205.05198) activations outside these layers are split along the
sequence (dim 1 of ``[b, s, h]``): the column layer all-gathers its input and the row layer reduce-scatters its
output. A replicated parameter then only sees part of the sequence, so its gradient is summed over TP.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zoo.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from zoo.parallel.topology import get_tensor_model_parallel_group, group_rank_and_size

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def init_method_normal(std: float) -> InitMethod:
    """N(0, std^2), Megatron's default for every weight (std 0.02 for GPT)."""
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, (std / sqrt(2 * num_layers))^2) for the output projections feeding the residual stream (GPT-2)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size {denominator}; "
            f"use a tp that divides {numerator}"
        )
    return numerator // denominator


def set_tensor_model_parallel_attributes(param: torch.Tensor, partition_dim: int, stride: int = 1) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def mark_sequence_parallel(param: torch.Tensor) -> None:
    """A replicated parameter used on sequence shards: its gradient must be summed over the TP group."""
    param.sequence_parallel = True


def shard_master_weight(master: torch.Tensor, partition_dim: int, rank: int, world_size: int,
                        stride: int = 1) -> torch.Tensor:
    """This rank's slice of a full tensor: ``stride`` blocks per rank, taken round-robin (Megatron's rule).

    With stride 1 rank r keeps the r-th contiguous chunk. With stride k the dimension is cut into k*p blocks and
    rank r keeps blocks r, r+p, r+2p, ...: the layout of a fused weight such as [gate; up] whose halves are each
    split over TP.
    """
    size = master.shape[partition_dim]
    per_block = divide(size, world_size * stride, f"dimension {partition_dim} of a {tuple(master.shape)} weight / stride {stride}")
    blocks = torch.split(master, per_block, dim=partition_dim)
    return torch.cat(blocks[rank::world_size], dim=partition_dim).contiguous()


def _init_sharded(shape, partition_dim, stride, init_method, rank, world, dtype, device) -> nn.Parameter:
    master = torch.empty(shape, dtype=torch.float32)
    init_method(master)
    local = shard_master_weight(master, partition_dim, rank, world, stride)
    param = nn.Parameter(local.to(device=device, dtype=dtype))
    set_tensor_model_parallel_attributes(param, partition_dim, stride)
    return param


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split along the output features: ``weight`` is ``[output_size / tp, input_size]``.

    Input: ``[..., input_size]``, replicated on the TP group (or sequence-sharded ``[b, s/tp, h]`` with
    ``sequence_parallel``). Output: ``[..., output_size / tp]``, or the full ``[..., output_size]`` with
    ``gather_output=True``.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, gather_output: bool = False,
                 init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1, sequence_parallel: bool = False,
                 tp_group=None, params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel=True")
        self.tp_group = get_tensor_model_parallel_group() if tp_group is None else tp_group
        self.tp_rank, self.tp_world_size = group_rank_and_size(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, self.tp_world_size, "ColumnParallelLinear output_size")
        if stride > 1:
            divide(output_size, self.tp_world_size * stride, f"ColumnParallelLinear output_size with stride {stride}")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = _init_sharded((output_size, input_size), 0, stride, init_method, self.tp_rank,
                                    self.tp_world_size, params_dtype, device)
        if bias:
            # Megatron zero-initializes biases; sharded like the output features.
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=True)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)
        return y

    def extra_repr(self):
        return (f"in={self.input_size}, out={self.output_size} (local {self.output_size_per_partition}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, sp={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split along the input features: ``weight`` is ``[output_size, input_size / tp]``.

    Input: ``[..., input_size / tp]`` when ``input_is_parallel`` (the output of a ColumnParallelLinear), else the
    full ``[..., input_size]``, scattered here. Output: ``[..., output_size]`` summed over TP, or its sequence
    shard ``[b, s/tp, output_size]`` with ``sequence_parallel``. The bias is replicated and added once, after the
    reduction.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, input_is_parallel: bool = False,
                 init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1, sequence_parallel: bool = False,
                 tp_group=None, params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True")
        self.tp_group = get_tensor_model_parallel_group() if tp_group is None else tp_group
        self.tp_rank, self.tp_world_size = group_rank_and_size(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, self.tp_world_size, "RowParallelLinear input_size")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = _init_sharded((output_size, input_size), 1, stride, init_method, self.tp_rank,
                                    self.tp_world_size, params_dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        if self.bias is not None:
            bias = self.bias
            if self.sequence_parallel:
                bias = copy_to_tensor_model_parallel_region(bias, self.tp_group)  # sum grads of the seq shards
            y = y + bias
        return y

    def extra_repr(self):
        return (f"in={self.input_size} (local {self.input_size_per_partition}), out={self.output_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, sp={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: ``weight`` is ``[num_embeddings / tp, embedding_dim]``.

    Rank r owns ids ``[r * V/tp, (r+1) * V/tp)``. Input ids ``[b, s]``; output ``[b, s, h]`` (or ``[b, s/tp, h]``
    with ``sequence_parallel``, where the all-reduce becomes a reduce-scatter along the sequence).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: InitMethod = nn.init.xavier_normal_,
                 sequence_parallel: bool = False, tp_group=None, params_dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self.tp_group = get_tensor_model_parallel_group() if tp_group is None else tp_group
        self.tp_rank, self.tp_world_size = group_rank_and_size(self.tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_world_size,
                                                   "VocabParallelEmbedding num_embeddings (vocabulary size)")
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.sequence_parallel = sequence_parallel
        self.weight = _init_sharded((num_embeddings, embedding_dim), 0, 1, init_method, self.tp_rank,
                                    self.tp_world_size, params_dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_world_size == 1:
            out = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)

    def extra_repr(self):
        return (f"{self.num_embeddings} (local {self.num_embeddings_per_partition}), {self.embedding_dim}, "
                f"sp={self.sequence_parallel}")
