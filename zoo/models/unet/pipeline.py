"""U-Net pipelines: compute-balanced stage boundaries (by the FLOPs of the plan), the packing of a stage's output
tuple into one float tensor and a shape header, and the ``PipelineModule`` that does both
(:func:`build_unet_pipeline`)."""

from __future__ import annotations

import math

import torch
from deepspeed.pipe import PipelineModule

from zoo.compat.deepspeed import PipelineModuleWithParts
from zoo.models.unet.config import UNetConfig
from zoo.models.unet.network import CHECKPOINTABLE_LAYERS
from zoo.models.unet.plan import layer_flops


def partition_balanced(costs: list[float], num_stages: int) -> list[int]:
    """Stage boundaries ``parts`` (stage s holds layers ``[parts[s], parts[s+1])``) minimizing the largest stage cost,
    every stage non-empty. Exact (dynamic programming over contiguous splits), O(n^2 p) for n layers."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} pipeline stages; use pp <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: the least max-stage-cost of layers [0, i) in s stages; cut[s][i]: where the last of them starts
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for m in range(s - 1, i):
                value = max(best[s - 1][m], prefix[i] - prefix[m])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, m
    parts, i = [n], n
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        parts.append(i)
    return parts[::-1]


def pipeline_parts(config: UNetConfig, num_stages: int, sizes: tuple[int, int] | None = None) -> list[int]:
    """Stage boundaries balancing forward FLOPs (:func:`layer_flops`) over ``num_stages``."""
    return partition_balanced(layer_flops(config, sizes), num_stages)


def flatten_activations(outputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's output tuple ``(h, [temb,] *skips)`` -> ``(flat [n], shapes [k, 5] int64)``: every tensor
    flattened into one, and per tensor its rank and sizes (padded with 0), so the next stage can cut it back."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    flat = torch.cat([t.reshape(-1) for t in outputs])
    shapes = torch.zeros(len(outputs), 5, dtype=torch.int64)
    for i, t in enumerate(outputs):
        shapes[i, 0] = t.dim()
        shapes[i, 1:1 + t.dim()] = torch.tensor(t.shape)
    return flat, shapes.to(flat.device)


def unflatten_activations(flat: torch.Tensor, shapes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`flatten_activations`: views of ``flat``, so the gradients land in ``flat.grad``."""
    dims = [tuple(row[1:1 + row[0]]) for row in shapes.tolist()]
    sizes = [math.prod(d) for d in dims]
    return tuple(t.view(d) for t, d in zip(torch.split(flat, sizes), dims))


class UNetPipelineModule(PipelineModuleWithParts):
    """DeepSpeed's ``PipelineModule`` with two changes for U-Nets; keys, seeds and layers are the same.

    - Stage boundaries: given ``parts`` (e.g. :func:`pipeline_parts`, balanced by FLOPs), or, with ``parts=None``,
      DeepSpeed's ``partition_method`` ("parameters", "uniform", "type:regex") (``zoo.compat.deepspeed``).
    - Stage outputs travel as ``(flat, shapes)`` (:func:`flatten_activations`): one float tensor and one int64
      header instead of ``(h, temb, *skips)``. DeepSpeed 0.19's engine runs one ``backward`` per float tensor a
      stage sends (with ``retain_graph``), which re-runs the backward of the layers behind every skip and breaks a
      (reentrant) checkpointed last layer with several outputs; with one float tensor it runs once. It also makes
      every received float tensor "used" (a stage that ignores ``temb`` still gives ``flat`` a gradient), and leaves
      a single activation for DeepSpeed's ``pipe_partitioned`` split over TP.
    """

    def forward(self, forward_input):
        if self.stage_start > 0:
            forward_input = unflatten_activations(*forward_input)
        out = super().forward(forward_input)
        if self.stage_stop < self.num_layers:
            out = flatten_activations(out)
        return out


def build_unet_pipeline(config: UNetConfig, specs: list, grid, *, loss_fn, base_seed: int = 1234,
                        partition_method: str = "compute", activation_checkpointing: bool = False) -> PipelineModule:
    """The specs as a :class:`UNetPipelineModule` on ``grid``, seeded and named as ``zoo.models.specs.build_pipeline``
    builds any model (so as ``SpecSequential``). ``partition_method="compute"`` balances :func:`layer_flops`
    (:func:`pipeline_parts`); DeepSpeed's own methods are passed through."""
    from zoo.models.specs import building_pipeline, seed_layer

    compute = partition_method == "compute"
    with building_pipeline():  # DeepSpeed's tied-weight broadcast and stage dump (see there)
        return UNetPipelineModule(
            layers=specs, topology=grid.topology, loss_fn=loss_fn, seed_layers=True, seed_fn=seed_layer,
            base_seed=base_seed, parts=pipeline_parts(config, grid.pp) if compute else None,
            partition_method="uniform" if compute else partition_method,
            activation_checkpoint_interval=1 if activation_checkpointing else 0,
            checkpointable_layers=list(CHECKPOINTABLE_LAYERS) if activation_checkpointing else None)
