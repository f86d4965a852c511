"""Tensor-parallel layers against nn.Linear / nn.Embedding on the full weight, forward and backward."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.parallel.helpers import assert_close, chunk, gen, grid_for
from zoo.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    shard_master_weight,
)

B, S, IN, OUT, VOCAB = 2, 8, 12, 16, 16
INIT = init_method_normal(0.5)


def _master(shape, seed=1234):
    torch.manual_seed(seed)
    w = torch.empty(shape)
    INIT(w)
    return w


def column_case(tp, bias, gather_output):
    grid_for(tp)
    torch.manual_seed(1234)  # same seed on every rank: the master weight is built identically
    layer = ColumnParallelLinear(IN, OUT, bias=bias, gather_output=gather_output, init_method=INIT)
    rank, world = layer.tp_rank, layer.tp_world_size
    assert world == tp

    ref = nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(_master((OUT, IN)))
        assert torch.equal(layer.weight, chunk(ref.weight, 0, rank, world)), "tp=N init must slice the tp=1 weight"
        if bias:
            ref.bias.copy_(torch.randn(OUT, generator=gen(7)))
            layer.bias.copy_(chunk(ref.bias, 0, rank, world))

    x = torch.randn(B, S, IN, generator=gen(1))
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, generator=gen(2))
    y_ref.backward(dy)

    y = layer(x_par)
    if gather_output:
        assert_close(y, y_ref, "output")
        y.backward(dy)
    else:
        assert_close(y, chunk(y_ref, -1, rank, world), "output shard")
        y.backward(chunk(dy, -1, rank, world))
    assert_close(x_par.grad, x_ref.grad, "input grad")
    assert_close(layer.weight.grad, chunk(ref.weight.grad, 0, rank, world), "weight grad")
    if bias:
        assert_close(layer.bias.grad, chunk(ref.bias.grad, 0, rank, world), "bias grad")
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0 and layer.weight.partition_stride == 1
    return True


def row_case(tp, bias, input_is_parallel):
    grid_for(tp)
    torch.manual_seed(1234)
    layer = RowParallelLinear(IN, OUT, bias=bias, input_is_parallel=input_is_parallel, init_method=INIT)
    rank, world = layer.tp_rank, layer.tp_world_size

    ref = nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(_master((OUT, IN)))
        assert torch.equal(layer.weight, chunk(ref.weight, 1, rank, world)), "tp=N init must slice the tp=1 weight"
        if bias:
            ref.bias.copy_(torch.randn(OUT, generator=gen(7)))
            layer.bias.copy_(ref.bias)

    x = torch.randn(B, S, IN, generator=gen(1))
    x_ref = x.clone().requires_grad_()
    x_par = (chunk(x, -1, rank, world) if input_is_parallel else x).clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, generator=gen(2))
    y_ref.backward(dy)

    y = layer(x_par)
    assert_close(y, y_ref, "output")
    y.backward(dy)
    expected_dx = chunk(x_ref.grad, -1, rank, world) if input_is_parallel else x_ref.grad
    assert_close(x_par.grad, expected_dx, "input grad")
    assert_close(layer.weight.grad, chunk(ref.weight.grad, 1, rank, world), "weight grad")
    if bias:
        assert not getattr(layer.bias, "tensor_model_parallel", False), "row-parallel bias is replicated"
        assert_close(layer.bias.grad, ref.bias.grad, "bias grad")
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 1
    return True


def embedding_case(tp):
    grid_for(tp)
    torch.manual_seed(1234)
    emb = VocabParallelEmbedding(VOCAB, IN, init_method=INIT)
    rank, world = emb.tp_rank, emb.tp_world_size
    ref = nn.Embedding(VOCAB, IN)
    with torch.no_grad():
        ref.weight.copy_(_master((VOCAB, IN)))
    assert torch.equal(emb.weight.detach(), chunk(ref.weight.detach(), 0, rank, world))

    per = VOCAB // 4
    boundaries = [b for k in range(4) for b in (k * per, k * per + per - 1)]  # first and last id of every shard
    ids = torch.cat([torch.tensor(boundaries), torch.randint(0, VOCAB, (B * S - len(boundaries),), generator=gen(3))])
    ids = ids.view(B, S)
    y_ref = ref(ids)
    dy = torch.randn(y_ref.shape, generator=gen(4))
    y_ref.backward(dy)
    y = emb(ids)
    assert_close(y, y_ref, "embedding output")
    y.backward(dy)
    assert_close(emb.weight.grad, chunk(ref.weight.grad, 0, rank, world), "embedding weight grad")
    return True


def sequence_parallel_case(tp):
    """An MLP block and an embedding with sequence parallelism equal the same modules without it."""
    grid_for(tp)
    modules = {}
    for sp in (False, True):
        torch.manual_seed(99)
        modules[sp] = (
            VocabParallelEmbedding(VOCAB, IN, init_method=INIT, sequence_parallel=sp),
            ColumnParallelLinear(IN, OUT, init_method=INIT, sequence_parallel=sp),
            RowParallelLinear(OUT, IN, input_is_parallel=True, init_method=INIT, sequence_parallel=sp),
        )
        for m in modules[sp]:  # non-zero biases so their gradients are checked
            if getattr(m, "bias", None) is not None:
                with torch.no_grad():
                    m.bias.copy_(torch.linspace(-1, 1, m.bias.numel()))
    rank, world = modules[False][1].tp_rank, modules[False][1].tp_world_size
    ids = torch.randint(0, VOCAB, (B, S), generator=gen(5))
    dy = torch.randn(B, S, IN, generator=gen(6))

    outs, grads = {}, {}
    for sp, (emb, col, row) in modules.items():
        h = emb(ids)  # [b, s/tp, h] with sp
        y = row(F.gelu(col(h)))
        y.backward(chunk(dy, 1, rank, world) if sp else dy)
        outs[sp] = y
        grads[sp] = [p.grad for m in (emb, col, row) for p in m.parameters()]
    assert outs[True].shape == (B, S // world, IN)
    assert_close(outs[True], chunk(outs[False], 1, rank, world), "SP output")
    for g_sp, g in zip(grads[True], grads[False]):
        assert_close(g_sp, g, "SP parameter grad")
    return True


TPS = [1, 2, 4]


def _run(dist_run, tp, fn, *args):
    if tp == 1:
        assert fn(tp, *args)
    else:
        assert all(dist_run(tp, fn, tp, *args))


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gather_output", [True, False])
def test_column_parallel_linear(dist_run, tp, bias, gather_output):
    _run(dist_run, tp, column_case, bias, gather_output)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear(dist_run, tp, bias, input_is_parallel):
    _run(dist_run, tp, row_case, bias, input_is_parallel)


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_embedding(dist_run, tp):
    _run(dist_run, tp, embedding_case)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_matches_plain(dist_run, tp):
    _run(dist_run, tp, sequence_parallel_case)


def test_strided_shards_take_blocks_round_robin():
    full = torch.arange(8.0).view(8, 1)  # blocks of 2 at stride 2, tp 2: rank 0 gets blocks 0 and 2
    assert shard_master_weight(full, 0, 0, 2, stride=2).flatten().tolist() == [0, 1, 4, 5]
    assert shard_master_weight(full, 0, 1, 2, stride=2).flatten().tolist() == [2, 3, 6, 7]


def bad_shape_case(tp):
    grid_for(tp)
    with pytest.raises(ValueError, match=r"output_size \(6\) is not divisible by the tensor-parallel size 4"):
        ColumnParallelLinear(8, 6)
    with pytest.raises(ValueError, match=r"input_size \(10\) is not divisible by the tensor-parallel size 4"):
        RowParallelLinear(10, 8)
    with pytest.raises(ValueError, match=r"num_embeddings \(vocabulary size\) \(30\) is not divisible"):
        VocabParallelEmbedding(30, 8)
    with pytest.raises(ValueError, match="sequence_parallel=True requires input_is_parallel=True"):
        RowParallelLinear(8, 8, sequence_parallel=True)
    return True


def test_bad_layer_shapes_fail_with_one_line(dist_run):
    assert all(dist_run(4, bad_shape_case, 4))
