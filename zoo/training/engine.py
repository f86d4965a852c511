"""The DeepSpeed engine of a run: the family's layer specs, laid out by one :class:`ParallelOptions`, built into a
module, handed to ``deepspeed.initialize`` with zoo's optimizer groups and LR schedule.

``pp == 1``: the specs are built as one module (``SpecSequential``) and ``deepspeed.initialize(mpu=grid)`` runs
ZeRO 0-3 over the data-parallel group. ``pp > 1``: the same specs become a ``PipelineModule`` (1F1B), ZeRO <= 1.
The loop around the engine is :class:`zoo.training.trainer.Trainer`.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
from pathlib import Path

import torch

from zoo.training.config import RunConfig, deepspeed_config, lora_config
from zoo.training.families import get_family


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (1-D) are not decayed (as Megatron, GPT-2)."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.dim() > 1 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # LoRA trains matrices alone (DoRA adds its magnitude vectors)


def lr_factor(step: int, *, steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): linear warmup, then cosine to ``min_ratio``.

    Step 0 of a warmup of W steps already trains at 1/W of the peak (as Megatron), never at zero.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def prepare_init(cfg: RunConfig, grid) -> Path | None:
    """The zoo model folder to start from: ``training.init_from`` itself, or (HF) its conversion, made once by
    global rank 0 into ``<out>/init-model``; with ``finetune.adapter``, that base with the adapter's tensors."""
    from zoo.convert import io
    from zoo.parallel.shards import barrier

    src = cfg.training.init_from
    if src is None:
        return None
    adapter = cfg.finetune.adapter
    if io.is_model_folder(src) and adapter is None:
        return Path(src)
    folder = Path(cfg.out) / "init-model"
    if grid.rank == 0:
        if adapter is not None:  # the base (imported where HF) with the adapter's tensors: added on it, then trained
            from zoo.convert.peft import write_adapter_folder

            write_adapter_folder(src, adapter, folder)
        else:
            get_family(cfg.model.family).import_folder(src, folder)
    barrier()
    return folder


def compile_blocks(module: torch.nn.Module, names, backend: str = "inductor") -> int:
    """``torch.compile`` the ``forward`` of every block whose class is named in ``names`` (the family's
    checkpointable layers), in place: parameter names, state dicts and checkpoints are unchanged, and the hooks
    DeepSpeed puts on the module (ZeRO-3's parameter gathers) stay outside the graph. Embeddings, heads and the
    loss stay eager (they hold the vocab-parallel collectives). Blocks of equal shapes share one graph
    (``compiled_graphs`` in metrics.jsonl counts them: it stays flat after the first step)."""
    names = set(names)
    blocks = [m for m in module.modules() if type(m).__name__ in names]
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    return len(blocks)


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from zoo.compat.torch import compiled_graph_count

    return compiled_graph_count()


def parallel_options(cfg: RunConfig, grid):
    """How this run lays out every family's layers and loss (a ``zoo.models.gpt.ParallelOptions``), from the grid
    (its groups) and the run config.

    One object for every family: a family reads what applies to it (the validator has refused the rest, e.g. cp > 1
    or fused cross entropy for a family without them). ``fused_cross_entropy`` is a training option, not a layout,
    but it rides here as in the model layer's own ``ParallelOptions``: like the layout it changes how the layers
    compute and never what a checkpoint holds."""
    from zoo.models.gpt import ParallelOptions

    if cfg.parallel.ep != grid.ep or cfg.parallel.ep_spans_tp != grid.ep_spans_tp:
        raise ValueError(f"parallel.ep is {cfg.parallel.ep} (ep_spans_tp {cfg.parallel.ep_spans_tp}) but the grid was "
                         f"built with ep={grid.ep} (ep_spans_tp {grid.ep_spans_tp}); build it with "
                         f"initialize_model_parallel(tp, pp, ep, ep_spans_tp=...)")
    return ParallelOptions(sequence_parallel=cfg.parallel.sequence_parallel, tp_group=grid.tp_group,
                           ep_group=grid.ep_group if grid.ep > 1 else None, ep_spans_tp=grid.ep_spans_tp,
                           cp_group=grid.cp_group if grid.cp > 1 else None, cp_algorithm=cfg.parallel.cp_algorithm,
                           fused_cross_entropy=cfg.training.fused_cross_entropy)


def build_module(cfg: RunConfig, model_cfg, grid, par, loss_fn, init_dir: Path | None):
    """The family's model for this rank (a ``PipelineModule`` stage at pp > 1, else the whole ``SpecSequential``),
    compiled when ``training.compile``, with this rank's slices of ``init_dir``'s weights."""
    from zoo.models.specs import SpecSequential

    family, tr = get_family(cfg.model.family), cfg.training
    specs = family.layer_specs(model_cfg, par)
    if grid.pp > 1:
        module = family.build_pipeline(model_cfg, specs, grid, loss_fn=loss_fn, cfg=cfg)
    else:
        module = SpecSequential(specs, base_seed=tr.seed, checkpointable_layers=family.checkpointable_layers,
                                activation_checkpointing=cfg.parallel.activation_checkpointing)
    if tr.compile:
        compile_blocks(module, family.checkpointable_layers, tr.compile_backend)
    if init_dir is not None:  # this rank's slices of this stage's tensors, before DeepSpeed takes the module
        from zoo.convert.io import load_model

        load_model(init_dir, module, grid.tp_group, par.ep_group)  # EP: its own experts
    lora = lora_config(cfg)
    if lora is not None:  # the base frozen, adapters added (and read back from a folder that holds them)
        add_adapters(module, family, lora, tr.seed, init_dir, grid, par)
    return module


def add_adapters(module, family, lora, seed: int, init_dir: Path | None, grid, par) -> None:
    """``finetune.lora``'s adapters on the built ``module`` (its base weights loaded, now frozen); where ``init_dir``
    holds adapters (a LoRA run's exported model, validated to match), they are read into this rank's shards. At
    pp > 1 the tied embedding, frozen, leaves DeepSpeed's tied-gradient reduction."""
    from zoo.models.lora import adapter_parameters

    family.add_adapters(module, lora, seed)
    if init_dir is not None:
        from zoo.convert import io

        if io.read_adapter(init_dir) is not None:
            io.load_tensors(init_dir, adapter_parameters(module), grid.tp_group, par.ep_group)
    if grid.pp > 1:
        from zoo.compat.deepspeed import skip_frozen_tied_weights

        skip_frozen_tied_weights(module)


def build_engine(cfg: RunConfig, model_cfg, grid, universal: bool = False, init_dir: Path | None = None):
    """``(engine, loss_fn)`` of the run: the family's module and loss laid out by :func:`parallel_options`, in a
    DeepSpeed engine with zoo's parameter groups and LR schedule (``universal``: it will load a checkpoint saved in
    another layout)."""
    import deepspeed

    from zoo.compat import deepspeed as ds_compat
    from zoo.parallel.random import configure_activation_checkpointing, model_parallel_seed
    from zoo.training import moe

    tr = cfg.training
    configure_activation_checkpointing(grid)
    par = parallel_options(cfg, grid)
    expert_parallel = grid.ep > 1
    loss_fn = get_family(cfg.model.family).loss(model_cfg, par)
    module = build_module(cfg, model_cfg, grid, par, loss_fn, init_dir)
    mpu = None if grid.pp > 1 else grid  # a PipelineModule brings its own grid (same topology)
    # Dropout streams, independent of how many layers this rank built; per CP rank too (other tokens).
    model_parallel_seed(tr.seed, grid.tp_rank, grid.cp_rank)
    schedule = partial(lr_factor, steps=tr.steps, warmup_steps=tr.warmup_steps, min_ratio=tr.min_lr / tr.lr)
    # the reduction bucket holds gradients: only what trains (LoRA: the adapters) counts
    ds_config = deepspeed_config(cfg, rank_parameters=sum(p.numel() for p in module.parameters() if p.requires_grad))
    if universal:  # resuming a checkpoint saved in another layout (zoo.training.checkpoint)
        ds_config["checkpoint"] = {"load_universal": True}
    groups = param_groups(module, tr.weight_decay)
    if expert_parallel:  # DeepSpeed's MoE handling: experts reduced and partitioned over their EDP group
        moe.mark_expert_params(module, grid.expert_group_name)
    if getattr(model_cfg, "num_experts", 0):
        groups = moe.split_expert_param_groups(groups, expert_parallel)
    ds_compat.import_muon_with_deferred_compile()  # ~1.6 s less start-up (zoo.compat.deepspeed)
    with moe.deepspeed_sees_moe() if expert_parallel else contextlib.nullcontext():
        engine, *_ = deepspeed.initialize(model=module, model_parameters=groups, config=ds_config, mpu=mpu,
                                          lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    if expert_parallel:
        moe.check_expert_gradient_divisor(engine, grid)
    if cfg.parallel.zero_stage == 0 and tr.precision == "fp32" and tr.grad_clip > 0:
        _clip_fp32_gradients_ourselves(engine, tr.grad_clip, grid)
    return engine, loss_fn


def _clip_fp32_gradients_ourselves(engine, max_norm: float, grid) -> None:
    """DeepSpeed's fp32 clipping miscounts pipeline stages > 0 (see zoo.parallel.grad_norm): the engine clips
    with zoo's norm over every stage instead."""
    from zoo.compat import deepspeed as ds_compat
    from zoo.parallel.grad_norm import clip_grad_norm_

    def clip_fp32_gradients():
        ds_compat.set_global_grad_norm(engine, clip_grad_norm_(engine.module.parameters(), max_norm, grid))

    ds_compat.replace_fp32_clipping(engine, clip_fp32_gradients)


def destroy_engine(engine) -> None:
    """``engine.destroy()``, and drop what keeps a pipeline engine alive after it.

    DeepSpeed's output backward hooks hold the engine, and the last stage's ``engine.loss`` holds those hooks
    through its autograd graph, which Python's garbage collector cannot see into; ZeRO-3 keeps the module it ran
    last in a global stack. Either way the engine, its process groups and their threads would live as long as the
    process, and tests (and sweeps) build many engines in one process (``zoo.compat.deepspeed.release_engine``).
    """
    from zoo.compat.deepspeed import release_engine

    engine.destroy()
    release_engine(engine)
