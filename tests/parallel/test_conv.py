"""Tensor-parallel convolutions, GroupNorm and spatial attention against nn.Conv2d / nn.GroupNorm / diffusers.

Every case compares the forward and the backward (input grads, and parameter grads against the slices of the
reference's full gradients) with a single-process reference, at tp 1, 2 and 4. Activations are ``[b, C, H, W]``;
a sharded activation is ``chunk(full, 1, rank, tp)``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.parallel.helpers import assert_close, chunk, gen, grid_for
from zoo.parallel import mappings as M
from zoo.parallel.layers import (
    ColumnParallelConv2d,
    ParallelConvAttention,
    ParallelGroupNorm,
    RowParallelConv2d,
    shard_master_weight,
)

# Small maps on purpose: a gradient reduced over b*H*W positions in fp32 differs between two summation orders by
# ~sqrt(b*H*W) ulps, so reductions are kept to a few dozen terms to compare at 1e-6.
B, IN, OUT, HW = 2, 8, 12, 4
TPS = [1, 2, 4]


def _run(dist_run, tp, fn, *args):
    if tp == 1:
        assert fn(tp, *args)
    else:
        assert all(dist_run(tp, fn, tp, *args))


def _rank(layer):
    return layer.tp_rank, layer.tp_world_size


# ---- convolutions -------------------------------------------------------------------------------------------

def column_conv_case(tp, bias, gather_output, stride):
    grid_for(tp)
    torch.manual_seed(1234)  # same seed on every rank: every rank draws the same master weight
    layer = ColumnParallelConv2d(IN, OUT, 3, stride=stride, padding=1, bias=bias, gather_output=gather_output)
    torch.manual_seed(1234)
    ref = nn.Conv2d(IN, OUT, 3, stride=stride, padding=1, bias=bias)  # the tp=1 layer with that seed
    rank, world = _rank(layer)
    assert world == tp
    # Default init is nn.Conv2d's, drawn on the full weight: shards are exact slices.
    assert torch.equal(layer.weight, chunk(ref.weight, 0, rank, world)), "weight shard != slice of the tp=1 weight"
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0 and layer.weight.partition_stride == 1
    if bias:
        assert torch.equal(layer.bias, chunk(ref.bias, 0, rank, world)), "bias shard is not a slice"
        assert layer.bias.tensor_model_parallel and layer.bias.partition_dim == 0

    x = torch.randn(B, IN, HW, HW, generator=gen(1))
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, generator=gen(2))
    y_ref.backward(dy)

    y = layer(x_par)
    if gather_output:
        assert_close(y, y_ref, "output")
        y.backward(dy)
    else:
        assert_close(y, chunk(y_ref, 1, rank, world), "output shard")
        y.backward(chunk(dy, 1, rank, world))
    assert_close(x_par.grad, x_ref.grad, "input grad")
    assert_close(layer.weight.grad, chunk(ref.weight.grad, 0, rank, world), "weight grad")
    if bias:
        assert_close(layer.bias.grad, chunk(ref.bias.grad, 0, rank, world), "bias grad")
    return True


def row_conv_case(tp, bias, input_is_parallel):
    grid_for(tp)
    torch.manual_seed(4321)
    layer = RowParallelConv2d(OUT, IN, 3, padding=1, bias=bias, input_is_parallel=input_is_parallel)
    torch.manual_seed(4321)
    ref = nn.Conv2d(OUT, IN, 3, padding=1, bias=bias)
    rank, world = _rank(layer)
    assert torch.equal(layer.weight, chunk(ref.weight, 1, rank, world)), "weight shard != slice of the tp=1 weight"
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 1
    if bias:
        assert torch.equal(layer.bias, ref.bias), "row-parallel bias is the full tp=1 bias"
        assert not getattr(layer.bias, "tensor_model_parallel", False), "row-parallel bias is replicated"

    x = torch.randn(B, OUT, HW, HW, generator=gen(3))
    x_ref = x.clone().requires_grad_()
    x_par = (chunk(x, 1, rank, world) if input_is_parallel else x).clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, generator=gen(4))
    y_ref.backward(dy)

    y = layer(x_par)
    assert_close(y, y_ref, "output")
    y.backward(dy)
    assert_close(x_par.grad, chunk(x_ref.grad, 1, rank, world) if input_is_parallel else x_ref.grad, "input grad")
    assert_close(layer.weight.grad, chunk(ref.weight.grad, 1, rank, world), "weight grad")
    if bias:
        assert_close(layer.bias.grad, ref.bias.grad, "bias grad")
    return True


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("bias,gather_output,stride", [(True, True, 1), (True, False, 2), (False, False, 1)])
def test_column_parallel_conv2d(dist_run, tp, bias, gather_output, stride):
    _run(dist_run, tp, column_conv_case, bias, gather_output, stride)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("bias,input_is_parallel", [(True, True), (True, False), (False, True)])
def test_row_parallel_conv2d(dist_run, tp, bias, input_is_parallel):
    _run(dist_run, tp, row_conv_case, bias, input_is_parallel)


# ---- GroupNorm ----------------------------------------------------------------------------------------------

def group_norm_case(tp, num_groups, channels, affine):
    grid_for(tp)
    norm = ParallelGroupNorm(num_groups, channels, eps=1e-5, affine=affine)
    rank, world = _rank(norm)
    assert norm.stats_are_local == (num_groups % world == 0)
    ref = nn.GroupNorm(num_groups, channels, eps=1e-5, affine=affine)
    if affine:
        with torch.no_grad():
            ref.weight.copy_(torch.randn(channels, generator=gen(5)))
            ref.bias.copy_(torch.randn(channels, generator=gen(6)))
            norm.weight.copy_(chunk(ref.weight, 0, rank, world))
            norm.bias.copy_(chunk(ref.bias, 0, rank, world))
        assert norm.weight.tensor_model_parallel and norm.weight.partition_dim == 0

    # A non-zero mean exercises the centering; a large one would make the fp32 reference itself (its backward
    # computes sum(dy x) - mean sum(dy)) drift from the exact value by more than the tolerance.
    x = torch.randn(B, channels, 3, 2, generator=gen(7)) * 2.0 + 1.0
    x_ref = x.clone().requires_grad_()
    x_par = chunk(x, 1, rank, world).clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, generator=gen(8))
    y_ref.backward(dy)

    y = norm(x_par)
    assert_close(y, chunk(y_ref, 1, rank, world), "output shard")
    y.backward(chunk(dy, 1, rank, world))
    assert_close(x_par.grad, chunk(x_ref.grad, 1, rank, world), "input grad")
    if affine:
        assert_close(norm.weight.grad, chunk(ref.weight.grad, 0, rank, world), "weight grad")
        assert_close(norm.bias.grad, chunk(ref.bias.grad, 0, rank, world), "bias grad")
    return True


# (num_groups, channels, affine): aligned at every tp | a group over 2 ranks at tp 4 | groups straddling shard
# boundaries unevenly (4 channels per group, 6 or 3 per shard) | one group over every rank
GN_CASES = [(4, 16, True), (2, 16, True), (3, 12, True), (3, 12, False), (1, 8, True)]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("num_groups,channels,affine", GN_CASES)
def test_parallel_group_norm(dist_run, tp, num_groups, channels, affine):
    _run(dist_run, tp, group_norm_case, num_groups, channels, affine)


def resblock_case(tp):
    """conv (column) -> GroupNorm on channel shards -> SiLU -> conv (row) + x: one all-reduce, equal to tp=1.

    In float64: this checks the wiring across three layers (fp32 rounding compounds along the chain; each layer
    is checked in fp32 above). The weights are still drawn in fp32 from the seed, so tp=N is the tp=1 model sliced.
    """
    grid_for(tp)
    f64 = dict(params_dtype=torch.float64)
    torch.manual_seed(77)
    conv1 = ColumnParallelConv2d(IN, OUT, 3, padding=1, **f64)
    norm = ParallelGroupNorm(3, OUT, **f64)  # 3 groups of 4 channels: straddle the shards at tp 2 and 4
    conv2 = RowParallelConv2d(OUT, IN, 3, padding=1, **f64)
    assert not norm.stats_are_local
    torch.manual_seed(77)  # the two nn.Conv2d draw the same stream
    ref1, ref_norm, ref2 = nn.Conv2d(IN, OUT, 3, padding=1), nn.GroupNorm(3, OUT), nn.Conv2d(OUT, IN, 3, padding=1)
    ref1, ref_norm, ref2 = ref1.double(), ref_norm.double(), ref2.double()
    rank, world = _rank(conv1)
    with torch.no_grad():
        ref_norm.weight.copy_(torch.randn(OUT, generator=gen(9)))
        ref_norm.bias.copy_(torch.randn(OUT, generator=gen(10)))
        norm.weight.copy_(chunk(ref_norm.weight, 0, rank, world))
        norm.bias.copy_(chunk(ref_norm.bias, 0, rank, world))

    x = torch.randn(B, IN, HW, HW, generator=gen(11), dtype=torch.float64)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref2(F.silu(ref_norm(ref1(x_ref)))) + x_ref
    dy = torch.randn(y_ref.shape, generator=gen(12), dtype=torch.float64)
    y_ref.backward(dy)
    y = conv2(F.silu(norm(conv1(x_par)))) + x_par
    assert y.dtype == torch.float64
    assert_close(y, y_ref, "output")
    y.backward(dy)
    assert_close(x_par.grad, x_ref.grad, "input grad")
    sharded = [("conv1.weight", conv1.weight, 0, ref1.weight), ("conv1.bias", conv1.bias, 0, ref1.bias),
               ("norm.weight", norm.weight, 0, ref_norm.weight), ("norm.bias", norm.bias, 0, ref_norm.bias),
               ("conv2.weight", conv2.weight, 1, ref2.weight)]
    for name, p, dim, q in sharded:
        assert_close(p.grad, chunk(q.grad, dim, rank, world), f"{name} grad")
    assert_close(conv2.bias.grad, ref2.bias.grad, "conv2.bias grad")
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_resblock_composition_matches_plain(dist_run, tp):
    _run(dist_run, tp, resblock_case)


def primitives_case(tp):
    """The all-reduce with an all-reduce backward, and scatter/gather along the channel dimension."""
    grid_for(tp)
    rank = torch.distributed.get_rank()
    xs = [torch.randn(B, 3, generator=gen(100 + r)) for r in range(tp)]
    gs = [torch.randn(B, 3, generator=gen(200 + r)) for r in range(tp)]
    x = xs[rank].clone().requires_grad_()
    y = M.all_reduce_tensor_model_parallel_region(x)
    y.backward(gs[rank])
    assert_close(y, sum(xs), "all-reduce fwd")
    assert_close(x.grad, sum(gs), "all-reduce bwd (all-reduce)")

    full = torch.randn(B, 4 * tp, 2, 2, generator=gen(300))
    x = full.clone().requires_grad_()
    y = M.scatter_to_tensor_model_parallel_region(x, dim=1)
    assert_close(y, chunk(full, 1, rank, tp), "scatter dim 1 fwd")
    y.backward(torch.full_like(y, float(rank)))
    assert_close(x.grad, torch.cat([torch.full_like(y, float(r)) for r in range(tp)], 1), "scatter dim 1 bwd")
    x = chunk(full, 1, rank, tp).clone().requires_grad_()
    y = M.gather_from_tensor_model_parallel_region(x, dim=1)
    assert_close(y, full, "gather dim 1 fwd")
    y.backward(full * 2)
    assert_close(x.grad, chunk(full * 2, 1, rank, tp), "gather dim 1 bwd")
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_channel_primitives(dist_run, tp):
    _run(dist_run, tp, primitives_case)


def test_channel_primitives_return_input_itself_in_one_process():
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    assert M.all_reduce_tensor_model_parallel_region(x) is x
    assert M.scatter_to_tensor_model_parallel_region(x, dim=1) is x
    assert M.gather_from_tensor_model_parallel_region(x, dim=1) is x


# ---- spatial self-attention vs diffusers' Attention ---------------------------------------------------------

C, HEAD_DIM, GROUPS, SIDE = 16, 4, 4, 4  # 4 heads of 4 over a 4x4 map (16 positions)


def _diffusers_reference(rescale):
    """diffusers' Attention built as AttnDownBlock2D builds it, random weights; its output and grads on one batch."""
    from diffusers.models.attention_processor import Attention

    attn = Attention(C, heads=C // HEAD_DIM, dim_head=HEAD_DIM, rescale_output_factor=rescale, eps=1e-5,
                     norm_num_groups=GROUPS, residual_connection=True, bias=True, upcast_softmax=True,
                     _from_deprecated_attn_block=True)
    g = gen(20)
    with torch.no_grad():  # diffusers' own (kaiming-uniform) weights; non-trivial GroupNorm affine and biases
        for name, p in attn.named_parameters():
            if name.endswith("bias") or name.startswith("group_norm"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if name == "group_norm.weight" else 0.0))
    x = torch.randn(B, C, SIDE, SIDE, generator=gen(21)).requires_grad_()
    y = attn(x)
    dy = torch.randn(y.shape, generator=gen(22))
    y.backward(dy)
    weights = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in attn.named_parameters()}
    return dict(weights=weights, grads=grads, x=x.detach(), dy=dy, y=y.detach(), dx=x.grad)


def _fused_qkv(d, suffix, rank, world):
    """The docstring's table: qkv.<suffix> = cat(to_q, to_k, to_v), sharded with stride 3 (each rank's heads)."""
    full = torch.cat([d[f"to_q.{suffix}"], d[f"to_k.{suffix}"], d[f"to_v.{suffix}"]], 0)
    return shard_master_weight(full, 0, rank, world, stride=3)


def attention_case(tp, ref, rescale):
    grid_for(tp)
    attn = ParallelConvAttention(C, HEAD_DIM, norm_num_groups=GROUPS, eps=1e-5, rescale_output_factor=rescale)
    rank, world = _rank(attn)
    assert attn.num_heads_per_partition == (C // HEAD_DIM) // world
    w, gr = ref["weights"], ref["grads"]
    with torch.no_grad():
        attn.group_norm.weight.copy_(w["group_norm.weight"])
        attn.group_norm.bias.copy_(w["group_norm.bias"])
        attn.qkv.weight.copy_(_fused_qkv(w, "weight", rank, world))
        attn.qkv.bias.copy_(_fused_qkv(w, "bias", rank, world))
        attn.to_out.weight.copy_(chunk(w["to_out.0.weight"], 1, rank, world))
        attn.to_out.bias.copy_(w["to_out.0.bias"])

    x = ref["x"].clone().requires_grad_()
    y = attn(x)
    assert_close(y, ref["y"], "output")
    y.backward(ref["dy"])
    assert_close(x.grad, ref["dx"], "input grad")
    assert_close(attn.group_norm.weight.grad, gr["group_norm.weight"], "group_norm.weight grad")
    assert_close(attn.group_norm.bias.grad, gr["group_norm.bias"], "group_norm.bias grad")
    assert_close(attn.qkv.weight.grad, _fused_qkv(gr, "weight", rank, world), "qkv.weight grad")
    assert_close(attn.qkv.bias.grad, _fused_qkv(gr, "bias", rank, world), "qkv.bias grad")
    assert_close(attn.to_out.weight.grad, chunk(gr["to_out.0.weight"], 1, rank, world), "to_out.weight grad")
    assert_close(attn.to_out.bias.grad, gr["to_out.0.bias"], "to_out.bias grad")
    return True


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("rescale", [1.0, 2.0])
def test_conv_attention_matches_diffusers(dist_run, tp, rescale):
    pytest.importorskip("diffusers")
    _run(dist_run, tp, attention_case, _diffusers_reference(rescale), rescale)


def attention_init_case(tp, full):
    """Built with the same seed at tp=N, every shard is the tp=1 layer's tensor sliced (qkv with stride 3)."""
    grid_for(tp)
    torch.manual_seed(5)
    attn = ParallelConvAttention(C, HEAD_DIM, norm_num_groups=GROUPS)
    rank, world = _rank(attn)
    for name, p in attn.state_dict().items():
        param = dict(attn.named_parameters())[name]
        if getattr(param, "tensor_model_parallel", False):
            expected = shard_master_weight(full[name], param.partition_dim, rank, world, param.partition_stride)
        else:
            expected = full[name]
        assert torch.equal(p, expected), name
    assert attn.qkv.weight.partition_stride == 3 and attn.to_out.weight.partition_dim == 1
    return True


def test_conv_attention_seeded_init_slices_tp1(dist_run):
    torch.manual_seed(5)
    full = ParallelConvAttention(C, HEAD_DIM, norm_num_groups=GROUPS).state_dict()
    assert full["qkv.weight"].abs().sum() > 0
    for tp in (2, 4):
        _run(dist_run, tp, attention_init_case, full)


# ---- refusals -----------------------------------------------------------------------------------------------

def refusal_case(tp):
    grid_for(tp)
    cases = [
        (lambda: ParallelGroupNorm(3, 64),
         "ParallelGroupNorm: norm_num_groups 3 does not divide num_channels 64; use one of 1, 2, 4, 8, 16, 32, 64"),
        (lambda: ParallelGroupNorm(2, 6),
         "ParallelGroupNorm: 6 channels (norm_num_groups 2) cannot be sharded over tp 4; use a tp in 1, 2, 3, 6"),
        (lambda: ColumnParallelConv2d(8, 6, 3),
         "ColumnParallelConv2d out_channels (6) is not divisible by the tensor-parallel size 4; "
         "use a tp that divides 6"),
        (lambda: RowParallelConv2d(6, 8, 3),
         "RowParallelConv2d in_channels (6) is not divisible by the tensor-parallel size 4; use a tp that divides 6"),
        (lambda: ParallelConvAttention(16, 8, norm_num_groups=4),
         "ParallelConvAttention: 2 heads (16 channels / attention_head_dim 8) cannot be split over tp 4; "
         "use a tp in 1, 2 or a smaller attention_head_dim"),
    ]
    for build, message in cases:
        with pytest.raises(ValueError) as info:
            build()
        assert str(info.value) == message
    return True


def test_bad_shapes_are_refused_with_one_line(dist_run):
    _run(dist_run, 4, refusal_case)
