"""The training loop of every family and fine-tune, as one small object: :class:`Trainer` builds the engine
(``zoo.training.engine``), runs optimizer steps, evaluates, saves checkpoints, and :meth:`Trainer.fit` runs them to
``training.steps`` with the progress bar, the exit signals, the first step's memory and the log lines.

Either way the logged loss of a step is the mean over its micro-batches and data-parallel replicas, so it is the
same number in every layout.

Context parallelism (``parallel.cp``, GPT): the cp ranks of a replica read the same micro-batches (the true dp rank
and size pick the samples) and each feeds the engine its share of every sequence, inputs and shifted labels alike
(:func:`local_micro_batch`); every cp rank's loss is the whole sequence's, so the logged loss is reduced over the
true replicas only. DeepSpeed's data-parallel group is dp x cp (``zoo.parallel.topology``): it averages gradients and
partitions ZeRO there, and its ``train_batch_size`` is zoo's global batch x cp. Tokens/s counts each token once;
TFLOP/s per device divides the step's FLOPs by the whole world.

Use::

    with Trainer(cfg, model_cfg, grid, log=print) as trainer:
        result = trainer.fit()       # a RunResult: losses, validation losses, start step, first step's memory
        ... trainer.engine ...       # alive until the trainer closes (destroy_engine), as is its metrics writer
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from zoo.data.batches import context_parallel_share, micro_batch, to_device
from zoo.training.config import RunConfig, lora_config
from zoo.training.engine import build_engine, compiled_graphs, destroy_engine, prepare_init
from zoo.training.families import Data, get_family


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
        self.closed = False
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
        """Close the file and the loggers (a W&B run finishes); a second call does nothing."""
        if self.enabled and not self.closed:
            self.f.close()
            for logger in self.loggers:
                logger.close()
        self.closed = True


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


@dataclass
class RunResult:
    """What :meth:`Trainer.fit` ran, the same type always; the engine and the metrics writer stay with the trainer."""

    losses: list = field(default_factory=list)  # training loss of each step run here (on every rank)
    val_losses: list = field(default_factory=list)  # (step, val_loss) of each evaluation
    start_step: int = 0
    memory: dict | None = None  # the first step's measured bytes, lists by rank (zoo.training.memory)


class Trainer:
    """One run's engine and loop: ``build()``, ``step(step)``, ``evaluate(step)``, ``save(step)``, ``fit()``;
    ``close()`` (or the ``with`` block's end) destroys the engine and closes the metrics writer.

    ``data``: the family's data (None: built here); ``resume``: the checkpoint to start from
    (``zoo.training.checkpoint.find_checkpoint``), ``universal``: saved in another layout; ``progress``: a progress
    bar on global rank 0 while :meth:`fit` runs. ``log`` prints global rank 0's lines.
    """

    def __init__(self, cfg: RunConfig, model_cfg, grid, data: Data | None = None, *, log=print, resume=None,
                 universal: bool = False, progress: bool = False):
        self.cfg, self.model_cfg, self.grid, self.data, self.log = cfg, model_cfg, grid, data, log
        self.resume, self.universal, self.progress = resume, universal, progress
        self.family, self.out = get_family(cfg.model.family), Path(cfg.out)
        self.engine = self.loss_fn = self.ema = self.metrics = None
        self.moe = self.nonfinite = self.first_step = self.comm = None  # built with the engine (build)
        self.result = RunResult()

    # -- build ---------------------------------------------------------------------------------------------------
    def build(self) -> Trainer:
        """The data, the engine (from the init folder, or the resumed checkpoint), the weight average and the
        metrics writer."""
        from deepspeed.accelerator import get_accelerator

        from zoo.parallel.comm_count import CommCounter
        from zoo.training import memory as mem
        from zoo.training.moe import MoETraining
        from zoo.training.nonfinite import NonFiniteSteps

        cfg, grid, tr = self.cfg, self.grid, self.cfg.training
        self.data = self.data or build_data(cfg, self.model_cfg, grid)
        init_dir = prepare_init(cfg, grid) if self.resume is None else None  # a resumed run has its own weights
        self.engine, self.loss_fn = build_engine(cfg, self.model_cfg, grid, init_dir=init_dir,
                                                 universal=self.resume is not None and self.universal)
        self.moe = MoETraining.attach(self.engine.module, self.model_cfg, grid, cfg.gradient_accumulation_steps)
        self.nonfinite = NonFiniteSteps(self.engine, grid, precision=tr.precision, zero_stage=cfg.parallel.zero_stage,
                                        grad_clip=tr.grad_clip, max_in_a_row=tr.max_skipped_steps)
        self.device = get_accelerator().current_device_name()
        if self.resume is not None:
            self._load_checkpoint()
        self.ema = start_ema(self.engine, cfg, grid, self.resume, self.log)
        self.metrics = MetricsWriter(self.out, grid.rank == 0, cfg=cfg,
                                     resume_step=self.result.start_step if self.resume is not None else None)
        self.first_step, self.comm = mem.FirstStep(self.engine, self.ema), CommCounter(grid)
        self.per_step = self._per_step()
        return self

    def _per_step(self) -> tuple:
        """``(units, FLOPs or None, the device's peak TFLOP/s or None)`` of one optimizer step, for its record."""
        from zoo.training.metrics import device_name, peak_tflops

        cfg, family = self.cfg, self.family
        flops_per_sample = family.training_flops_per_sample(cfg, self.model_cfg)
        return (cfg.global_batch_size * family.units_per_sample(cfg),
                None if flops_per_sample is None else cfg.global_batch_size * flops_per_sample,
                peak_tflops(device_name(), cfg.training.precision))

    def _load_checkpoint(self) -> None:
        from zoo.training import checkpoint as ckpt

        resume, grid = self.resume, self.grid
        ckpt.load_checkpoint(self.engine, resume, universal=self.universal, cp_rank=grid.cp_rank, grid=grid)
        self.result.start_step = resume.step
        if grid.rank == 0:
            how = " (universal checkpoint: new layout)" if self.universal else ""
            self.log(f"resumed from {resume.root / resume.tag} at step {resume.step}{how}")

    # -- one optimizer step --------------------------------------------------------------------------------------
    def _batches(self, step: int):
        for m in range(self.cfg.gradient_accumulation_steps):
            yield local_micro_batch(self.data.train, step, m, self.cfg, self.grid, self.device)

    def _forward_backward(self, step: int) -> torch.Tensor:
        """The step's loss, mean over its micro-batches and the data-parallel replicas; the engine has stepped."""
        engine, grid = self.engine, self.grid
        if grid.pp > 1:
            return engine.train_batch(data_iter=self._batches(step))
        total = torch.zeros((), device=self.device)
        for ids, labels in self._batches(step):
            micro_loss = self.loss_fn(engine(ids), labels)
            engine.backward(micro_loss)
            engine.step()
            total += micro_loss.detach().float()
        loss = total / self.cfg.gradient_accumulation_steps
        if grid.dp > 1:
            dist.all_reduce(loss, group=grid.dp_group)
            loss /= grid.dp
        return loss

    def step(self, step: int) -> dict:
        """Optimizer step ``step`` (0-based; the first one run here is measured, ``zoo.training.memory``): its
        metrics record, written to metrics.jsonl. A step whose gradients were not finite on some rank is skipped on
        every rank and said in one line."""
        engine, first = self.engine, step == self.result.start_step
        t0 = time.perf_counter()
        lr = engine.get_lr()[0]  # the rate this step uses
        if self.moe is not None:
            self.moe.before_step(engine, self.cfg.training.precision)
        with self.first_step.measuring() if first else contextlib.nullcontext():
            loss = self._forward_backward(step)
        if self.ema is not None:
            self.ema.update(step + 1)
        loss = float(loss)
        dt = time.perf_counter() - t0
        if first:
            self.result.memory = self.first_step.gather()
        self.result.losses.append(loss)
        record = self._record(step, loss, lr, dt, first)
        self.metrics.write(record)
        if record["skipped"] and self.grid.rank == 0:
            nonfinite = self.nonfinite
            self.log(f"step {step + 1}: loss {loss:.4g}, gradients not finite on some rank: skipped on every rank "
                     f"(weights unchanged; {nonfinite.in_a_row} in a row, {nonfinite.total} in all)")
        return record

    def _record(self, step: int, loss: float, lr: float, dt: float, first: bool) -> dict:
        """The step's line of metrics.jsonl (collective: the loss statistics and the skip decision are reduced)."""
        from zoo.training import checkpoint as ckpt
        from zoo.training.metrics import peak_memory_gb, resident_memory_gb

        family, tr = self.family, self.cfg.training
        comm_bytes, comm_calls = self.comm.take()
        grad_norm = self.engine.get_global_grad_norm()
        units_per_step, flops_per_step, peak = self.per_step
        tflops = None if flops_per_step is None else flops_per_step / dt / self.grid.world_size / 1e12
        return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": None if grad_norm is None else float(grad_norm),
                f"{family.unit}_per_s": units_per_step / dt,
                "tflops_per_device": tflops, "mfu": None if peak is None or tflops is None else tflops / peak,
                "peak_memory_gb": peak_memory_gb(), "rss_gb": resident_memory_gb(), "step_time_s": dt,
                "comm_bytes": comm_bytes, "comm_calls": comm_calls,
                **({"compiled_graphs": compiled_graphs()} if tr.compile else {}),
                **reduced_stats(self.loss_fn, family),
                **(self.moe.after_step() if self.moe is not None else {}),
                **self.nonfinite.after_step(step + 1, loss, self.out / ckpt.CHECKPOINTS),
                **({"memory_bytes": self.result.memory} if first else {})}

    # -- evaluate, save ------------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> float | None:
        """The validation loss after ``step`` steps (None without validation data or ``training.eval_interval``),
        its record in metrics.jsonl with the family's metrics, and one log line."""
        cfg, grid, family, data = self.cfg, self.grid, self.family, self.data
        if data.valid is None or not cfg.training.eval_interval:
            return None
        reduced_stats(self.loss_fn, family)  # drop sums left from training steps
        val = evaluate(self.engine, self.loss_fn, cfg, grid, data.valid, self.device)
        self.result.val_losses.append((step, val))
        extra = {f"val_{k}": v for k, v in reduced_stats(self.loss_fn, family).items()}
        record = {"step": step, "val_loss": val, **({"val_ppl": math.exp(min(val, 50.0))} if family.unit == "tokens"
                                                    else {}), **extra}
        if data.bytes_per_token:  # nats per token -> bits per byte of text
            record["val_bpb"] = val / math.log(2) / data.bytes_per_token
        self.metrics.write(record, prefix="val")
        picture = family.after_evaluation(self.engine, cfg, grid, data, step)  # collective: e.g. a U-Net's mask grid
        self.metrics.image("val/predictions", picture, step)
        if grid.rank == 0:
            names = {"val_ppl": "perplexity"}
            shown = " | ".join(f"{names.get(k, k.removeprefix('val_'))} {v:.4g}" for k, v in record.items()
                               if k not in ("step", "val_loss"))
            self.log(f"step {step}/{cfg.training.steps} | validation loss {val:.4f}" + (f" | {shown}" if shown else ""))
        return val

    def save(self, step: int) -> Path:
        """The training state after ``step`` steps into ``<out>/checkpoints`` (zoo.training.checkpoint), with the
        weight average when there is one."""
        from zoo.training import checkpoint as ckpt

        cfg, grid, model_cfg, tr = self.cfg, self.grid, self.model_cfg, self.cfg.training
        meta = {"layout": {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp, "ep": grid.ep, "ep_spans_tp": grid.ep_spans_tp,
                           "zero_stage": cfg.parallel.zero_stage, "cp": grid.cp},
                "global_batch_size": cfg.global_batch_size, "seq_length": tr.seq_length,
                "model": model_cfg.to_dict(), "tokenizer": self.data.tokenizer_dir}
        lora = lora_config(cfg)
        if lora is not None:  # what trains: a resumed run must add the same adapters
            meta["lora"] = lora.to_dict()
        client_state = {"iteration": step,
                        "universal_checkpoint_info": self.family.universal_checkpoint_info(model_cfg)}
        ema = self.ema
        path = ckpt.save_checkpoint(self.engine, self.out / ckpt.CHECKPOINTS, step, meta, client_state,
                                    keep_last=tr.keep_last or None, cp_group=grid.cp_group, grid=grid,
                                    ema=None if ema is None else partial(ema.save, grid=grid, family=cfg.model.family,
                                                                         config=model_cfg.to_dict()))
        if grid.rank == 0:
            self.log(f"saved checkpoint {path}")
        return path

    # -- the loop ------------------------------------------------------------------------------------------------
    def fit(self) -> RunResult:
        """Steps from the start (0, or the resumed checkpoint's) to ``training.steps``: evaluation before step 1 and
        every ``eval_interval``, a checkpoint every ``save_interval`` and at the end, a log line every
        ``log_interval``; an exit signal on any rank saves and stops every rank after the current step. Global rank 0
        logs the first step's memory at the end and draws the loss curve (``<out>/loss.png``)."""
        from zoo.training.signals import ExitRequest, collectives_guarded

        if self.engine is None:
            self.build()
        tr, grid, start = self.cfg.training, self.grid, self.result.start_step
        log, t_start, bar = self.log, time.perf_counter(), None
        if self.progress and grid.rank == 0 and start < tr.steps:
            from zoo.progress import progress_bar

            bar = progress_bar(total=tr.steps, initial=start, desc="train", unit="step", mininterval=1.0)
            self.log = bar.write  # on a terminal above the bar, in a log file plain lines (zoo.progress)
        try:
            if start == 0:
                self.evaluate(0)
            running = [start]  # the step being run, for the message of a failed collective
            with ExitRequest() as exit_request, \
                    collectives_guarded(grid, lambda: running[0] + 1, tr.collective_timeout_minutes), \
                    bar if bar is not None else contextlib.nullcontext(), \
                    self.comm:  # bar: lines printed go above it; closed on an error too
                for step in range(start, tr.steps):
                    running[0] = step
                    record = self.step(step)
                    if bar is not None:
                        bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
                        bar.update(1)
                    if self._after_step(step + 1, record, t_start, exit_request):
                        break
            if bar is not None:
                bar.close()
            self._finish()
        finally:
            self.log = log
        return self.result

    def _after_step(self, done: int, record: dict, t_start: float, exit_request) -> bool:
        """The log line, evaluation and checkpoint due after ``done`` steps; whether the run leaves (exit signal)."""
        tr, grid, start = self.cfg.training, self.grid, self.result.start_step
        if grid.rank == 0 and (done % tr.log_interval == 0 or done == tr.steps):
            elapsed = time.perf_counter() - t_start
            eta = elapsed / (done - start) * (tr.steps - done)
            rate, tflops = record[f"{self.family.unit}_per_s"], record["tflops_per_device"]
            speed = f"{rate:.0f} {'tok' if self.family.unit == 'tokens' else 'samples'}/s"
            flops = "" if tflops is None else f" | {tflops:.3f} TFLOP/s/device"
            self.log(f"step {done}/{tr.steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | {speed}{flops} | "
                     f"ETA {eta:.0f}s")
        if tr.eval_interval and (done % tr.eval_interval == 0 or done == tr.steps):
            self.evaluate(done)
        leave = exit_request.agreed(self.device)
        if tr.save and ((tr.save_interval and done % tr.save_interval == 0) or done == tr.steps or leave):
            self.save(done)
        if leave and grid.rank == 0:
            from zoo.training.checkpoint import CHECKPOINTS

            said = (f"checkpoint of step {done} saved in {self.out / CHECKPOINTS}; the same command (or "
                    f"--load {self.out}) continues from it" if tr.save else
                    f"stopped after step {done} (training.save is false: no checkpoint)")
            self.log(f"{exit_request.name} received: {said}")
        return leave

    def _finish(self) -> None:
        """Global rank 0: the first step's memory line, and the loss curve (to the loggers that show pictures)."""
        from zoo.training import memory as mem

        metrics = self.metrics
        if self.grid.rank == 0 and self.result.memory is not None:
            self.log(mem.summary(self.result.memory))
        if self.grid.rank == 0 and metrics.records:
            metrics.image("loss_curve", plot_losses(metrics.records, self.out / "loss.png",
                                                    self.family.loss_label(self.cfg)), metrics.records[-1]["step"])

    # -- the end -------------------------------------------------------------------------------------------------
    def export(self, folder: Path) -> None:
        """The model as a layout-free zoo folder (``io.save_model``: every rank's slices, with the data's tokenizer
        and the family's extra files); the weight average, when the run keeps one, is the model."""
        from zoo.convert.io import save_model

        cfg, model_cfg = self.cfg, self.model_cfg
        with self.ema.swapped() if self.ema is not None else contextlib.nullcontext():
            lora = lora_config(cfg)  # adapter tensors beside the base weights, their settings in config.json
            save_model(folder, self.engine.module, self.grid, cfg.model.family, model_cfg.to_dict(),
                       tokenizer_dir=self.data.tokenizer_dir, extra_files=self.family.export_files(cfg, model_cfg),
                       adapter=None if lora is None else lora.to_dict())

    def close_engine(self) -> None:
        """Destroy the engine (DeepSpeed's hooks and buffers: tests train many engines in one process) and drop every
        object that holds it or the grid's process groups, so that their threads end with the groups; the metrics
        writer stays open."""
        if self.engine is not None:
            destroy_engine(self.engine)
        self.engine = self.ema = self.loss_fn = None
        self.moe = self.nonfinite = self.first_step = self.comm = None

    def take_metrics(self) -> MetricsWriter | None:
        """The open metrics writer, for a caller that logs more after the trainer closes (it closes it then)."""
        metrics, self.metrics = self.metrics, None
        return metrics

    def close(self) -> None:
        self.close_engine()
        if self.metrics is not None:
            self.metrics.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the error on its way out is the one to report
            self.close()
