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

At ZeRO-3 a rank holds its flat partition of each parameter (``ds_tensor``, DeepSpeed's ``ceil(n / dp)`` elements
at offset ``rank x that``) and averages that, so the average is partitioned over data parallelism like the weights;
the average's checkpoint and the export gather it over the parameter's partition group for the duration of the
write (:meth:`EMA.swapped`), and a resume cuts the rank's partition from what it reads.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from zoo.compat.torch import foreach_lerp_


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
        self.shadow = [held(p).detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the weights after optimizer step ``step`` (1-based)."""
        weight = 1.0 - decay_at(step, self.decay)
        foreach_lerp_(self.shadow, [held(p).detach().float() for p in self.params], weight)

    @contextlib.contextmanager
    def swapped(self, write_back: bool = False):
        """Within the block the module's parameters hold the average (their ``.data`` swapped; nothing copied at
        ZeRO 0-2, the whole tensors gathered at ZeRO-3): anything that reads or writes the module (``save_model``,
        ``load_model``, a forward at ZeRO 0-2) sees it. ``write_back``: the block writes every parameter and reads
        none (a load), so ZeRO-3 parameters get uninitialised whole tensors instead of a gather, and what the block
        wrote into them becomes this rank's partition of the average (at ZeRO 0-2 it writes into it directly)."""
        saved = [p.data for p in self.params]
        partitioned = [hasattr(p, "ds_tensor") for p in self.params]
        try:
            for p, s, part in zip(self.params, self.shadow, partitioned):
                if part:
                    p.data = s.new_empty(p.ds_shape) if write_back else gather_partitions(p, s)
                    p.zoo_whole = True  # zoo.convert.io reads p.data as it is, without DeepSpeed's gather
                else:
                    p.data = s
            yield
            if write_back:
                for p, s, part in zip(self.params, self.shadow, partitioned):
                    if part:
                        s.copy_(own_partition(p, p.data))
        finally:
            for p, d in zip(self.params, saved):
                p.data = d
                p.__dict__.pop("zoo_whole", None)

    def save(self, folder: Path, grid, family: str, config: dict) -> None:
        """Collective: the average as a model folder (layout-free, fp32)."""
        from zoo.convert.io import save_model

        with self.swapped():
            save_model(folder, self.module, grid, family, config)

    def load(self, folder: Path, grid) -> None:
        """This rank's slices of a model folder (written by :meth:`save` in any layout) as the average."""
        from zoo.convert.io import load_model

        with self.swapped(write_back=True):
            load_model(folder, self.module, grid.tp_group, grid.ep_group if grid.ep > 1 else None)


def held(p: torch.Tensor) -> torch.Tensor:
    """What this rank holds of parameter ``p``: the tensor, or at ZeRO-3 its flat partition."""
    return p.ds_tensor if hasattr(p, "ds_tensor") else p


def gather_partitions(p: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """The whole ``p.ds_shape`` tensor from every rank's flat partition ``part`` of ZeRO-3 parameter ``p``
    (collective over ``p.ds_process_group``; DeepSpeed's layout: rank r holds elements [r k, (r + 1) k), the last
    ones zero padding)."""
    import torch.distributed as dist

    group = p.ds_process_group
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts)[:p.ds_numel].view(p.ds_shape)


def own_partition(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's flat partition (padded with zeros) of the whole value ``whole`` of ZeRO-3 parameter ``p``."""
    import torch.distributed as dist

    k = p.ds_tensor.ds_numel
    start = k * dist.get_rank(group=p.ds_process_group)
    flat = whole.reshape(-1)[start:start + k]
    return torch.cat([flat, flat.new_zeros(k - flat.numel())]) if flat.numel() < k else flat
