"""Communication primitives of tensor and sequence parallelism, each paired with its gradient.

Megatron-LM (arXiv 1909.08053, Sec. 3) names two conjugate operators around every parallel block: ``f`` is the
identity forward and an all-reduce backward, ``g`` the reverse. Sequence parallelism (arXiv 2205.05198, Sec. 4.2)
replaces ``g`` by a reduce-scatter along the sequence and ``f`` by an all-gather (``g-bar`` and ``f-bar``).

Every primitive is a private ``autograd.Function`` and a public wrapper whose docstring gives both directions.
A group of size one (or ``None`` outside torch.distributed) returns the input untouched, so a model runs
unchanged in one process. ``group=None`` means the TP group of the current grid.

Expert parallelism (GShard, arXiv 2006.16668) adds ``all_to_all``: rank r sends the i-th block of its rows to
rank i, blocks of uneven sizes; its gradient is the same exchange with the sizes swapped. It takes its group
explicitly (an expert-parallel group, never the TP default). DeepSpeed-Ulysses (arXiv 2309.14509) trades one
sharded dimension for another with ``all_to_all_scatter_gather`` (sequence-sharded, all heads -> whole sequence,
heads sharded); its gradient is the reverse trade. Its group is explicit too (a context-parallel group).

Notation: activations are batch-first ``[b, s, h]``; tensor parallelism splits the last dimension, sequence
parallelism splits ``s`` (dimension 1). Convolutions keep channels on dimension 1 (``[b, C, H, W]``), so the
scatter and gather take ``dim`` (default: the last).
"""

import torch
import torch.distributed as dist

from zoo.parallel.topology import get_tensor_model_parallel_group, group_rank_and_size

SEQUENCE_DIM = 1

# torch 2.13 renamed the single-tensor collectives; older releases only have the *_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _resolve(group):
    return get_tensor_model_parallel_group() if group is None else group


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    rank, world = group_rank_and_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} into {world} equal "
                         "tensor-parallel parts")
    return x.chunk(world, dim=dim)[rank].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    _, world = group_rank_and_size(group)
    if world == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()  # gather along dim 0: [world * n, ...]
    out = torch.empty((world * x0.shape[0], *x0.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    _, world = group_rank_and_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} over {world} ranks")
    x0 = x.movedim(dim, 0).contiguous()
    out = torch.empty((x0.shape[0] // world, *x0.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    _, world = group_rank_and_size(group)
    if world == 1:
        return x
    # Work on a copy: autograd may hand the same gradient tensor to several inputs.
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def _all_to_all(x: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    _, world = group_rank_and_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group)
    return out


def _all_to_all_scatter_gather(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    _, world = group_rank_and_size(group)
    if world == 1:
        return x
    if x.shape[scatter_dim] % world:
        raise ValueError(f"cannot scatter dimension {scatter_dim} of size {x.shape[scatter_dim]} over {world} ranks")
    send = torch.stack(x.chunk(world, dim=scatter_dim))  # [world, ...]: block i goes to rank i
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)  # block j came from rank j: its place along gather_dim


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim=-1):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim=-1):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQUENCE_DIM, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _all_gather(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            # The consumer was a TP region: each rank holds a partial gradient of the full sequence.
            return _reduce_scatter(grad, SEQUENCE_DIM, ctx.group), None, None
        return _split(grad, SEQUENCE_DIM, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQUENCE_DIM, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """``exchange(x, a, b, group)``, either all-to-all of this file. Every element goes back where it came from by the
    same exchange with ``a`` and ``b`` swapped: the sizes received become the sizes sent, the gathered dimension the
    scattered one."""

    @staticmethod
    def forward(ctx, x, exchange, a, b, group):
        ctx.exchange, ctx.a, ctx.b, ctx.group = exchange, a, b, group
        return exchange(x, a, b, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange(grad, ctx.b, ctx.a, ctx.group), None, None, None, None


def copy_to_tensor_model_parallel_region(x, group=None):
    """Megatron's ``f``. Forward: identity. Backward: all-reduce (sum) the gradient over the TP group."""
    group = _resolve(group)
    if group_rank_and_size(group)[1] == 1:
        return x
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group=None):
    """Megatron's ``g``. Forward: all-reduce (sum) over the TP group. Backward: identity."""
    group = _resolve(group)
    if group_rank_and_size(group)[1] == 1:
        return x
    return _ReduceFromModelParallelRegion.apply(x, group)


def all_reduce_tensor_model_parallel_region(x, group=None):
    """Forward: all-reduce (sum) over the TP group. Backward: all-reduce (sum) the gradient.

    For a sum over shards that every rank then uses on its *own* shard, e.g. the per-group statistics of a
    channel-sharded GroupNorm: each rank's copy feeds a different part of the loss, so the gradient of every
    rank's partial sum is the sum of all copies' gradients. (``reduce_from_...`` has an identity backward
    because its consumer is replicated and every rank already holds the whole gradient.)
    """
    group = _resolve(group)
    if group_rank_and_size(group)[1] == 1:
        return x
    return _AllReduceModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group=None, dim=-1):
    """Forward: keep this rank's chunk of dimension ``dim`` (default the last). Backward: all-gather along it."""
    group = _resolve(group)
    if group_rank_and_size(group)[1] == 1:
        return x
    return _ScatterToModelParallelRegion.apply(x, group, dim)


def gather_from_tensor_model_parallel_region(x, group=None, dim=-1):
    """Forward: all-gather along dimension ``dim`` (default the last). Backward: keep this rank's chunk of it."""
    group = _resolve(group)
    if group_rank_and_size(group)[1] == 1:
        return x
    return _GatherFromModelParallelRegion.apply(x, group, dim)


def scatter_to_sequence_parallel_region(x, group=None):
    """Forward: keep this rank's chunk of the sequence (dim 1). Backward: all-gather along the sequence."""
    group = _resolve(group)
    if group_rank_and_size(group)[1] == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group=None, tensor_parallel_output_grad=True):
    """Megatron-SP's ``f-bar``. Forward: all-gather along the sequence (dim 1).

    Backward: reduce-scatter along the sequence when the consumer is a TP region (each rank then holds a
    partial gradient), or keep this rank's chunk when the consumer was replicated
    (``tensor_parallel_output_grad=False``).
    """
    group = _resolve(group)
    if group_rank_and_size(group)[1] == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    """Megatron-SP's ``g-bar``. Forward: reduce-scatter (sum) along the sequence (dim 1). Backward: all-gather."""
    group = _resolve(group)
    if group_rank_and_size(group)[1] == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def all_to_all(x, output_split_sizes, input_split_sizes, group):
    """Forward: ``all_to_all_single`` along dim 0: this rank's rows are cut into blocks of
    ``input_split_sizes`` (block i to rank i) and the blocks received, of ``output_split_sizes`` rows (block j from
    rank j), are stacked in rank order. ``None`` sizes: equal blocks. Backward: the same exchange of the gradient
    with the two size lists swapped. A group of one returns ``x``.
    """
    if group_rank_and_size(group)[1] == 1:
        return x
    return _AllToAll.apply(x, _all_to_all, output_split_sizes, input_split_sizes, group)


def all_to_all_scatter_gather(x, scatter_dim: int, gather_dim: int, group):
    """Forward: cut ``scatter_dim`` into ``world`` equal blocks, send block i to rank i, and join the blocks received
    along ``gather_dim`` in rank order (Ulysses: ``[b, n, s/p, d]`` -> ``[b, n/p, s, d]`` with scatter 1, gather 2).
    Backward: the reverse exchange of the gradient (scatter ``gather_dim``, gather ``scatter_dim``). A group of one
    returns ``x``.
    """
    if group_rank_and_size(group)[1] == 1:
        return x
    return _AllToAll.apply(x, _all_to_all_scatter_gather, scatter_dim, gather_dim, group)
