"""Steps whose gradients are not finite are skipped on every rank, counted, and a run of them stops the training.

A NaN or inf that reaches the gradients (a NaN loss on any rank does: tensor-parallel backward and the
data-parallel reduction spread it) must not reach the weights. DeepSpeed's optimizers already refuse such a step
where they compute the global gradient norm: ZeRO-1/2 (fp32 and bf16) and its bf16 optimizer mark it an overflow
and return before any update, fp16's loss scaler does the same and lowers its scale. The engine then counts it in
``skipped_steps`` and leaves the LR schedule where it was. Without ZeRO in fp32, DeepSpeed hands the step to the
bare torch optimizer; :class:`NonFiniteSteps` puts the same guard in front of it: the global gradient norm
(``zoo.parallel.grad_norm``, also when clipping is off), agreed over all ranks, and ``overflow`` set as
DeepSpeed's optimizers set it. A skipped step leaves weights and optimizer state bit-identical.

The loop asks :meth:`NonFiniteSteps.after_step` about each step: it is logged and counted in metrics.jsonl
(``skipped``, ``skipped_steps``); ``training.max_skipped_steps`` in a row stop the run with one line naming the
step, the last checkpoint and what to try. fp16's scaler skips are its calibration, so there only steps whose loss
is not finite count towards the limit.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zoo.compat import deepspeed as ds_compat
from zoo.parallel.grad_norm import clip_grad_norm_


class DivergedError(RuntimeError):
    """Too many non-finite steps in a row; the message is one line."""


class NonFiniteSteps:
    def __init__(self, engine, grid, *, precision: str, zero_stage: int, grad_clip: float, max_in_a_row: int):
        self.engine, self.grid, self.precision = engine, grid, precision
        self.max_in_a_row, self.in_a_row, self.total = max_in_a_row, 0, 0
        self._seen = getattr(engine, "skipped_steps", 0)
        if zero_stage == 0 and precision == "fp32":
            self._guard_torch_optimizer(grad_clip)

    def _guard_torch_optimizer(self, grad_clip: float) -> None:
        engine, grid, optimizer = self.engine, self.grid, self.engine.optimizer
        unguarded = optimizer.step

        def step(*args, **kwargs):
            # With clipping, the engine's clip hook has just computed the norm (zoo.training.engine.build_engine).
            norm = ds_compat.global_grad_norm(engine) if grad_clip > 0 else clip_grad_norm_(
                engine.module.parameters(), math.inf, grid)
            bad = torch.tensor([0.0 if norm is not None and math.isfinite(norm) else 1.0])
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            overflow = bool(bad.item())
            ds_compat.set_overflow(optimizer, overflow)  # DeepSpeed then takes no LR step and counts it skipped
            if not overflow:
                return unguarded(*args, **kwargs)
            ds_compat.set_global_grad_norm(engine, float("inf"))
            return None

        optimizer.step = step

    def after_step(self, step: int, loss: float, checkpoints) -> dict:
        """The metrics of optimizer step ``step`` (1-based) about skipping; raises DivergedError past the limit.
        ``checkpoints``: the run's checkpoint folder (for the message)."""
        count = getattr(self.engine, "skipped_steps", 0)
        skipped = count > self._seen
        self._seen = count
        self.total += skipped
        counts = not math.isfinite(loss) if self.precision == "fp16" else skipped
        self.in_a_row = self.in_a_row + 1 if counts else 0
        if self.in_a_row and self.in_a_row >= self.max_in_a_row:
            from zoo.training.checkpoint import read_latest

            tag = read_latest(checkpoints)
            last = f"last checkpoint {checkpoints / tag}" if tag else "no checkpoint saved"
            raise DivergedError(f"step {step}: loss or gradients not finite in {self.in_a_row} steps in a row "
                                f"(training.max_skipped_steps {self.max_in_a_row}); the weights are those before "
                                f"them, {last}; try a lower training.lr, a longer training.warmup_steps, "
                                f"training.grad_clip, or bf16 instead of fp16")
        return {"skipped": int(skipped), "skipped_steps": self.total}
