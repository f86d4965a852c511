"""An exponential moving average of the weights (``training.ema_decay``), kept per rank in the run's layout.

After optimizer step ``n`` (1, 2, ...) every tensor the rank trains moves towards the new weights:
``ema = d_n * ema + (1 - d_n) * weights`` with ``d_n = min(ema_decay, (1 + n) / (10 + n))``, the warm-up of
TensorFlow's ``ExponentialMovingAverage(num_updates=...)`` that diffusers' ``EMAModel`` also uses: early averages do
not drag the random initialisation along for thousands of steps. The decay depends on the step alone, so a resumed
run needs nothing but the averaged tensors.

Each rank averages what it holds (its tensor-parallel slices, its pipeline stage's layers, its experts), in fp32
whatever the training precision. Checkpoints hold the average as a layout-free model folder (``<checkpoint>/ema``,
:func:`zoo.convert.io.save_model`), so a run resumed in another tp/pp/dp layout reads its own slices back with
:func:`zoo.convert.io.load_model`, as it reads initial weights; and the exported ``model/`` is the average (as the
diffusers training scripts export their EMA U-Net), the training weights staying in the checkpoints.

ZeRO-3 is refused by config validation: its parameters are partitioned over data parallelism and gathered only
around their use, so the rank has no whole local tensor to average.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

def decay_at(step: int, decay: float) -> float:
    """The decay applied after optimizer step ``step`` (1-based)."""
    return min(decay, (1.0 + step) / (10.0 + step))


class EMA:
    """The averaged copies of ``module``'s parameters (this rank's part of the model)."""

    def __init__(self, module: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay!r}")
        self.module, self.decay = module, decay
        self.params = list(module.parameters())
        if any(p.numel() == 0 and hasattr(p, "ds_id") for p in self.params):
            raise ValueError("EMA needs whole local parameters: ZeRO-3 partitions them; use ZeRO 0-2")
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the weights after optimizer step ``step`` (1-based)."""
        weight = 1.0 - decay_at(step, self.decay)
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], weight)

    @contextlib.contextmanager
    def swapped(self):
        """Within the block the module's parameters hold the average (their ``.data`` swapped, nothing copied):
        anything that reads or writes the module (``save_model``, ``load_model``, a forward) sees it."""
        saved = [p.data for p in self.params]
        try:
            for p, s in zip(self.params, self.shadow):
                p.data = s
            yield
        finally:
            for p, d in zip(self.params, saved):
                p.data = d

    def save(self, folder: Path, grid, family: str, config: dict) -> None:
        """Collective: the average as a model folder (layout-free, fp32)."""
        from zoo.convert.io import save_model

        with self.swapped():
            save_model(folder, self.module, grid, family, config)

    def load(self, folder: Path, grid) -> None:
        """This rank's slices of a model folder (written by :meth:`save` in any layout) as the average."""
        from zoo.convert.io import load_model

        with self.swapped():
            load_model(folder, self.module, grid.tp_group, grid.ep_group if grid.ep > 1 else None)
