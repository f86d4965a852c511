"""Leaving a run on request: SIGTERM and SIGUSR1 (what Slurm and most schedulers send before a time limit or a
preemption) make the run finish its current step, save a checkpoint of it and exit 0 (Megatron's
``--exit-signal-handler``); ``--load`` (or auto-resume) then continues exactly.

A signal may reach some ranks only, or reach them in different steps, so after every step the ranks agree on it
with one all-reduce of a flag (MAX over all ranks): every rank leaves after the same step. Outside the loop the
previous handlers are back, so a signal during set-up or export behaves as usual.

Leaving when a peer is gone: a collective fails when another rank's process died (gloo sees the connection close)
or when it waits longer than ``training.collective_timeout_minutes`` (a rank that hangs). The loop turns that
into one line on each surviving rank (:func:`collective_failure`; exit status 4) instead of a traceback or a hang.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitRequest:
    """``with ExitRequest() as request:`` ... ``if request.agreed(device): save, leave``."""

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> ExitRequest:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.received = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a signal"

    def agreed(self, device) -> bool:
        """Collective (all ranks, after each step): whether any rank has received an exit signal."""
        flag = torch.tensor([float(self.received or 0)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not self.received:
            self.received = int(flag.item())  # another rank's signal
        return bool(flag.item())


class CollectiveError(RuntimeError):
    """A collective of a training step failed on this rank; the message is one line."""


ROLL_CALL_SECONDS = 5.0  # how long a survivor waits for the other survivors to answer


def unanswered_ranks(world_size: int, rank: int, wait_s: float = ROLL_CALL_SECONDS) -> list[int] | None:
    """After a failed collective: a roll call through the job's key-value store (the rendezvous store, which
    outlives the collective). Every surviving rank fails too and answers; the ranks that have not answered within
    ``wait_s`` are the dead or hung ones. None when the store itself is gone (its host was the rank that died)."""
    import time

    try:
        from zoo.compat.torch import default_store

        store = default_store()
        store.set(f"zoo/alive/{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world_size) if not store.check([f"zoo/alive/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - any failure of the store: no names, the message says so
        return None


def collective_failure(error: BaseException, rank: int, step: int, timeout_minutes: float,
                       missing: list[int] | None = None) -> CollectiveError:
    """The one-line account of a failed collective (``torch.distributed.DistBackendError``): a peer process died
    (gloo: the connection closed; NCCL: a remote error) or stopped answering for ``timeout_minutes``; ``missing``:
    the ranks that did not answer the roll call (:func:`unanswered_ranks`)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # gloo: "[<source file>:<line>] Read error ..."
    if missing:
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not answer within "
               f"{ROLL_CALL_SECONDS:g} s: dead or hung (its own log or the launcher's says why)")
    else:
        who = "another rank died or stopped answering (its own log or the launcher's says which and why)"
    return CollectiveError(f"rank {rank}: a collective of step {step} failed ({first[:200]}); {who}; "
                           f"training.collective_timeout_minutes {timeout_minutes:g} bounds the wait; the same "
                           f"command resumes from the newest intact checkpoint")


@contextlib.contextmanager
def collectives_guarded(grid, step, timeout_minutes: float):
    """Inside: a failed collective (``torch.distributed.DistBackendError``, or gloo's RuntimeError) becomes a
    CollectiveError naming this rank, the step (``step()``: the step being run) and the ranks that did not answer."""
    try:
        yield
    except RuntimeError as e:
        text = str(e).lower()
        # NCCL's failures are DistBackendError; gloo's are plain RuntimeErrors from its transport.
        if not (isinstance(e, dist.DistBackendError) or "gloo" in text or "nccl" in text):
            raise
        missing = unanswered_ranks(grid.world_size, grid.rank)
        raise collective_failure(e, grid.rank, step(), timeout_minutes, missing) from None
