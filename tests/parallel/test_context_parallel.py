"""Context parallelism against full attention on the gathered sequence: Ulysses and ring attention, forward and q/k/v
gradients, at cp=2 and cp=4, MHA and GQA; the sequence splits and the ring's causal balance by counting pairs; the
whole-sequence loss mean and its gradient scale.

The multi-process cases run on the 4-rank pool: cp=4 on all ranks, and cp=2 on the strided groups {0, 2} and
{1, 3}, so a group rank differs from the global one (the ring's next and previous ranks are looked up in the group).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.parallel.helpers import assert_close, gen
from zoo.parallel.context_parallel import (
    check_sequence_split,
    context_parallel_mean,
    ring_attended_pairs,
    ring_attention,
    sequence_positions,
    split_sequence,
    ulysses_attention,
)

B, S, D = 2, 32, 8
ATTENTION = {"ulysses": ulysses_attention, "ring": ring_attention}


# ---------------------------------------------------------------------------------------------------------------
# Splits and balance (one process)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["ulysses", "ring"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_holds_the_positions_and_covers_the_sequence(algorithm, cp):
    s = 16
    x = torch.arange(s).repeat(3, 1)  # [3, s]: each element is its position
    held = [split_sequence(x, 1, r, cp, algorithm) for r in range(cp)]
    for r, part in enumerate(held):
        assert torch.equal(part, sequence_positions(s, r, cp, algorithm).repeat(3, 1))
    assert torch.equal(torch.cat(held, 1)[0].sort().values, torch.arange(s))
    if algorithm == "ulysses":
        assert torch.equal(torch.cat(held, 1), x)  # contiguous: rank order is sequence order
    else:
        assert sequence_positions(s, 0, cp, "ring").tolist() == [*range(s // (2 * cp)), *range(s - s // (2 * cp), s)]


@pytest.mark.parametrize("s, cp, algorithm, needed", [(10, 4, "ulysses", "4 = cp"), (12, 4, "ring", "8 = 2*cp"),
                                                      (6, 4, "ring", "8 = 2*cp")])
def test_split_refuses_in_one_line(s, cp, algorithm, needed):
    with pytest.raises(ValueError, match=re.escape(f"sequence length {s} is not divisible by {needed}")) as err:
        split_sequence(torch.zeros(1, s), 1, 0, cp, algorithm)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="must be one of"):
        check_sequence_split(8, 2, "zigzag")


def _pairs_from_positions(s, cp, algorithm):
    """Causal (query, key) pairs each rank's queries have, counted from the positions alone."""
    return [int((torch.arange(s)[None, :] <= sequence_positions(s, r, cp, algorithm)[:, None]).sum())
            for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_balances_the_causal_work(cp):
    s = 64
    counts = ring_attended_pairs(s, cp)
    assert len(set(counts)) == 1, counts
    assert counts == _pairs_from_positions(s, cp, "ring")  # the schedule computes exactly the causal pairs
    assert sum(counts) == s * (s + 1) // 2
    contiguous = _pairs_from_positions(s, cp, "ulysses")
    assert contiguous[-1] > 2 * contiguous[0]  # what the layout avoids
    assert ring_attended_pairs(s, cp, causal=False) == [s * s // cp] * cp


def test_group_of_one_is_plain_attention():
    q, k, v = (torch.randn(B, n, S, D, generator=gen(i)) for i, n in enumerate((4, 2, 2)))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for fn in ATTENTION.values():
        assert_close(fn(q, k, v, None), ref, fn.__name__)
    local_sum, count = torch.tensor(6.0), torch.tensor(4)
    assert context_parallel_mean(local_sum, count, None) == 1.5


# ---------------------------------------------------------------------------------------------------------------
# Attention on gloo
# ---------------------------------------------------------------------------------------------------------------


def _cp_groups(cp: int):
    """cp=world: one group of all; cp=2 on 4 ranks: {0, 2} and {1, 3}. -> (this rank's group, every group made)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    lists = [list(range(world))] if cp == world else [list(range(j, world, world // cp)) for j in range(world // cp)]
    made = [dist.new_group(ranks) for ranks in lists]
    index = next(i for i, ranks in enumerate(lists) if rank in ranks)
    return made[index], index, made


def _attention_against_full(fn, group, algorithm, nq, nkv, causal, seed):
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = (torch.randn(B, n, S, D, generator=gen(seed + i)) for i, n in enumerate((nq, nkv, nkv)))
    dout = torch.randn(B, nq, S, D, generator=gen(seed + 3))  # O(1) upstream gradient: 1e-6 means something
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=nq != nkv)
    ref.backward(dout)

    mine = lambda t: split_sequence(t, 2, rank, cp, algorithm)
    local = [mine(t).requires_grad_() for t in (q, k, v)]
    out = fn(*local, group, causal=causal)
    out.backward(mine(dout))
    what = f"{algorithm} cp={cp} nq={nq} nkv={nkv} causal={causal}"
    assert_close(out, mine(ref), f"{what}: output")
    for name, t, t_ref in zip("qkv", local, full):
        assert_close(t.grad, mine(t_ref.grad), f"{what}: d{name}")


HEADS = {"ulysses": [(4, 4), (4, 2), (8, 1)], "ring": [(4, 4), (4, 2), (3, 1)]}  # ring: any head count


def attention_case(cp: int):
    group, index, made = _cp_groups(cp)
    try:
        for algorithm, fn in ATTENTION.items():
            for h, (nq, nkv) in enumerate(HEADS[algorithm]):
                _attention_against_full(fn, group, algorithm, nq, nkv, True, 100 * index + 10 * h)
            _attention_against_full(fn, group, algorithm, 4, 2, False, 100 * index + 50)
        return True
    finally:
        for g in made:
            dist.destroy_process_group(g)


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_equals_full_attention(dist_run, cp):
    assert all(dist_run(4, attention_case, cp))


def errors_case():
    group, _, made = _cp_groups(4)
    try:
        messages = []
        q = torch.randn(1, 6, 8, D)
        with pytest.raises(ValueError, match="Ulysses splits the 6 query heads") as err:
            ulysses_attention(q, q, q, group)
        messages.append(str(err.value))
        with pytest.raises(ValueError, match="sequence length 12 is not divisible by 8 = 2\\*cp") as err:
            ring_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], group)
        messages.append(str(err.value))
        return messages
    finally:
        for g in made:
            dist.destroy_process_group(g)


def test_head_and_length_errors_are_one_line(dist_run):
    for messages in dist_run(4, errors_case):
        assert all("\n" not in m for m in messages), messages


def mean_case():
    group, _, made = _cp_groups(4)
    try:
        rank = dist.get_rank(group)
        local_sum = torch.tensor(float(rank + 1), requires_grad=True)  # sums 1..4 = 10
        count = torch.tensor([1, 0, 3, 1][rank])  # 5 labels in all, one rank with none
        loss = context_parallel_mean(local_sum, count, group)
        loss.backward()
        return loss.item(), local_sum.grad.item()
    finally:
        for g in made:
            dist.destroy_process_group(g)


def test_loss_mean_is_global_and_its_gradient_scales_for_averaging(dist_run):
    for loss, grad in dist_run(4, mean_case):
        assert loss == pytest.approx(10 / 5)
        assert grad == pytest.approx(4 / 5)  # cp / global count: the average over the 4 ranks is 1 / 5 per token
