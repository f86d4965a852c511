"""One model definition, two uses: a list of DeepSpeed layer specs builds the plain module and the pipeline.

``SpecSequential`` builds the specs in one process exactly as ``PipelineModule`` builds its stage: same per-layer
seeds (``base_seed + layer_idx``), same names (``"<layer_idx>.<param>"`` and ``"tied_modules.<key>.<param>"``), same
forward (each layer's output is the next one's input). So a plain and a pipelined model built from the same specs
hold the same weights under the same state-dict keys, and one checkpoint converter serves both.
"""

from __future__ import annotations

import contextlib
import io
from functools import partial

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn


def seed_layer(seed: int) -> None:
    """Seed the generators a layer's initialization draws from (the master weights are built on the CPU)."""
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)


class SpecSequential(nn.Module):
    """The layer specs built in one process, named and seeded as ``PipelineModule`` would."""

    def __init__(self, specs: list, *, base_seed: int = 1234, activation_checkpointing: bool = False,
                 checkpointable_layers: tuple[str, ...] = (), only: int | None = None):
        """``only``: build layer ``only`` alone (the forward runs just it), named as in the whole model: a forward
        streamed one layer at a time (zoo.convert.verify) holds one layer's weights."""
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self._funcs: list = []
        self._checkpointed: list[bool] = []
        for idx, spec in enumerate(specs):
            if only is not None and idx != only:
                continue
            seed_layer(base_seed + idx)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                fn = module if spec.forward_fn is None else partial(spec.forward_fn, module)
            elif isinstance(spec, LayerSpec):
                module = fn = spec.build()
                self.add_module(str(idx), module)
            elif isinstance(spec, nn.Module):
                module = fn = spec
                self.add_module(str(idx), module)
            else:
                module, fn = None, spec
            self._funcs.append(fn)
            self._checkpointed.append(activation_checkpointing and type(module).__name__ in checkpointable_layers)

    def forward(self, x):
        from zoo.parallel.random import checkpoint

        for fn, ckpt in zip(self._funcs, self._checkpointed):
            if ckpt and torch.is_grad_enabled():
                # As PipelineModule: the checkpoint function takes the tuple's elements as arguments.
                args = x if isinstance(x, tuple) else (x,)
                x = checkpoint(lambda *a, fn=fn: fn(a[0] if len(a) == 1 else a), *args)
            else:
                x = fn(x)
        return x


@contextlib.contextmanager
def building_pipeline():
    """Around the building of a DeepSpeed ``PipelineModule`` (and the loading of its layer files): no autograd and
    no stdout, for two things DeepSpeed does there that every pp > 1 run printed.

    - ``PipelineModule._synchronize_tied_weights`` broadcasts each tied weight (the embedding the first and last
      stages share) from the first stage's rank, in place, with autograd on. ``c10d::broadcast_`` has no autograd
      kernel, so torch records the in-place op and warns at the first backward, on every rank, that this "may lead
      to silently incorrect behavior". It is harmless here: the broadcast only makes both stages start from the
      same weight, no gradient is meant to flow through it (the weight stays a leaf and gets exactly its own
      gradient; DeepSpeed then all-reduces the tied gradients over the stages), and the pipelined runs train the
      same losses as the plain model (tests/parallel/test_pipeline.py). Without autograd the copy is not recorded.
    - Rank 0 prints the seed settings, the topology and every stage's layer names (``print``, not DeepSpeed's
      logger); zoo's first line says the layout.
    """
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        yield


def build_pipeline(specs: list, grid, *, loss_fn, base_seed: int = 1234, partition_method: str = "parameters",
                   activation_checkpointing: bool = False,
                   checkpointable_layers: tuple[str, ...] = ()) -> PipelineModule:
    """The same specs as a DeepSpeed ``PipelineModule`` on ``grid``'s topology, 1F1B schedule."""
    with building_pipeline():
        return PipelineModule(
            layers=specs,
            topology=grid.topology,
            loss_fn=loss_fn,
            seed_layers=True,
            seed_fn=seed_layer,
            base_seed=base_seed,
            partition_method=partition_method,
            activation_checkpoint_interval=1 if activation_checkpointing else 0,
            checkpointable_layers=list(checkpointable_layers) if activation_checkpointing else None,
        )
