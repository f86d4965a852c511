"""Tensor-parallel layers (Megatron-LM, arXiv 1909.08053, Sec. 3).

- ``ColumnParallelLinear``: Y = XA + b, with A split along its columns (output features) as
  A = [A_1, ..., A_p]; rank i computes Y_i = X A_i + b_i.
- ``RowParallelLinear``: Y = XA + b, with A split along its rows (input features) as A = [A_1; ...; A_p] and
  X = [X_1, ..., X_p]; rank i computes X_i A_i, the partial sums are all-reduced, and b is added once.
- ``VocabParallelEmbedding``: the table split along the vocabulary; each rank looks up the ids it owns, writes
  zeros for the others, and the partial results are all-reduced.
- ``ColumnParallelConv2d`` / ``RowParallelConv2d``: the same two splits for a convolution, on the output and the
  input channels of ``[b, C, H, W]`` (channels on dim 1); ``ParallelGroupNorm`` normalizes channel-sharded
  activations between them; ``ParallelConvAttention`` is spatial self-attention with heads split over TP
  (U-Net blocks, as in diffusers' ``ResnetBlock2D`` and ``Attention``).

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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zoo.parallel.mappings import (
    all_reduce_tensor_model_parallel_region,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from zoo.parallel.topology import get_tensor_model_parallel_group, group_rank_and_size, tensor_parallel_subgroup

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
    per_block = divide(size, world_size * stride,
                       f"dimension {partition_dim} of a {tuple(master.shape)} weight / stride {stride}")
    if world_size == 1:  # the whole tensor: no copy (a model built one layer at a time holds each layer once)
        return master.contiguous()
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


def grouped_qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, rank: int, world: int,
                     kv_parts: int = 2) -> tuple:
    """``(q rows, kv rows)`` of TP rank ``rank`` of ``world`` > ``num_kv_heads`` in the fused per-group QKV weight
    ``[q (nq/nkv heads), k, v]`` x nkv: each ``(start, stop)``. The ``world / nkv`` consecutive ranks of a group split
    its query heads and each hold its k and v rows whole. ``kv_parts`` 1: groups ``[q heads, k]`` (Gemma 4's k = v
    layers)."""
    d, replicas = head_dim, world // num_kv_heads
    per_group, q_local = num_heads // num_kv_heads, num_heads // world
    group, j = divmod(rank, replicas)
    first = group * (per_group + kv_parts) * d
    q_rows = (first + j * q_local * d, first + (j + 1) * q_local * d)
    return q_rows, (first + per_group * d, first + (per_group + kv_parts) * d)


class GroupedQKVLinear(nn.Module):
    """The fused QKV projection when tp exceeds the key-value heads (tp a multiple of nkv, nq divisible by tp).

    The full weight is laid out per kv group, ``[q (nq/nkv heads); k; v]`` x nkv (as ``ColumnParallelLinear`` holds
    it when tp divides nkv). Here the R = tp / nkv consecutive TP ranks of group g split its query heads and each
    holds g's k and v rows too, replicated (as inference engines replicate kv heads), so a rank computes
    ``[b, s, (nq/tp + 2) d]``: ``[q_local; k; v]`` of one group. ``weight`` holds the query rows (sharded over TP,
    ``[nq/tp d, h]``), ``kv_weight`` the k and v rows (``[2 d, h]``, and ``bias`` / ``kv_bias`` alike; ``kv_parts``
    1: the k rows alone, for Gemma 4's k = v layers).

    Exact for training: a replica's k/v gradient only holds its own query heads' share, so ``kv_weight``'s gradient
    is summed over the group's R ranks (``kv_group``, a TP subgroup built with the grid) and the replicas stay equal.
    The input gradient needs nothing more: the TP reduction of the input (all-reduce, or SP's reduce-scatter) sums
    the replicas' shares as it sums the query heads'. The gradient norm counts the k/v rows once: ``kv_weight`` is
    marked ``tensor_model_parallel`` on the group's first rank only, so DeepSpeed (ZeRO, bf16) and
    ``zoo.parallel.grad_norm`` count it there (and, unmarked, nowhere else: those ranks are not TP rank 0).

    Model folders store the full fused tensor under ``weight`` / ``bias``: both parameters carry ``stored_name`` and
    ``stored_rows`` (per TP rank, the ``(start, stop)`` rows of the stored tensor of ``stored_size`` rows they hold;
    ``zoo.convert.io``
    reads and writes them, the k/v rows once). Initialization: the full master weight, as ``ColumnParallelLinear``.
    """

    def __init__(self, input_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool = True,
                 init_method: InitMethod = nn.init.xavier_normal_, sequence_parallel: bool = False, tp_group=None,
                 params_dtype: torch.dtype = torch.float32, device=None, kv_parts: int = 2):
        super().__init__()
        self.tp_group = get_tensor_model_parallel_group() if tp_group is None else tp_group
        self.tp_rank, tp = group_rank_and_size(self.tp_group)
        self.tp_world_size = tp
        if tp % num_kv_heads or num_heads % tp:
            raise ValueError(f"GroupedQKVLinear: tp {tp} must be a multiple of num_key_value_heads {num_kv_heads} and "
                             f"divide num_attention_heads {num_heads}")
        self.sequence_parallel = sequence_parallel
        self.replicas = tp // num_kv_heads
        self.kv_group = tensor_parallel_subgroup(self.tp_group, self.replicas)
        self.input_size, self.head_dim = input_size, head_dim
        rows = [grouped_qkv_rows(num_heads, num_kv_heads, head_dim, r, tp, kv_parts) for r in range(tp)]
        (q0, q1), (k0, k1) = rows[self.tp_rank]
        full = (num_heads + kv_parts * num_kv_heads) * head_dim
        master = torch.empty((full, input_size), dtype=torch.float32)
        init_method(master)
        self.weight = nn.Parameter(master[q0:q1].to(device=device, dtype=params_dtype))
        self.kv_weight = nn.Parameter(master[k0:k1].to(device=device, dtype=params_dtype))
        del master
        params = [(self.weight, self.kv_weight, "weight")]
        if bias:
            self.bias = nn.Parameter(torch.zeros(q1 - q0, dtype=params_dtype, device=device))
            self.kv_bias = nn.Parameter(torch.zeros(k1 - k0, dtype=params_dtype, device=device))
            params.append((self.bias, self.kv_bias, "bias"))
        else:
            self.register_parameter("bias", None)
            self.register_parameter("kv_bias", None)
        first = self.tp_rank % self.replicas == 0
        for q, kv, name in params:
            set_tensor_model_parallel_attributes(q, 0)
            set_tensor_model_parallel_attributes(kv, 0)
            kv.tensor_model_parallel = first  # counted once in gradient norms (see above)
            kv.kv_replicas = self.replicas
            q.stored_name = kv.stored_name = name
            q.stored_size = kv.stored_size = full  # rows of the stored tensor
            q.stored_rows = tuple((r[0],) for r in rows)
            kv.stored_rows = tuple((r[1],) for r in rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=True)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        kv_weight = copy_to_tensor_model_parallel_region(self.kv_weight, self.kv_group)  # grads summed over replicas
        weight = torch.cat([self.weight, kv_weight])
        bias = None
        if self.bias is not None:
            bias = torch.cat([self.bias, copy_to_tensor_model_parallel_region(self.kv_bias, self.kv_group)])
        return F.linear(x, weight, bias)

    def extra_repr(self):
        return (f"in={self.input_size}, out={self.weight.shape[0]}+{self.kv_weight.shape[0]} (q local + k/v of one "
                f"group, replicated over {self.replicas} ranks), bias={self.bias is not None}, "
                f"sp={self.sequence_parallel}")


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
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sp={self.sequence_parallel}")


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


# ---------------------------------------------------------------------------------------------------------------
# Convolutions, GroupNorm and spatial self-attention: the same pattern with channels in place of features.
# Activations are ``[b, C, H, W]``; "sharded" means this rank holds ``[b, C/tp, H, W]``, the rank-th contiguous
# block of channels. A conv is a sum over input channels of per-channel filters, so splitting output channels
# (column) or input channels (row) is exact, padding included.
# ---------------------------------------------------------------------------------------------------------------


def init_method_torch_default(w: torch.Tensor) -> torch.Tensor:
    """kaiming-uniform(a=sqrt(5)): the default of ``nn.Conv2d`` and ``nn.Linear``, U(+-1/sqrt(fan_in))."""
    return nn.init.kaiming_uniform_(w, a=math.sqrt(5))


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _init_conv(module: nn.Module, shape, partition_dim: int, bias: bool, shard_bias: bool,
               init_method: InitMethod, bias_init_method: InitMethod | None, dtype, device) -> None:
    """Draw the full weight, then the full bias, on the CPU in ``nn.Conv2d``'s order; keep this rank's slices.

    With the default methods a layer built at tp=1 after ``torch.manual_seed(s)`` equals ``nn.Conv2d`` built after
    the same seed, and at tp=N it is that layer sliced. The bias bound uses the *full* weight's fan-in.
    """
    rank, world = module.tp_rank, module.tp_world_size
    master = torch.empty(shape, dtype=torch.float32)
    init_method(master)
    module.weight = nn.Parameter(shard_master_weight(master, partition_dim, rank, world).to(device=device, dtype=dtype))
    set_tensor_model_parallel_attributes(module.weight, partition_dim)
    if not bias:
        module.register_parameter("bias", None)
        return
    master_bias = torch.empty(shape[0], dtype=torch.float32)
    if bias_init_method is None:
        fan_in = shape[1] * shape[2] * shape[3]
        nn.init.uniform_(master_bias, -1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))
    else:
        bias_init_method(master_bias)
    if shard_bias:
        master_bias = shard_master_weight(master_bias, 0, rank, world)
    module.bias = nn.Parameter(master_bias.to(device=device, dtype=dtype))
    if shard_bias:
        set_tensor_model_parallel_attributes(module.bias, 0)


class _ParallelConv2dBase(nn.Module):
    def _setup(self, in_channels, out_channels, kernel_size, stride, padding, dilation, tp_group):
        self.tp_group = get_tensor_model_parallel_group() if tp_group is None else tp_group
        self.tp_rank, self.tp_world_size = group_rank_and_size(self.tp_group)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.dilation = _pair(kernel_size), _pair(stride), _pair(dilation)
        self.padding = padding if isinstance(padding, str) else _pair(padding)

    def _conv(self, x, bias):
        return F.conv2d(x, self.weight, bias, self.stride, self.padding, self.dilation)


class ColumnParallelConv2d(_ParallelConv2dBase):
    """Y = W * X + b with W split along the output channels: ``weight`` is ``[out / tp, in, kh, kw]``.

    Input: ``[b, in, H, W]``, replicated on the TP group (forward identity, backward all-reduce: Megatron's ``f``).
    Output: this rank's channels ``[b, out / tp, H', W']``, or all of them with ``gather_output=True``. The bias
    is split like the output channels. Default init: ``nn.Conv2d``'s, on the full weight.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1, *,
                 bias: bool = True, gather_output: bool = False, init_method: InitMethod = init_method_torch_default,
                 bias_init_method: InitMethod | None = None, tp_group=None, params_dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self._setup(in_channels, out_channels, kernel_size, stride, padding, dilation, tp_group)
        self.out_channels_per_partition = divide(out_channels, self.tp_world_size, "ColumnParallelConv2d out_channels")
        self.gather_output = gather_output
        _init_conv(self, (out_channels, in_channels, *self.kernel_size), 0, bias, True, init_method,
                   bias_init_method, params_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        y = self._conv(x, self.bias)  # [b, out/tp, H', W']
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group, dim=1)  # [b, out, H', W']
        return y

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels} (local {self.out_channels_per_partition}), "
                f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelConv2d(_ParallelConv2dBase):
    """Y = sum_i W_i * X_i + b with W split along the input channels: ``weight`` is ``[out, in / tp, kh, kw]``.

    Input: this rank's channels ``[b, in / tp, H, W]`` when ``input_is_parallel`` (the output of a
    ColumnParallelConv2d, possibly through a ParallelGroupNorm and a pointwise activation), else the full
    ``[b, in, H, W]``, split here. The partial convolutions are all-reduced (Megatron's ``g``), then the
    replicated bias is added once. Output: ``[b, out, H', W']``, replicated.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1, *,
                 bias: bool = True, input_is_parallel: bool = True, init_method: InitMethod = init_method_torch_default,
                 bias_init_method: InitMethod | None = None, tp_group=None, params_dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self._setup(in_channels, out_channels, kernel_size, stride, padding, dilation, tp_group)
        self.in_channels_per_partition = divide(in_channels, self.tp_world_size, "RowParallelConv2d in_channels")
        self.input_is_parallel = input_is_parallel
        _init_conv(self, (out_channels, in_channels, *self.kernel_size), 1, bias, False, init_method,
                   bias_init_method, params_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group, dim=1)  # [b, in/tp, H, W]
        y = reduce_from_tensor_model_parallel_region(self._conv(x, None), self.tp_group)  # [b, out, H', W']
        if self.bias is not None:
            y = y + self.bias.view(1, -1, 1, 1)
        return y

    def extra_repr(self):
        return (f"{self.in_channels} (local {self.in_channels_per_partition}), {self.out_channels}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")


class ParallelGroupNorm(nn.Module):
    """``nn.GroupNorm`` over channel-sharded activations ``[b, C/tp, *]``, equal to it on the gathered tensor.

    Group g holds channels ``[g C/G, (g+1) C/G)`` and rank r holds ``[r C/tp, (r+1) C/tp)``; ``weight`` and
    ``bias`` are split like the channels (partition_dim 0).

    - ``num_groups % tp == 0``: every shard holds whole groups, so the statistics are local (no communication).
    - otherwise groups straddle shards: each rank sums its channels into a ``[b, num_groups]`` table (zeros for
      groups it does not touch), the table is all-reduced with a backward all-reduce
      (``all_reduce_tensor_model_parallel_region``), and each rank reads its channels' rows. Two passes (mean,
      then the centered second moment), in at least fp32: two all-reduces of ``b * num_groups`` numbers, and no
      E[x^2] - E[x]^2 cancellation.

    Any layout ``nn.GroupNorm`` and the channel split allow is supported; refused: ``num_channels`` not divisible
    by ``num_groups`` (nn.GroupNorm's own rule) or by ``tp``.
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, *, tp_group=None,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group = get_tensor_model_parallel_group() if tp_group is None else tp_group
        self.tp_rank, self.tp_world_size = group_rank_and_size(self.tp_group)
        tp = self.tp_world_size
        if num_channels % num_groups:
            raise ValueError(f"ParallelGroupNorm: norm_num_groups {num_groups} does not divide num_channels "
                             f"{num_channels}; use one of {_divisors(num_channels)}")
        if num_channels % tp:
            raise ValueError(f"ParallelGroupNorm: {num_channels} channels (norm_num_groups {num_groups}) cannot be "
                             f"sharded over tp {tp}; use a tp in {_divisors(num_channels)}")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        self.channels_per_group = num_channels // num_groups
        self.num_channels_per_partition = num_channels // tp
        self.stats_are_local = num_groups % tp == 0
        if affine:
            self.weight = nn.Parameter(torch.ones(self.num_channels_per_partition, dtype=params_dtype, device=device))
            self.bias = nn.Parameter(torch.zeros(self.num_channels_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.weight, 0)
            set_tensor_model_parallel_attributes(self.bias, 0)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stats_are_local:
            return F.group_norm(x, self.num_groups // self.tp_world_size, self.weight, self.bias, self.eps)
        b, c_local = x.shape[0], x.shape[1]
        first = self.tp_rank * self.num_channels_per_partition
        group_of = torch.div(torch.arange(first, first + c_local, device=x.device), self.channels_per_group,
                             rounding_mode="floor")  # [C/tp]: the group of each local channel
        xf = x.to(torch.promote_types(x.dtype, torch.float32)).reshape(b, c_local, -1)  # [b, C/tp, n], >= fp32
        count = self.channels_per_group * xf.shape[-1]

        def group_sum(per_channel):  # [b, C/tp] -> [b, G], summed over every rank's channels
            table = per_channel.new_zeros(b, self.num_groups).index_add(1, group_of, per_channel)
            return all_reduce_tensor_model_parallel_region(table, self.tp_group)

        mean = group_sum(xf.sum(-1)) / count  # [b, G]
        centered = xf - mean[:, group_of, None]  # [b, C/tp, n]
        var = group_sum(centered.square().sum(-1)) / count  # [b, G], biased like nn.GroupNorm
        y = (centered * torch.rsqrt(var + self.eps)[:, group_of, None]).to(x.dtype).reshape(x.shape)
        if self.affine:
            shape = (1, c_local) + (1,) * (x.dim() - 2)
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    def extra_repr(self):
        return (f"{self.num_groups}, {self.num_channels} (local {self.num_channels_per_partition}), eps={self.eps}, "
                f"affine={self.affine}, stats_are_local={self.stats_are_local}")


class ParallelConvAttention(nn.Module):
    """Self-attention over the H*W positions of ``[b, C, H, W]``, heads split over TP (a diffusers ``Attention``).

    x -> GroupNorm -> qkv (column-parallel) -> SDPA per local head -> to_out (row-parallel) -> + x
    -> / rescale_output_factor. Input and output are replicated ``[b, C, H, W]``, like the residual stream of a
    Megatron transformer: one all-reduce forward (in ``to_out``) and one backward (in ``qkv``). The GroupNorm
    is a plain replicated ``nn.GroupNorm`` on all C channels, since the column-parallel projection needs the
    whole normalized input anyway; its parameters get identical gradients on every rank.

    heads = C // attention_head_dim (diffusers' AttnDownBlock2D rule; one head of C when ``None``), inner dim =
    heads * attention_head_dim; rank r owns heads ``[r heads/tp, (r+1) heads/tp)``.

    ``qkv.weight`` is the full ``[3 inner, C]`` = ``[W_q; W_k; W_v]`` sharded with stride 3, so rank r holds
    ``[W_q,r; W_k,r; W_v,r]`` (its heads' rows of each). Mapping from diffusers (``Attention(C, heads, dim_head,
    norm_num_groups, residual_connection=True, bias=True)``), on full tensors:

        group_norm.{weight,bias}    <- group_norm.{weight,bias}
        qkv.weight                  <- cat([to_q.weight, to_k.weight, to_v.weight], 0)
        qkv.bias                    <- cat([to_q.bias, to_k.bias, to_v.bias], 0)
        to_out.{weight,bias}        <- to_out.0.{weight,bias}

    Default init: ``nn.Linear``'s kaiming-uniform on the full weights, zero biases (Megatron); GroupNorm ones/zeros.
    """

    def __init__(self, channels: int, attention_head_dim: int | None = None, *, norm_num_groups: int = 32,
                 eps: float = 1e-5, bias: bool = True, rescale_output_factor: float = 1.0,
                 residual_connection: bool = True, init_method: InitMethod = init_method_torch_default,
                 output_init_method: InitMethod | None = None, tp_group=None,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        head_dim = channels if attention_head_dim is None else attention_head_dim
        if channels % head_dim:
            raise ValueError(f"ParallelConvAttention: attention_head_dim {head_dim} does not divide channels "
                             f"{channels}; use one of {_divisors(channels)}")
        self.tp_group = get_tensor_model_parallel_group() if tp_group is None else tp_group
        self.tp_rank, self.tp_world_size = group_rank_and_size(self.tp_group)
        self.channels, self.head_dim, self.num_heads = channels, head_dim, channels // head_dim
        if self.num_heads % self.tp_world_size:
            raise ValueError(f"ParallelConvAttention: {self.num_heads} heads ({channels} channels / attention_head_dim "
                             f"{head_dim}) cannot be split over tp {self.tp_world_size}; use a tp in "
                             f"{_divisors(self.num_heads)} or a smaller attention_head_dim")
        self.num_heads_per_partition = self.num_heads // self.tp_world_size
        self.rescale_output_factor, self.residual_connection = rescale_output_factor, residual_connection
        inner = self.num_heads * head_dim
        self.group_norm = nn.GroupNorm(norm_num_groups, channels, eps=eps, affine=True, device=device,
                                       dtype=params_dtype)
        self.qkv = ColumnParallelLinear(channels, 3 * inner, bias=bias, init_method=init_method, stride=3,
                                        tp_group=self.tp_group, params_dtype=params_dtype, device=device)
        self.to_out = RowParallelLinear(inner, channels, bias=bias, input_is_parallel=True,
                                        init_method=output_init_method or init_method, tp_group=self.tp_group,
                                        params_dtype=params_dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        hidden = self.group_norm(x).view(b, c, h * w).transpose(1, 2)  # [b, HW, C]
        qkv = self.qkv(hidden)  # [b, HW, 3 * nh_local * d]
        qkv = qkv.view(b, h * w, 3, self.num_heads_per_partition, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, nh_local, HW, d]
        out = F.scaled_dot_product_attention(q, k, v)  # [b, nh_local, HW, d], scale 1/sqrt(d)
        out = out.transpose(1, 2).reshape(b, h * w, self.num_heads_per_partition * self.head_dim)  # [b, HW, nh_local*d]
        out = self.to_out(out).transpose(1, 2).reshape(b, c, h, w)  # [b, C, H, W], summed over TP
        if self.residual_connection:
            out = out + x
        return out / self.rescale_output_factor

    def extra_repr(self):
        return (f"channels={self.channels}, heads={self.num_heads} (local {self.num_heads_per_partition}), "
                f"head_dim={self.head_dim}, residual={self.residual_connection}, "
                f"rescale_output_factor={self.rescale_output_factor}")
