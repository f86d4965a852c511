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
With context parallelism every rank's gradient is cp times its share (``GPTLoss``; the router losses' seed too,
``GPTMoE``), the EDP groups include the CP ranks, and the divisor is DeepSpeed's data-parallel size dp x cp.
DeepSpeed 0.19.8 divides by its data-parallel size in every path zoo uses: ZeRO-0
(``DeepSpeedEngine._reduce_expert_gradients``: the world size of ``groups._get_data_parallel_group()``, i.e. the
mpu's DP group, with or without a pipeline) and ZeRO-1/2 (``average_tensor`` divides the whole bucket by the DP
group's size before reducing expert slices over EDP). :func:`check_expert_gradient_divisor` refuses an engine
whose divisor is not that, and tests/training/test_moe_layouts.py compares every expert gradient with the single
process.

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
import re
import shutil

import torch
import torch.distributed as dist

from zoo.compat import deepspeed as ds_compat
from zoo.models.gpt import GPTBlock
from zoo.models.moe import GPTMoE
from zoo.parallel.shards import full_tensor


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


def split_expert_param_groups(groups: list[dict], expert_parallel: bool = True) -> list[dict]:
    """The optimizer groups with the experts moved into groups of their own, after the others in the order of
    the groups they came from: DeepSpeed's MoE groups (``moe: True``, partitioned over EDP by ZeRO-1/2) at ep > 1;
    plain groups at ep 1. Every ep then has the same groups, which a checkpoint resumed at another ep needs (the
    optimizer's groups and the LR schedule's lambdas are restored group by group)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [{"name": f"group{i}", **g} for i, g in enumerate(groups)]
    if expert_parallel:
        return split_params_into_different_moe_groups_for_optimizer(named)
    experts = []
    for group in named:
        mine = [p for p in group["params"] if getattr(p, "expert_parallel", False)]
        group["params"] = [p for p in group["params"] if not getattr(p, "expert_parallel", False)]
        if mine:
            experts.append({**group, "params": mine})
    return named + experts


def deepspeed_sees_moe():
    """While ``deepspeed.initialize`` runs: DeepSpeed's engine counts ``GPTMoE`` as one of its ``MoE`` layers, so it
    builds with ``has_moe_layers`` (expert-aware gradient reduction, ZeRO partitions over EDP, expert norms)."""
    return ds_compat.engine_counts_as_moe(GPTMoE)


def check_expert_gradient_divisor(engine, grid) -> None:
    """Refuse an engine that would average expert gradients over other than dp ranks (see the module docstring)."""
    if not getattr(engine, "has_moe_layers", False):
        raise RuntimeError("DeepSpeed did not take the model's expert layers as MoE layers; expert gradients would "
                           "be averaged over all data-parallel ranks")
    # ZeRO-0 divides by the first, ZeRO-1/2 by the second (their dp_process_group); DeepSpeed's dp is dp x cp.
    for divisor in (dist.get_world_size(ds_compat.data_parallel_group()), engine.seq_dp_world_size):
        if divisor != grid.dp * grid.cp:
            raise RuntimeError(f"DeepSpeed would divide expert gradients by {divisor}, not by dp x cp "
                               f"{grid.dp * grid.cp}")


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
            scale *= float(ds_compat.optimizer_loss_scale(engine) or 1.0)
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
            if grid.ep_rank != 0 or grid.cp_rank != 0:  # load and drops: already summed over EP and CP
                local[:, 3:] = 0  # (losses are per rank; CP ranks hold the same values)
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


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints of expert-parallel runs
# ---------------------------------------------------------------------------------------------------------------
#
# DeepSpeed sends the save and load of an engine with MoE layers through its own MoE checkpoint code, which knows
# only its own MoE classes (per-expert modules, ``deepspeed_moe.experts.deepspeed_experts.<j>`` names); zoo's
# experts are fused [E/ep, ...] tensors. So at ep > 1 DeepSpeed saves and loads as for a dense model
# (:func:`checkpoint_as_dense`): its files then hold everything but the experts of EP ranks other than 0, which are
# written by zoo beside them, layout-free (:func:`save_expert_states`): per pipeline stage one safetensors file
# ``zoo_experts_pp<stage>.safetensors`` with, for every expert parameter (name as in the pipeline module, so the
# same at any pp), the whole [E, ...] fp32 master weight and Adam's ``exp_avg``/``exp_avg_sq``, gathered over the
# EP group. ZeRO-1/2 keep these partitioned over the expert-data-parallel ranks; DeepSpeed's tensor-fragment API
# assembles and scatters them. :func:`load_expert_states` puts each rank's slice back after DeepSpeed has loaded
# the rest, and :func:`patch_universal` writes them whole into a universal checkpoint made from such a folder, so
# the run resumes at any ep, tp, pp and dp.

EXPERT_FILE = "zoo_experts_pp{:02d}.safetensors"
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def checkpoint_as_dense(engine):
    """While DeepSpeed saves or loads: it takes the engine for one without MoE layers (see above)."""
    return ds_compat.moe_layers_hidden(engine)


def expert_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of this stage's expert weights, in the same order on every rank of the stage."""
    return [(n, p) for n, p in module.named_parameters() if getattr(p, "expert_parallel", False)]


def link_optimizer_states(engine) -> None:
    """Point every parameter's tensor fragment at its optimizer states. DeepSpeed links them after its first step,
    but its fragments can lose them afterwards (found empty at a later save), so zoo links them right before use."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    opt = engine.optimizer
    for lp_name, flat_name in (("bit16_groups", "single_partition_of_fp32_groups"),  # ZeRO-1/2
                               ("bf16_groups", "fp32_groups_flat_partition")):  # DeepSpeed's bf16 optimizer
        lp_groups, flats = getattr(opt, lp_name, None), getattr(opt, flat_name, None)
        if lp_groups is None or flats is None:
            continue
        for lp, flat in zip(lp_groups, flats):
            if flat in opt.optimizer.state:
                lazy_init_hp_params_optimizer_state(lp, flat, opt.optimizer.state)


def _optimizer_state(engine, param, key: str | None) -> torch.Tensor:
    """This rank's whole fp32 master weight (key None) or Adam state of ``param``. Collective over the param's
    ZeRO partition group under ZeRO-1/2 (DeepSpeed's tensor fragments); local without ZeRO."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if ds_compat.has_tensor_fragment(param):
        value = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
    elif key is None:
        value = param.data
    else:
        value = engine.optimizer.state[param][key]
    return value.detach().float().reshape(param.shape)


def _set_optimizer_state(engine, param, key: str | None, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    value = value.to(param.device)
    if key is None:
        param.data.copy_(value.to(param.dtype))
        if ds_compat.has_tensor_fragment(param):
            safe_set_full_fp32_param(param, value)
    elif ds_compat.has_tensor_fragment(param):
        safe_set_full_optimizer_state(param, value, key)
    else:
        engine.optimizer.state[param][key].copy_(value)


def save_expert_states(engine, grid, folder) -> None:
    """Collective: write this stage's expert weights and Adam states, whole, into ``folder`` (see above)."""
    from pathlib import Path

    from safetensors.torch import save_file

    link_optimizer_states(engine)
    tensors = {}
    for name, param in expert_parameters(engine.module):
        for key in (None, *ADAM_STATES):
            whole = full_tensor(_optimizer_state(engine, param, key), 0, 1, grid.ep_group)  # [E/ep] -> [E]
            tensors[name if key is None else f"{name}/{key}"] = whole.cpu().contiguous()
    if tensors and grid.ep_rank == 0 and grid.edp_rank == 0 and grid.tp_rank == 0 and grid.cp_rank == 0:
        path = Path(folder) / EXPERT_FILE.format(grid.pp_rank)
        try:
            save_file(tensors, str(path))
        except OSError:
            raise
        except Exception as e:  # safetensors' own error type for a failed write: the checkpoint's save stops on it
            raise OSError(f"{path}: {e}") from e


def expert_files(folder) -> dict[str, str]:
    """Tensor name -> file, over the expert files of a checkpoint folder (all stages)."""
    from pathlib import Path

    from safetensors import safe_open

    where = {}
    for path in sorted(Path(folder).glob(EXPERT_FILE.replace("{:02d}", "*"))):
        with safe_open(str(path), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), str(path)))
    return where


def load_expert_states(engine, grid, folder) -> int:
    """Put this rank's experts (weights and Adam states) back from ``folder``'s expert files, after DeepSpeed has
    loaded the rest; returns how many parameters were set (0: the folder has no expert files)."""
    from safetensors import safe_open

    where = expert_files(folder)
    if not where:
        return 0
    link_optimizer_states(engine)
    count = 0
    for name, param in expert_parameters(engine.module):
        if name not in where:
            raise ValueError(f"{folder}: the expert files hold no {name!r}; the checkpoint is of another model")
        local = param.shape[0]
        begin = grid.ep_rank * local
        with safe_open(where[name], framework="pt") as f:
            for key in (None, *ADAM_STATES):
                tensor_slice = f.get_slice(name if key is None else f"{name}/{key}")
                if tensor_slice.get_shape()[0] != local * grid.ep:
                    raise ValueError(f"{folder}: {name} holds {tensor_slice.get_shape()[0]} experts, this model "
                                     f"{local * grid.ep}")
                _set_optimizer_state(engine, param, key, tensor_slice[begin:begin + local])
        count += 1
    return count


EXPERT_NAME = re.compile(r"\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")  # GroupedExperts' parameters


@contextlib.contextmanager
def universal_without_experts(folder):
    """While ``ds_to_universal`` converts ``folder``: it leaves out the experts of an ep > 1 checkpoint (their ZeRO
    fragments are partitions over the expert-data-parallel ranks, which it would merge as if over all of dp);
    :func:`patch_universal` writes them whole. A checkpoint of ep 1 converts as any other."""
    names = {name for name in expert_files(folder) if "/" not in name}
    if not names:
        yield
        return

    def without_expert_patterns(uc_info, kept):
        # Its strict mode fails on a pattern that matches nothing it merges: drop those that only named experts.
        return {key: [p for p in value if not any(re.match(p, n) for n in names) or
                      any(re.match(p, n) for n in kept)] if isinstance(value, list) else value
                for key, value in uc_info.items()}

    with ds_compat.universal_merge_leaving_out(names, without_expert_patterns):
        yield


def patch_universal(folder, universal_folder) -> int:
    """Make the experts of a universal checkpoint converted from ``folder`` loadable at any ep; returns how many
    expert parameters it touched.

    DeepSpeed's universal format holds ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, each ``{"param": tensor,
    ...}``; an entry marked ``is_expert_param`` with ``ep_num_experts`` is cut along dim 0 by the loading rank's EP
    rank (its ``load_hp_checkpoint_state``). The whole tensors of an ep > 1 checkpoint come from zoo's expert files;
    those of an ep 1 checkpoint are DeepSpeed's own and only gain the marks."""
    from pathlib import Path

    from safetensors import safe_open

    zero = Path(universal_folder) / "zero"
    stored = expert_files(folder)
    # ds_to_universal leaves a folder for an expert it skipped at some pipeline layouts only: the names come from
    # zoo's files as well as from its folders.
    names = sorted({p.name for p in zero.iterdir() if EXPERT_NAME.search(p.name)} |
                   {name for name in stored if "/" not in name}) if zero.is_dir() else []
    step = next((p / "step.pt" for p in sorted(zero.iterdir()) if (p / "step.pt").is_file()), None) if names else None
    for name in names:
        for key in ("fp32", *ADAM_STATES):
            target = zero / name / f"{key}.pt"
            whole = f"{name}/{key}" if key != "fp32" else name
            if whole in stored:
                with safe_open(stored[whole], framework="pt") as f:
                    entry = {"param": f.get_tensor(whole)}
            elif target.is_file():
                entry = torch.load(target, weights_only=False)  # ds_to_universal's, from this run's own files
            else:
                raise ValueError(f"{universal_folder}: no {key} state of {name}")
            entry.update(is_expert_param=True, ep_num_experts=entry["param"].shape[0])
            target.parent.mkdir(parents=True, exist_ok=True)
            torch.save(entry, target)
        if not (zero / name / "step.pt").is_file() and step is not None:
            shutil.copy2(step, zero / name / "step.pt")
    return len(names)
