"""Expert parallelism on gloo: the ``all_to_all`` primitive against the arithmetic of who sends what.

Workers build their groups with ``new_group`` and destroy them before returning (the pools are long-lived).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zoo.parallel.mappings import all_to_all


def _groups(tp: int, ep: int):
    """TP groups of adjacent ranks, EP groups of the ranks with the same TP rank (as Megatron lays them out), and
    this rank's group of one (for the reference). -> (tp_group, ep_group, single, every group made)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == tp * ep
    made, mine = [], {}

    def new(kind, ranks):
        group = dist.new_group(ranks)
        made.append(group)
        if rank in ranks:
            mine[kind] = group

    for r in range(world):
        new("single", [r])
    for i in range(ep):
        new("tp", list(range(i * tp, (i + 1) * tp)))
    for j in range(tp):
        new("ep", list(range(j, world, tp)))
    return mine["tp"], mine["ep"], mine["single"], made


def _destroy(groups) -> None:
    for group in groups:
        dist.destroy_process_group(group)


# ---------------------------------------------------------------------------------------------------------------
# The primitive
# ---------------------------------------------------------------------------------------------------------------


def all_to_all_case():
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = lambda src, dst: (src + 2 * dst) % 3  # rows from src to dst: uneven, some zero
    send = [sends(rank, j) for j in range(world)]
    recv = [sends(j, rank) for j in range(world)]
    # Each row names itself: (source, destination, index), then a value.
    x = torch.tensor([[rank, j, i, 0.5 * i - rank] for j in range(world) for i in range(send[j])]).reshape(-1, 4)
    x.requires_grad_()
    y = all_to_all(x, recv, send, dist.group.WORLD)
    expected = torch.tensor([[j, rank, i, 0.5 * i - j] for j in range(world) for i in range(recv[j])]).reshape(-1, 4)
    assert torch.equal(y, expected), (y, expected)
    # Backward: a gradient that names the receiving row comes back to the row that was sent.
    label = lambda rows: 1000 * rows[:, :1] + 100 * rows[:, 1:2] + 10 * rows[:, 2:3] + torch.arange(4.0)
    y.backward(label(y.detach()))
    assert torch.equal(x.grad, label(x.detach())), (x.grad, label(x.detach()))
    return sum(send), sum(recv)


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_uneven_splits(dist_run, world):
    counts = dist_run(world, all_to_all_case)
    assert sum(s for s, _ in counts) == sum(r for _, r in counts) > 0


def test_all_to_all_group_of_one_is_identity():
    x = torch.randn(3, 2)
    assert all_to_all(x, [3], [3], None) is x
