"""Mixture-of-experts layers in the training run: expert parallelism through DeepSpeed, router losses, balancing.

Expert parallelism (``parallel.ep`` > 1). The experts of each ``GPTMoE`` (zoo.models.moe) are split over the
grid's EP group; ranks of one expert-data-parallel (EDP) group hold the same experts. DeepSpeed reduces such
parameters itself when they are marked as it marks its own MoE parameters: ``param.allreduce = False`` and
``param.group_name = "ep_size_<ep>"`` (the name under which ``zoo.parallel.topology`` registered the grid's EP/EDP
groups in ``deepspeed.utils.groups``), with optimizer groups of their own
(``split_params_into_different_moe_groups_for_optimizer``, which ZeRO-1/2 partition over EDP instead of DP).
DeepSpeed turns its MoE handling on (``engine.has_moe_layers``) only when the model holds its own ``MoE`` class;
:func:`deepspeed_sees_moe` lets it count ``GPTMoE`` as one while the engine is built.

Gradient scale. Each dp rank averages the loss of its own micro-batches, so an expert's correct gradient is
(1/dp) x the sum over all dp ranks of their tokens' contributions. The EP all-to-all's backward already brings
the contributions of the whole EP group to the expert's rank; summed over EDP they cover all dp ranks, so the
sum must be divided by dp, not by the EDP size (which DeepSpeed has done in some releases: ep times too large).
DeepSpeed 0.19.8 divides by dp in every path zoo uses: ZeRO-0 (``DeepSpeedEngine._reduce_expert_gradients``:
the world size of ``groups._get_data_parallel_group()``, i.e. the mpu's DP group, with or without a pipeline) and
ZeRO-1/2 (``average_tensor`` divides the whole bucket by the DP group's size before reducing expert slices over
EDP). :func:`check_expert_gradient_divisor` refuses an engine whose divisor is not dp, and
tests/training/test_moe_layouts.py compares every expert gradient with the single process.

Router losses. ``MoEAuxLossAutoScaler`` seeds the router losses' gradient with ``aux_loss_scale``; it must be what
the engine multiplies the language-model loss by before backward: 1 / gradient_accumulation_steps
(``DeepSpeedEngine.backward`` divides by gas; a pipeline's last stage calls it, earlier stages receive gradients
already scaled), times the fp16 loss scale (``scale_if_loss``), which changes between steps. bf16 and fp32 have none.

Statistics. A forward hook on every ``GPTMoE`` adds up, over the step's micro-batches, its router losses, load and
drops. A layer counts only when it runs with gradients enabled: evaluation runs without, and a checkpointed block
runs once without (its first pass) and once with (the recomputation in backward). After each optimizer step one
all-reduce over all ranks gives every rank the whole step (all dp replicas and pipeline stages): the logged means,
and each layer's load over the global batch, with which every rank holding that layer takes the same
expert-bias step (``moe_expert_bias``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from zoo.models.gpt import GPTBlock
from zoo.models.moe import GPTMoE


def moe_blocks(module: torch.nn.Module) -> list[tuple[int, GPTMoE]]:
    """(layer index, MoE layer) of each block of ``module`` (this rank's pipeline stage) with experts."""
    return [(m.layer_idx, m.mlp) for m in module.modules() if isinstance(m, GPTBlock) and isinstance(m.mlp, GPTMoE)]


def mark_expert_params(module: torch.nn.Module, group_name: str) -> int:
    """Mark the expert-parallel parameters as DeepSpeed marks its MoE parameters; returns how many."""
    count = 0
    for p in module.parameters():
        if getattr(p, "expert_parallel", False):
            p.allreduce, p.group_name = False, group_name
            count += 1
    return count


def split_expert_param_groups(groups: list[dict]) -> list[dict]:
    """The optimizer groups with the experts moved into groups of their own (``moe: True``), as ZeRO-1/2 need."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [{"name": f"group{i}", **g} for i, g in enumerate(groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)


@contextlib.contextmanager
def deepspeed_sees_moe():
    """While ``deepspeed.initialize`` runs: DeepSpeed's engine counts ``GPTMoE`` as one of its ``MoE`` layers, so it
    builds with ``has_moe_layers`` (expert-aware gradient reduction, ZeRO partitions over EDP, expert norms)."""
    from deepspeed.runtime import engine as ds_engine

    original = ds_engine.MoE
    ds_engine.MoE = (original, GPTMoE)  # read by isinstance() in DeepSpeedEngine._configure_distributed_model
    try:
        yield
    finally:
        ds_engine.MoE = original


def check_expert_gradient_divisor(engine, grid) -> None:
    """Refuse an engine that would average expert gradients over other than dp ranks (see the module docstring)."""
    from deepspeed.utils import groups as ds_groups

    if not getattr(engine, "has_moe_layers", False):
        raise RuntimeError("DeepSpeed did not take the model's expert layers as MoE layers; expert gradients would "
                           "be averaged over all data-parallel ranks")
    # ZeRO-0 divides by the first, ZeRO-1/2 by the second (their dp_process_group).
    for divisor in (dist.get_world_size(ds_groups._get_data_parallel_group()), engine.seq_dp_world_size):
        if divisor != grid.dp:
            raise RuntimeError(f"DeepSpeed would divide expert gradients by {divisor}, not by dp {grid.dp}")


class MoETraining:
    """The training loop's side of the MoE layers of one engine: loss scale in, statistics and balancing out."""

    def __init__(self, module: torch.nn.Module, config, grid, gradient_accumulation_steps: int):
        self.grid, self.gas = grid, gradient_accumulation_steps
        self.layers = moe_blocks(module)
        self.layer_ids = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]  # the whole model
        self.num_experts = config.num_experts
        device = next(module.parameters()).device
        # Per local layer: [aux sum, z sum, calls, dropped, assigned, tokens of each expert (E)].
        self.sums = torch.zeros(len(self.layers), 5 + self.num_experts, dtype=torch.float64, device=device)
        for slot, (_, layer) in enumerate(self.layers):
            layer.register_forward_hook(lambda m, args, out, slot=slot: self._record(slot, m))

    @classmethod
    def attach(cls, module, config, grid, gradient_accumulation_steps: int) -> MoETraining | None:
        """The helper for a model with MoE layers (anywhere in it), else None."""
        if not getattr(config, "num_experts", 0):
            return None
        return cls(module, config, grid, gradient_accumulation_steps)

    def _record(self, slot: int, layer: GPTMoE) -> None:
        if not torch.is_grad_enabled():  # evaluation, or a checkpointed block's first pass (it is recomputed)
            return
        s = layer.last_stats
        load = s["tokens_per_expert"].to(torch.float64)
        assigned = load.sum()
        self.sums[slot] += torch.cat([torch.stack([s["aux_loss"].double(), s["z_loss"].double(),
                                                   torch.ones((), dtype=torch.float64, device=load.device),
                                                   s["dropped_fraction"].double() * assigned, assigned]), load])

    def before_step(self, engine, precision: str) -> None:
        """Give every MoE layer the factor the engine applies to the loss before backward (module docstring)."""
        scale = 1.0 / self.gas
        if precision == "fp16":
            scale *= float(engine._get_optimizer_loss_scale() or 1.0)
        for _, layer in self.layers:
            layer.aux_loss_scale = scale

    def after_step(self) -> dict:
        """Collective: reduce the step's statistics over all ranks, step the expert biases, return the metrics."""
        grid, E = self.grid, self.num_experts
        table = torch.zeros(len(self.layer_ids), 5 + E, dtype=torch.float64, device=self.sums.device)
        if grid.tp_rank == 0:  # TP ranks hold the same statistics
            rows = torch.tensor([self.layer_ids.index(i) for i, _ in self.layers], dtype=torch.long,
                                device=self.sums.device)
            local = self.sums.clone()
            if grid.ep_rank != 0:  # load and drops are already summed over the EP group; losses are per rank
                local[:, 3:] = 0
            table.index_add_(0, rows, local)
        self.sums.zero_()
        if dist.is_initialized() and grid.world_size > 1:
            dist.all_reduce(table)
        for i, layer in self.layers:
            if layer.router.expert_bias is not None:
                layer.update_expert_bias(table[self.layer_ids.index(i), 5:])
        aux, z, calls, dropped, assigned = table[:, :5].sum(0).tolist()
        load = table[:, 5:]
        imbalance = (load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-12)).tolist()
        calls = max(calls, 1.0)
        return {"aux_loss": aux / calls, "z_loss": z / calls, "dropped_fraction": dropped / max(assigned, 1.0),
                "expert_load_max_over_mean": max(imbalance),
                **{f"expert_load_max_over_mean_layer{i}": v for i, v in zip(self.layer_ids, imbalance)}}
