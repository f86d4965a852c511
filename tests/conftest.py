"""Shared fixtures: a pool of long-lived gloo worker processes per world size.

Starting processes and a gloo world costs seconds (2-3 s for 2 ranks, 5-6 s for 4 on 2 CPU cores), so each world size
gets one pool for the whole session. A test hands the pool a module-level function; every rank runs it and the results
come back as a list indexed by rank. A failure on any rank fails the test with that rank's traceback and retires the
pool (its collectives may be out of step); the next test gets a fresh one.

A task may also run a command's ``main`` as its launcher would (``tests.mains.run_main``): the world group it
destroys on the way out is made again, on a fresh port, before the next task.

After every task each worker destroys the process groups the task made (``release_groups``: each gloo group holds
threads until destroyed, and a worker that kept them reached ~680 threads and slowed the whole machine), then
reports its thread count. A worker holding more than ``THREAD_BOUND`` threads above its count when it started
fails the test that left them, so a leak cannot come back unseen.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from pathlib import Path

import pytest

# Every process a test starts (launch/*.py, torchrun, ``python -c``) imports this checkout's zoo: the checkout goes
# first on PYTHONPATH, ahead of an installed copy (CI installs zoo into its venv, not editable) and ahead of nothing
# at all (launch/*.py leave sys.path alone). This process itself imports it from the checkout already (pytest puts
# the rootdir of the tests package first on sys.path).
ROOT = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

THREAD_BOUND = 24  # threads a worker may hold beyond its start-up count between tasks
RETIRED_THREADS = 48  # threads the retired (ZeRO-3) tasks of a pool may leave in all before the pool is closed


def _threads() -> int:
    """Threads of this process as the kernel counts them (gloo's are native threads, invisible to ``threading``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    try:
        import torch

        torch.set_num_threads(1)
        from zoo.parallel.topology import destroy_model_parallel, init_distributed, release_groups

        init_distributed()
        results.put((rank, True, "ready", _threads()))
    except BaseException:
        results.put((rank, False, traceback.format_exc(), 0))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs, next_port = item
        try:
            value, ok = fn(*args, **kwargs), True
        except BaseException:
            value, ok = traceback.format_exc(), False
        try:
            release_groups()
            if not torch.distributed.is_initialized():  # a command's main tears the world down as it exits
                os.environ["MASTER_PORT"] = str(next_port)
                init_distributed()
        except BaseException:
            value, ok = traceback.format_exc(), False
        results.put((rank, ok, value, _threads()))
    destroy_model_parallel()


class DistPool:
    def __init__(self, world_size: int, start_timeout: float = 300.0):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.threads = [0] * world_size
        self._collect(start_timeout, "start")
        self.start_threads = list(self.threads)  # the guard's baseline (raised by retired tasks)
        self.first_threads = list(self.threads)

    def _collect(self, timeout: float, what: str, guard: bool = True) -> list:
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value, self.threads[rank] = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{self.world_size}-rank pool: no result from every rank within {timeout}s "
                                   f"({what}); errors so far: {errors}") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                timeout = min(timeout, 20.0)  # peers of a failed rank may hang in a collective
        if errors:
            self.close()
            raise AssertionError("\n".join(errors))
        if guard and what != "start":
            leaks = [f"rank {r}: {n} threads (started with {s})" for r, (n, s) in
                     enumerate(zip(self.threads, self.start_threads)) if n > s + THREAD_BOUND]
            if leaks:
                self.close()
                raise AssertionError(f"{self.world_size}-rank pool: {what} left threads behind after its process "
                                     f"groups were destroyed: {'; '.join(leaks)}; bound +{THREAD_BOUND}. Stop what "
                                     f"starts them (or destroy the groups it makes) at the end of the task.")
        return out

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = 300.0, _guard: bool = True, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        port = _free_port()  # where the world is made again if the task destroys it (a command's main does)
        for q in self.tasks:
            q.put((fn, args, kwargs, port))
        return self._collect(timeout, getattr(fn, "__name__", str(fn)), guard=_guard)

    def close(self, grace: float = 1.0) -> None:
        """Ask every worker to stop, give them ``grace`` seconds together, then kill the rest. A closed pool's
        workers hold nothing a test reads, and their interpreter exit (collecting everything the tasks imported and
        built) took 2-5 s per pool: the suite paid it at every retired pool and at the end of the session."""
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: a second intra-op thread only adds synchronisation (many times slower on a busy machine).
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Pools:
    """``dist_run(world_size, fn, *args, **kwargs)`` -> list of per-rank return values, on the shared pools."""

    def __init__(self):
        self.pools: dict[int, DistPool] = {}

    def __call__(self, world_size: int, fn, *args, **kwargs):
        pool = self.pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self.pools[world_size] = DistPool(world_size)
        try:
            return pool.run(fn, *args, **kwargs)
        except BaseException:
            self.pools.pop(world_size, None)
            pool.close()
            raise

    def retire(self, world_size: int, fn, *args, **kwargs):
        """Like the call, without the thread guard, for tasks known to leave threads behind; the pool stays (a
        fresh one costs ~5 s to start) until its workers hold ``RETIRED_THREADS`` extra threads, then it closes.

        For DeepSpeed ZeRO-3 engines: after ``destroy`` they stay reachable from autograd state that Python's
        garbage collector cannot see, and keep their process groups (4 per engine, 2 threads each) until the
        process ends. The threads such a task leaves become the pool's new baseline, so the guarded tasks after it
        are still held to ``THREAD_BOUND`` threads of their own.
        """
        pool = self.pools.pop(world_size, None)
        if pool is None or not pool.alive:
            pool = DistPool(world_size)
        try:
            out = pool.run(fn, *args, _guard=False, **kwargs)
        except BaseException:
            pool.close()
            raise
        if any(n > s + RETIRED_THREADS for n, s in zip(pool.threads, pool.first_threads)):
            pool.close()
        else:
            pool.start_threads = [max(n, s) for n, s in zip(pool.threads, pool.start_threads)]
            self.pools[world_size] = pool
        return out

    def close(self):
        for pool in self.pools.values():
            pool.close()


@pytest.fixture(scope="session")
def dist_run():
    """``dist_run(world_size, fn, *args, **kwargs)`` -> list of per-rank return values; ``dist_run.retire(...)``
    runs the same way and closes the pool after."""
    pools = _Pools()
    yield pools
    pools.close()
