"""The training run: validated config -> grid -> model from layer specs -> DeepSpeed engine -> loop -> metrics.

``pp == 1``: the specs are built as one module (``SpecSequential``) and ``deepspeed.initialize(mpu=grid)`` runs
ZeRO 0-3 over the data-parallel group. ``pp > 1``: the same specs become a ``PipelineModule`` (1F1B), ZeRO <= 1.
Either way the logged loss of a step is the mean over its micro-batches and data-parallel replicas, so it is the
same number in every layout.

Context parallelism (``parallel.cp``, GPT): the cp ranks of a replica read the same micro-batches (the true dp rank
and size pick the samples) and each feeds the engine its share of every sequence, inputs and shifted labels alike
(:func:`local_micro_batch`); every cp rank's loss is the whole sequence's, so the logged loss is reduced over the
true replicas only. DeepSpeed's data-parallel group is dp x cp (``zoo.parallel.topology``): it averages gradients and
partitions ZeRO there, and its ``train_batch_size`` is zoo's global batch x cp. Tokens/s counts each token once;
TFLOP/s per device divides the step's FLOPs by the whole world.

Entry point: ``launch/train.py`` (one process, ``torchrun`` or the ``deepspeed`` launcher).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from zoo.data.batches import context_parallel_share, micro_batch, to_device
from zoo.package import config_file
from zoo.training.config import ConfigError, RunConfig, deepspeed_config, load, validate
from zoo.training.families import Data, get_family
from zoo.training.run import (RunParser, command, init_without_tokenizer, layout_line, loss_change, process_group, say,
                              start_run, train_and_save)

DEFAULT_CONFIG = config_file("gpt/main.yaml")


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (1-D) are not decayed (as Megatron, GPT-2)."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.dim() > 1 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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
    global rank 0 into ``<out>/init-model``."""
    from zoo.convert import io
    from zoo.parallel.shards import barrier

    src = cfg.training.init_from
    if src is None:
        return None
    if io.is_model_folder(src):
        return Path(src)
    folder = Path(cfg.out) / "init-model"
    if grid.rank == 0:
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


def build_engine(cfg: RunConfig, model_cfg, grid, universal: bool = False, init_dir: Path | None = None):
    import deepspeed

    from zoo.compat import deepspeed as ds_compat
    from zoo.models.specs import SpecSequential
    from zoo.parallel.grad_norm import clip_grad_norm_
    from zoo.parallel.random import configure_activation_checkpointing, model_parallel_seed
    from zoo.training import moe
    from zoo.training.families import get_family

    par, tr = cfg.parallel, cfg.training
    family = get_family(cfg.model.family)
    configure_activation_checkpointing(grid)
    if par.ep != grid.ep or par.ep_spans_tp != grid.ep_spans_tp:
        raise ValueError(f"parallel.ep is {par.ep} (ep_spans_tp {par.ep_spans_tp}) but the grid was built with "
                         f"ep={grid.ep} (ep_spans_tp {grid.ep_spans_tp}); build it with "
                         f"initialize_model_parallel(tp, pp, ep, ep_spans_tp=...)")
    expert_parallel = grid.ep > 1
    # Context parallelism (GPT only, config.validate_context_parallel): the layers and the loss get the CP group.
    context = {"cp_group": grid.cp_group, "cp_algorithm": par.cp_algorithm} if grid.cp > 1 else {}
    specs = family.layer_specs(model_cfg, par.sequence_parallel, **context,
                               **({"ep_group": grid.ep_group} if expert_parallel else {}),
                               **({"ep_spans_tp": True} if grid.ep_spans_tp else {}),
                               **({"fused_cross_entropy": True} if tr.fused_cross_entropy else {}))
    loss_fn = family.loss(model_cfg, **({"cp_group": grid.cp_group} if grid.cp > 1 else {}))
    if grid.pp > 1:
        module = family.build_pipeline(model_cfg, specs, grid, loss_fn=loss_fn, cfg=cfg)
        mpu = None  # the PipelineModule brings its own grid (same topology)
    else:
        module = SpecSequential(specs, base_seed=tr.seed, activation_checkpointing=par.activation_checkpointing,
                                checkpointable_layers=family.checkpointable_layers)
        mpu = grid
    if tr.compile:
        compile_blocks(module, family.checkpointable_layers, tr.compile_backend)
    if init_dir is not None:  # this rank's slices of this stage's tensors, before DeepSpeed takes the module
        from zoo.convert.io import load_model

        load_model(init_dir, module, grid.tp_group, grid.ep_group if expert_parallel else None)  # EP: own experts
    # Dropout streams, independent of how many layers this rank built; per CP rank too (other tokens).
    model_parallel_seed(tr.seed, grid.tp_rank, grid.cp_rank)
    schedule = partial(lr_factor, steps=tr.steps, warmup_steps=tr.warmup_steps, min_ratio=tr.min_lr / tr.lr)
    ds_config = deepspeed_config(cfg, rank_parameters=sum(p.numel() for p in module.parameters()))
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
    if par.zero_stage == 0 and tr.precision == "fp32" and tr.grad_clip > 0:
        # DeepSpeed's fp32 clipping miscounts pipeline stages > 0 (see zoo.parallel.grad_norm).
        def clip_fp32_gradients():
            ds_compat.set_global_grad_norm(engine, clip_grad_norm_(engine.module.parameters(), tr.grad_clip, grid))

        ds_compat.replace_fp32_clipping(engine, clip_fp32_gradients)
    return engine, loss_fn


def start_ema(engine, cfg: RunConfig, grid, resume, log):
    """The run's weight average (``training.ema_decay``; None without): the resumed checkpoint's, read in this
    layout, or the weights as they start."""
    from zoo.convert.io import is_model_folder
    from zoo.training.checkpoint import EMA_FOLDER
    from zoo.training.ema import EMA

    if not cfg.training.ema_decay:
        return None
    ema = EMA(engine.module, cfg.training.ema_decay)
    if resume is not None:
        saved = resume.root / resume.tag / EMA_FOLDER
        if is_model_folder(saved):
            ema.load(saved, grid)
        elif grid.rank == 0:
            log(f"{resume.root / resume.tag} holds no weight average (saved without training.ema_decay): the "
                f"average starts from the resumed weights")
    return ema


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


class MetricsWriter:
    """One JSON object per line in ``out/metrics.jsonl`` and the same scalars to the loggers the run config names
    (``training.loggers``: TensorBoard in ``out/tb``, Weights & Biases; zoo.training.loggers), global rank 0 only.

    Resuming at step N keeps the records up to N and appends after them, so the file always tells one history.
    In memory it keeps only what the loss plot needs (step, loss, val_loss), so a long run does not grow.
    """

    PLOTTED = ("step", "loss", "val_loss")

    def __init__(self, out: Path, enabled: bool, resume_step: int | None = None, cfg: RunConfig | None = None):
        self.enabled, self.path, self.loggers = enabled, out / "metrics.jsonl", []
        self.records: list[dict] = []
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if record.get("step", 0) <= resume_step:
                    kept.append(record)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self.records = [self._plotted(r) for r in kept]
        self.f = open(self.path, "a")
        from zoo.training.loggers import open_loggers

        self.loggers = open_loggers(cfg or RunConfig(out=str(out)), out, resume_step)

    def write(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        self.records.append(self._plotted(record))
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        for logger in self.loggers:
            logger.scalars(record, prefix)

    def image(self, key: str, path: Path | None, step: int) -> None:
        """A picture the run drew (a PNG file) at ``step``, for the loggers that show pictures."""
        if self.enabled and path is not None:
            for logger in self.loggers:
                logger.image(key, path, step)

    @classmethod
    def _plotted(cls, record: dict) -> dict:
        return {key: record[key] for key in cls.PLOTTED if key in record}

    def close(self):
        if self.enabled:
            self.f.close()
            for logger in self.loggers:
                logger.close()


def plot_losses(records: list[dict], path: Path, ylabel: str = "cross entropy (nats/token)") -> Path | None:
    """The loss curve (training per step, validation per evaluation) as a PNG; ``ylabel`` says what the loss is
    (the family's ``loss_label``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    valid = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train and not valid:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.13, top=0.96)  # fixed margins: tight_layout costs 0.1 s
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation", linewidth=1.5, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path)
    plt.close(fig)
    return path


def build_data(cfg: RunConfig, model_cfg, grid) -> Data:
    """The family's training and validation data (zoo.training.families)."""
    from zoo.training.families import get_family

    return get_family(cfg.model.family).build_data(cfg, model_cfg, grid)


def reduced_stats(loss_fn, family) -> dict:
    """The loss object's running sums since the last call, summed over all ranks, as the family's metrics.

    Collective (every rank calls it). Ranks that computed nothing (pipeline stages before the last) add zeros; TP
    ranks add identical sums, so families derive ratios, which that uniform repetition does not change.
    """
    if not hasattr(loss_fn, "stats"):
        return {}
    from deepspeed.accelerator import get_accelerator

    stats = loss_fn.stats()
    keys = sorted(stats)
    t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64,
                     device=get_accelerator().current_device_name())
    if dist.is_initialized():
        dist.all_reduce(t)
    return family.derive_metrics(dict(zip(keys, t.tolist())))


def local_micro_batch(dataset, step: int, micro: int, cfg: RunConfig, grid, device):
    """Micro-batch ``micro`` of step ``step`` as this rank feeds it to the engine: the true data-parallel rank's
    samples (every CP rank of a replica reads the same ones), then this CP rank's share of each sequence."""
    batch = micro_batch(dataset, step, micro, micro_batch_size=cfg.training.micro_batch_size,
                        accumulation=cfg.gradient_accumulation_steps, dp_rank=grid.dp_rank, dp=grid.dp)
    return to_device(context_parallel_share(batch, grid.cp_rank, grid.cp, cfg.parallel.cp_algorithm), device)


def evaluate(engine, loss_fn, cfg: RunConfig, grid, dataset, device) -> float:
    """Mean loss over ``eval_iters`` global batches of the validation set (the same samples every time)."""
    tr, gas = cfg.training, cfg.gradient_accumulation_steps
    total = 0.0
    for it in range(tr.eval_iters):
        batches = [local_micro_batch(dataset, it, m, cfg, grid, device) for m in range(gas)]
        if grid.pp > 1:
            total += float(engine.eval_batch(data_iter=iter(batches)))  # averaged over micro-batches and DP
            continue
        engine.eval()
        with torch.no_grad():
            loss = sum(loss_fn(engine(ids), labels).float() for ids, labels in batches) / gas
        engine.train()
        if grid.dp > 1:  # over the true replicas: every CP rank holds the whole sequence's loss already
            dist.all_reduce(loss, group=grid.dp_group)
            loss /= grid.dp
        total += float(loss)
    return total / tr.eval_iters


@dataclass
class RunResult:
    losses: list  # training loss of each step run here (on every rank)
    val_losses: list  # (step, val_loss) of each evaluation
    start_step: int
    engine: object = None
    memory: dict | None = None  # the first step's measured bytes, lists by rank (zoo.training.memory)
    metrics: object = None  # with keep_metrics: the open MetricsWriter (the caller logs end pictures, closes it)
    ema: object = None  # with keep_engine and training.ema_decay: the weight average (zoo.training.ema.EMA)


def train(cfg: RunConfig, model_cfg, grid, log=print, *, resume=None, universal: bool = False,
          data: Data | None = None, keep_engine: bool = False, progress: bool = False,
          keep_metrics: bool = False) -> list[float] | RunResult:
    """Run from step 0 (or the checkpoint ``resume``) to ``cfg.training.steps``.

    Returns the per-step losses (on every rank), or a ``RunResult`` with the engine still alive when
    ``keep_engine`` (the caller exports the model and calls ``destroy_engine(engine)``). The first step run here is
    measured (``zoo.training.memory``): its record in metrics.jsonl holds ``memory_bytes``, ``RunResult.memory``
    the same, and global rank 0 logs a summary line at the end.
    """
    from deepspeed.accelerator import get_accelerator

    from zoo.training import checkpoint as ckpt
    from zoo.parallel.comm_count import CommCounter
    from zoo.training import memory as mem
    from zoo.training.metrics import device_name, peak_memory_gb, peak_tflops, resident_memory_gb
    from zoo.training.moe import MoETraining
    from zoo.training.nonfinite import NonFiniteSteps
    from zoo.training.signals import ExitRequest, collectives_guarded

    tr = cfg.training
    family = get_family(cfg.model.family)
    out = Path(cfg.out)
    data = data or build_data(cfg, model_cfg, grid)
    init_dir = prepare_init(cfg, grid) if resume is None else None  # a resumed run has its own weights
    engine, loss_fn = build_engine(cfg, model_cfg, grid, universal=resume is not None and universal,
                                   init_dir=init_dir)
    moe = MoETraining.attach(engine.module, model_cfg, grid, cfg.gradient_accumulation_steps)
    nonfinite = NonFiniteSteps(engine, grid, precision=tr.precision, zero_stage=cfg.parallel.zero_stage,
                               grad_clip=tr.grad_clip, max_in_a_row=tr.max_skipped_steps)
    device = get_accelerator().current_device_name()
    gas = cfg.gradient_accumulation_steps
    start = 0
    if resume is not None:
        ckpt.load_checkpoint(engine, resume, universal=universal, cp_rank=grid.cp_rank, grid=grid)
        start = resume.step
        if grid.rank == 0:
            how = " (universal checkpoint: new layout)" if universal else ""
            log(f"resumed from {resume.root / resume.tag} at step {start}{how}")
    ema = start_ema(engine, cfg, grid, resume, log)

    def batches(step):
        for m in range(gas):
            yield local_micro_batch(data.train, step, m, cfg, grid, device)

    metrics = MetricsWriter(out, grid.rank == 0, resume_step=start if resume is not None else None, cfg=cfg)
    meta = {"layout": {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp, "ep": grid.ep, "ep_spans_tp": grid.ep_spans_tp,
                       "zero_stage": cfg.parallel.zero_stage, "cp": grid.cp},
            "global_batch_size": cfg.global_batch_size, "seq_length": tr.seq_length,
            "model": model_cfg.to_dict(), "tokenizer": data.tokenizer_dir}

    def save(step):
        client_state = {"iteration": step, "universal_checkpoint_info": family.universal_checkpoint_info(model_cfg)}
        path = ckpt.save_checkpoint(engine, out / ckpt.CHECKPOINTS, step, meta, client_state,
                                    keep_last=tr.keep_last or None, cp_group=grid.cp_group, grid=grid,
                                    ema=None if ema is None else partial(ema.save, grid=grid, family=cfg.model.family,
                                                                         config=model_cfg.to_dict()))
        if grid.rank == 0:
            log(f"saved checkpoint {path}")

    val_losses = []

    def run_eval(step):
        if data.valid is None or not tr.eval_interval:
            return
        reduced_stats(loss_fn, family)  # drop sums left from training steps
        val = evaluate(engine, loss_fn, cfg, grid, data.valid, device)
        val_losses.append((step, val))
        extra = {f"val_{k}": v for k, v in reduced_stats(loss_fn, family).items()}
        record = {"step": step, "val_loss": val, **({"val_ppl": math.exp(min(val, 50.0))} if family.unit == "tokens"
                                                    else {}), **extra}
        if data.bytes_per_token:  # nats per token -> bits per byte of text
            record["val_bpb"] = val / math.log(2) / data.bytes_per_token
        metrics.write(record, prefix="val")
        picture = family.after_evaluation(engine, cfg, grid, data, step)  # collective: e.g. a U-Net's mask grid
        metrics.image("val/predictions", picture, step)
        if grid.rank == 0:
            names = {"val_ppl": "perplexity"}
            shown = " | ".join(f"{names.get(k, k.removeprefix('val_'))} {v:.4g}" for k, v in record.items()
                               if k not in ("step", "val_loss"))
            log(f"step {step}/{tr.steps} | validation loss {val:.4f}" + (f" | {shown}" if shown else ""))

    units_per_step = cfg.global_batch_size * family.units_per_sample(cfg)
    flops_per_sample = family.training_flops_per_sample(cfg, model_cfg)
    flops_per_step = None if flops_per_sample is None else cfg.global_batch_size * flops_per_sample
    peak = peak_tflops(device_name(), tr.precision)
    losses, t_start = [], time.perf_counter()
    first_step, memory_bytes = mem.FirstStep(engine, ema), None
    bar = None
    if progress and grid.rank == 0 and start < tr.steps:
        from zoo.progress import progress_bar

        bar = progress_bar(total=tr.steps, initial=start, desc="train", unit="step", mininterval=1.0)
        log = bar.write  # on a terminal above the bar, in a log file plain lines (zoo.progress)
    if start == 0:
        run_eval(0)
    step = start
    with ExitRequest() as exit_request, collectives_guarded(grid, lambda: step + 1, tr.collective_timeout_minutes), \
            bar if bar is not None else contextlib.nullcontext(), \
            CommCounter(grid) as comm:  # bar: lines printed go above it; closed on an error too
        for step in range(start, tr.steps):
            t0 = time.perf_counter()
            lr = engine.get_lr()[0]  # the rate this step uses
            if moe is not None:
                moe.before_step(engine, tr.precision)
            with first_step.measuring() if step == start else contextlib.nullcontext():
                if grid.pp > 1:
                    loss = engine.train_batch(data_iter=batches(step))
                else:
                    total = torch.zeros((), device=device)
                    for ids, labels in batches(step):
                        micro_loss = loss_fn(engine(ids), labels)
                        engine.backward(micro_loss)
                        engine.step()
                        total += micro_loss.detach().float()
                    loss = total / gas
                    if grid.dp > 1:
                        dist.all_reduce(loss, group=grid.dp_group)
                        loss /= grid.dp
            if ema is not None:
                ema.update(step + 1)
            loss = float(loss)
            dt = time.perf_counter() - t0
            if step == start:
                memory_bytes = first_step.gather()
            comm_bytes, comm_calls = comm.take()
            losses.append(loss)
            grad_norm = engine.get_global_grad_norm()
            tflops = None if flops_per_step is None else flops_per_step / dt / grid.world_size / 1e12
            rate = units_per_step / dt
            record = {"step": step + 1, "loss": loss, "lr": lr,
                      "grad_norm": None if grad_norm is None else float(grad_norm),
                      f"{family.unit}_per_s": rate, "tflops_per_device": tflops,
                      "mfu": None if peak is None or tflops is None else tflops / peak,
                      "peak_memory_gb": peak_memory_gb(), "rss_gb": resident_memory_gb(), "step_time_s": dt,
                      "comm_bytes": comm_bytes, "comm_calls": comm_calls,
                      **({"compiled_graphs": compiled_graphs()} if tr.compile else {}),
                      **reduced_stats(loss_fn, family),
                      **(moe.after_step() if moe is not None else {}),
                      **nonfinite.after_step(step + 1, loss, out / ckpt.CHECKPOINTS),
                      **({"memory_bytes": memory_bytes} if step == start else {})}
            metrics.write(record)
            if record["skipped"] and grid.rank == 0:
                log(f"step {step + 1}: loss {loss:.4g}, gradients not finite on some rank: skipped on every rank "
                    f"(weights unchanged; {nonfinite.in_a_row} in a row, {nonfinite.total} in all)")
            done = step + 1
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
                bar.update(1)
            if grid.rank == 0 and (done % tr.log_interval == 0 or done == tr.steps):
                elapsed = time.perf_counter() - t_start
                eta = elapsed / (done - start) * (tr.steps - done)
                speed = f"{rate:.0f} {'tok' if family.unit == 'tokens' else 'samples'}/s"
                flops = "" if tflops is None else f" | {tflops:.3f} TFLOP/s/device"
                log(f"step {done}/{tr.steps} | loss {loss:.4f} | lr {record['lr']:.2e} | {speed}{flops} | "
                    f"ETA {eta:.0f}s")
            if tr.eval_interval and (done % tr.eval_interval == 0 or done == tr.steps):
                run_eval(done)
            leave = exit_request.agreed(device)
            if tr.save and ((tr.save_interval and done % tr.save_interval == 0) or done == tr.steps or leave):
                save(done)
            if leave:
                if grid.rank == 0:
                    said = (f"checkpoint of step {done} saved in {out / ckpt.CHECKPOINTS}; the same command (or "
                            f"--load {out}) continues from it" if tr.save else
                            f"stopped after step {done} (training.save is false: no checkpoint)")
                    log(f"{exit_request.name} received: {said}")
                break
    if bar is not None:
        bar.close()
    if grid.rank == 0 and memory_bytes is not None:
        log(mem.summary(memory_bytes))
    if grid.rank == 0 and metrics.records:
        metrics.image("loss_curve", plot_losses(metrics.records, out / "loss.png", family.loss_label(cfg)),
                      metrics.records[-1]["step"])
    if not (keep_engine and keep_metrics):
        metrics.close()
    if keep_engine:
        return RunResult(losses, val_losses, start, engine, memory_bytes, metrics if keep_metrics else None, ema)
    destroy_engine(engine)  # frees DeepSpeed's hooks and buffers; tests train many engines in one process
    return losses


def parse_args(argv=None):
    p = RunParser("launch/train.py", "Train a zoo model.",
                  "With no arguments: the main job (configs/gpt/main.yaml), a 0.88M-parameter GPT-2-style model trained "
                  "1000 steps on the embedded corpus (Python's own help texts, no download), about 3:20 on 2 idle CPU "
                  "cores (README, Quickstart).")
    p.add_argument("--config", help=f"run config YAML (default: {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[2])})")
    p.add_run_flags(load_help=": model, optimizer, LR schedule, step, RNG and data position; another tp/pp/dp/ep "
                              "goes through DeepSpeed's universal checkpoint")
    p.add_argument("--out", help="output folder: config.yaml, metrics.jsonl, tb/, loss.png, checkpoints/, model/")
    p.add_argument("--init", metavar="DIR",
                   help="start from these weights: a zoo model folder (launch/convert.py hf-to-zoo, or a run's model/) "
                        "or a HuggingFace folder / Hub id (converted on the fly); the model config comes from it")
    p.add_argument("--no-sample", action="store_true", help="skip the sample printed at the end")
    return p.parse_args(argv)


def config_from_args(args) -> RunConfig:
    overrides = list(args.set)
    for flag, key in (("tp", "parallel.tp"), ("pp", "parallel.pp"), ("ep", "parallel.ep"), ("ep_spans_tp", "parallel.ep_spans_tp"),
                      ("cp", "parallel.cp"),
                      ("cp_algorithm", "parallel.cp_algorithm"), ("zero", "parallel.zero_stage"),
                      ("compile", "training.compile"), ("fused_cross_entropy", "training.fused_cross_entropy"),
                      ("steps", "training.steps"), ("eval_interval", "training.eval_interval"),
                      ("save_interval", "training.save_interval"), ("init", "training.init_from"), ("out", "out")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load(args.config or DEFAULT_CONFIG, overrides)


def resume_plan(cfg: RunConfig, model_cfg, args):
    """Which checkpoint to resume (None: start fresh) and whether it needs the universal path; checked before any
    process group so a wrong --load costs nothing and touches nothing."""
    from zoo.training import checkpoint as ckpt

    if args.load is None and args.load_step is not None:
        raise ConfigError("--load-step needs --load DIR")
    if args.load is not None:
        found = ckpt.find_checkpoint(args.load, args.load_step,
                                     allow_no_manifest=getattr(args, "allow_no_manifest", False))
    elif cfg.training.save and (Path(cfg.out) / ckpt.CHECKPOINTS).is_dir():
        # Megatron's habit: a run resumes where it saved (the newest intact checkpoint)
        found = ckpt.find_intact(cfg.out, warn=lambda line: os.environ.get("RANK", "0") == "0" and
                                 print(line, file=sys.stderr, flush=True))
        if found is None:
            return None, False
    else:
        return None, False
    meta = found.meta
    saved = meta["model"]
    here = model_cfg.to_dict()
    diff = [f"{k} {saved.get(k)!r} vs {here.get(k)!r}" for k in sorted(set(saved) | set(here))
            if saved.get(k) != here.get(k)]
    if diff:
        raise ConfigError(f"checkpoint {found.root / found.tag} holds a different model (checkpoint vs this run: "
                          f"{'; '.join(diff[:4])}); use the model config it was trained with, or another --out")
    if meta["global_batch_size"] != cfg.global_batch_size or meta["seq_length"] != cfg.training.seq_length:
        raise ConfigError(f"checkpoint {found.root / found.tag} was trained with global batch "
                          f"{meta['global_batch_size']} x {meta['seq_length']} tokens, this run uses "
                          f"{cfg.global_batch_size} x {cfg.training.seq_length}; keep them to resume the same data "
                          f"order")
    old, par = meta["layout"], cfg.parallel
    same_model_layout = ((old["tp"], old["pp"], old.get("ep", 1), old.get("ep_spans_tp", False))
                         == (par.tp, par.pp, par.ep, par.ep_spans_tp))
    # DeepSpeed partitions ZeRO states over dp x cp (zoo.parallel.topology): a cp change is a dp change to it.
    zero_same = old["zero_stage"] == par.zero_stage and (old["zero_stage"] == 0 or
                                                         old["dp"] * old.get("cp", 1) == cfg.dp * par.cp)
    universal = not (same_model_layout and zero_same)
    if universal and (old["zero_stage"] == 0 or par.zero_stage == 0):
        raise ConfigError(f"checkpoint {found.root / found.tag} was saved at tp={old['tp']} pp={old['pp']} "
                          f"dp={old['dp']} ZeRO-{old['zero_stage']}; resuming at tp={par.tp} pp={par.pp} "
                          f"dp={cfg.dp} ZeRO-{par.zero_stage} goes through DeepSpeed's universal checkpoint, which "
                          f"needs ZeRO >= 1 on both sides; resume in the saved layout, or train with --zero 1")
    return found, universal


def plan(args, world_size: int) -> tuple:
    """``(run config, model config, checkpoint to resume or None, whether it resumes through the universal
    checkpoint)``, all checked before any process group exists."""
    cfg = config_from_args(args)
    model_cfg = validate(cfg, world_size)
    return (cfg, model_cfg, *resume_plan(cfg, model_cfg, args))


def run(args, cfg: RunConfig, model_cfg, resume, universal: bool) -> int:
    out, family = Path(cfg.out), get_family(cfg.model.family)
    with process_group(cfg) as grid:
        rank0 = grid.rank == 0
        count = model_cfg.num_parameters() if hasattr(model_cfg, "num_parameters") else float("nan")
        per_sample = f" x {cfg.training.seq_length} tokens" if family.unit == "tokens" else ""
        start_run(cfg, grid, f"zoo: {cfg.model.family} {count / 1e6:.2f}M parameters | {layout_line(cfg, grid)} | "
                             f"global batch {cfg.global_batch_size}"
                             f"{per_sample} | {cfg.training.precision} | data: {cfg.data.source}",
                  init_without_tokenizer(cfg, model_cfg))
        data = build_data(cfg, model_cfg, grid)
        result = train_and_save(cfg, model_cfg, grid, data, resume=resume, universal=universal, keep_metrics=True)
    metrics = result.metrics  # still open: the pictures drawn from the export go to the loggers too (W&B)
    try:
        if rank0:
            if result.val_losses:
                say(loss_change(result.val_losses, share=True))
            say(f"done: metrics in {out / 'metrics.jsonl'} | TensorBoard: tensorboard --logdir {out / 'tb'} | "
                f"loss plot {out / 'loss.png'}" + (f" | checkpoints {out / 'checkpoints'} | model {out / 'model'}"
                                                    if cfg.training.save else ""))
        if rank0 and cfg.training.save and not args.no_sample:
            pictures = family.after_training(out / "model", say) or {}
            step = metrics.records[-1]["step"] if metrics.records else cfg.training.steps
            for key, path in pictures.items():
                metrics.image(key, path, step)
    finally:
        metrics.close()
    return 0


def main(argv=None) -> int:
    return command(parse_args(argv), plan, run)
