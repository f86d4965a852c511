"""Leaving a run on request: SIGTERM and SIGUSR1 (what Slurm and most schedulers send before a time limit or a
preemption) make the run finish its current step, save a checkpoint of it and exit 0 (Megatron's
``--exit-signal-handler``); ``--load`` (or auto-resume) then continues exactly.

A signal may reach some ranks only, or reach them in different steps, so after every step the ranks agree on it
with one all-reduce of a flag (MAX over all ranks): every rank leaves after the same step. Outside the loop the
previous handlers are back, so a signal during set-up or export behaves as usual.
"""

from __future__ import annotations

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
