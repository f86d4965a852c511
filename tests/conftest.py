"""Shared fixtures: a pool of long-lived gloo worker processes per world size.

Starting processes and a gloo world costs seconds (PLATFORM.md), so each world size gets one pool for the whole
session. A test hands the pool a module-level function; every rank runs it and the results come back as a list
indexed by rank. A failure on any rank fails the test with that rank's traceback and retires the pool (its
collectives may be out of step); the next test gets a fresh one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback

import pytest


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
        from zoo.parallel.topology import destroy_model_parallel, init_distributed

        init_distributed()
        results.put((rank, True, "ready"))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
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
        self._collect(start_timeout, "start")

    def _collect(self, timeout: float, what: str) -> list:
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{self.world_size}-rank pool: no result from every rank within {timeout}s ({what}); "
                                   f"errors so far: {errors}") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                timeout = min(timeout, 20.0)  # peers of a failed rank may hang in a collective
        if errors:
            self.close()
            raise AssertionError("\n".join(errors))
        return out

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = 300.0, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        for q in self.tasks:
            q.put((fn, args, kwargs))
        return self._collect(timeout, getattr(fn, "__name__", str(fn)))

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


@pytest.fixture(scope="session")
def dist_run():
    """``dist_run(world_size, fn, *args, **kwargs)`` -> list of per-rank return values."""
    pools: dict[int, DistPool] = {}

    def run(world_size: int, fn, *args, **kwargs):
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pool = pools[world_size] = DistPool(world_size)
        try:
            return pool.run(fn, *args, **kwargs)
        except BaseException:
            pools.pop(world_size, None)
            pool.close()
            raise

    yield run
    for pool in pools.values():
        pool.close()
