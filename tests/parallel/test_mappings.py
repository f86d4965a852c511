"""Each comm primitive against its definition: forward and backward computed by hand from every rank's data."""

import pytest
import torch

from tests.parallel.helpers import assert_close, chunk, grid_for
from zoo.parallel import mappings as M

B, S, H = 2, 4, 8


def _rank_tensor(rank, shape, salt):
    """Data that differs per rank, known to every rank (so the expected collective result is computable)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def primitives_case(tp):
    grid = grid_for(tp)
    rank = 0 if grid is None else grid.tp_rank
    world = tp
    ranks = range(world)
    xs = [_rank_tensor(r, (B, S, H), 1) for r in ranks]
    gs = [_rank_tensor(r, (B, S, H), 2) for r in ranks]
    x_total, g_total = sum(xs), sum(gs)

    def run(fn, x, dy, **kw):
        x = x.clone().requires_grad_()
        y = fn(x, **kw)
        y.backward(dy)
        return y.detach(), x.grad

    # f: identity forward, all-reduce backward
    y, dx = run(M.copy_to_tensor_model_parallel_region, xs[rank], gs[rank])
    assert_close(y, xs[rank], "copy fwd")
    assert_close(dx, g_total, "copy bwd")
    # g: all-reduce forward, identity backward
    y, dx = run(M.reduce_from_tensor_model_parallel_region, xs[rank], gs[rank])
    assert_close(y, x_total, "reduce fwd")
    assert_close(dx, gs[rank], "reduce bwd")
    # scatter (last dim): own chunk forward, all-gather backward
    gh = [_rank_tensor(r, (B, S, H // world), 3) for r in ranks]
    y, dx = run(M.scatter_to_tensor_model_parallel_region, xs[0], gh[rank])
    assert_close(y, chunk(xs[0], -1, rank, world), "scatter fwd")
    assert_close(dx, torch.cat(gh, -1), "scatter bwd")
    # gather (last dim): all-gather forward, own chunk backward
    y, dx = run(M.gather_from_tensor_model_parallel_region, xs[rank], gs[rank].repeat(1, 1, world))
    assert_close(y, torch.cat(xs, -1), "gather fwd")
    assert_close(dx, gs[rank], "gather bwd")

    # sequence parallel (dim 1)
    gs_seq = [_rank_tensor(r, (B, S // world, H), 4) for r in ranks]
    y, dx = run(M.scatter_to_sequence_parallel_region, xs[0], gs_seq[rank])
    assert_close(y, chunk(xs[0], 1, rank, world), "sp scatter fwd")
    assert_close(dx, torch.cat(gs_seq, 1), "sp scatter bwd")
    y, dx = run(M.reduce_scatter_to_sequence_parallel_region, xs[rank], gs_seq[rank])
    assert_close(y, chunk(x_total, 1, rank, world), "sp reduce-scatter fwd")
    assert_close(dx, torch.cat(gs_seq, 1), "sp reduce-scatter bwd")
    xs_seq = [_rank_tensor(r, (B, S // world, H), 5) for r in ranks]
    y, dx = run(M.gather_from_sequence_parallel_region, xs_seq[rank], gs[rank])
    assert_close(y, torch.cat(xs_seq, 1), "sp gather fwd")
    assert_close(dx, chunk(g_total, 1, rank, world), "sp gather bwd (reduce-scatter)")
    y, dx = run(M.gather_from_sequence_parallel_region, xs_seq[rank], gs[0], tensor_parallel_output_grad=False)
    assert_close(dx, chunk(gs[0], 1, rank, world), "sp gather bwd (split)")
    return True


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_primitives_forward_and_backward(dist_run, tp):
    if tp == 1:
        assert primitives_case(1)
    else:
        assert all(dist_run(tp, primitives_case, tp))


def scatter_gather_case():
    """Ulysses' exchange on the world group: heads (dim 1) scattered, sequence (dim 2) gathered, and back."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    xs = [_rank_tensor(r, (B, 2 * world, S, H), 6) for r in range(world)]  # [b, n, s_l, d] per rank
    gs = [_rank_tensor(r, (B, 2, world * S, H), 7) for r in range(world)]  # [b, n/p, s, d] per rank
    x = xs[rank].clone().requires_grad_()
    y = M.all_to_all_scatter_gather(x, 1, 2, dist.group.WORLD)
    assert_close(y, torch.cat([chunk(xs[j], 1, rank, world) for j in range(world)], 2), "scatter-gather fwd")
    y.backward(gs[rank])
    assert_close(x.grad, torch.cat([chunk(gs[j], 2, rank, world) for j in range(world)], 1), "scatter-gather bwd")
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_scatter_gather_forward_and_backward(dist_run, world):
    assert all(dist_run(world, scatter_gather_case))


def test_size_one_group_returns_input_itself():
    x = torch.randn(2, 4, 8, requires_grad=True)
    for fn in (M.copy_to_tensor_model_parallel_region, M.reduce_from_tensor_model_parallel_region,
               M.scatter_to_tensor_model_parallel_region, M.gather_from_tensor_model_parallel_region,
               M.scatter_to_sequence_parallel_region, M.gather_from_sequence_parallel_region,
               M.reduce_scatter_to_sequence_parallel_region):
        assert fn(x) is x, fn.__name__
    assert M.all_to_all_scatter_gather(x, 1, 2, None) is x
