"""The test harness itself: worker pools destroy the groups a task makes, and the thread guard catches a leak."""

import threading

import pytest

from tests.conftest import THREAD_BOUND, DistPool


def _make_groups(n):
    import torch
    import torch.distributed as dist

    from zoo.compat.torch import process_groups

    world = dist.get_world_size()
    for _ in range(n):
        g = dist.new_group(ranks=list(range(world)))
        t = torch.ones(1)
        dist.all_reduce(t, group=g)  # a used group: its connections (and threads) really exist
    return len(process_groups())


def _count_groups():
    from zoo.compat.torch import process_groups

    return len(process_groups())


_parked = threading.Event()


def _leak_threads(n):
    for _ in range(n):
        threading.Thread(target=_parked.wait, daemon=True).start()
    return n


def test_groups_made_by_a_task_are_destroyed_after_it(dist_run):
    made = dist_run(2, _make_groups, 30)
    assert made == [31, 31]  # the world group and the task's 30 while it ran
    assert dist_run(2, _count_groups) == [1, 1]  # only the world group is left for the next task


def test_thread_guard_fails_the_task_that_leaks():
    pool = DistPool(1)
    try:
        with pytest.raises(AssertionError, match="left threads behind"):
            pool.run(_leak_threads, THREAD_BOUND + 8)
    finally:
        pool.close()  # the parked threads are daemons: they end with the worker
