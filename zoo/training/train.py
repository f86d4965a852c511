"""The training run: validated config -> grid -> model from layer specs -> DeepSpeed engine -> loop -> metrics.

``pp == 1``: the specs are built as one module (``SpecSequential``) and ``deepspeed.initialize(mpu=grid)`` runs
ZeRO 0-3 over the data-parallel group. ``pp > 1``: the same specs become a ``PipelineModule`` (1F1B), ZeRO <= 1.
Either way the logged loss of a step is the mean over its micro-batches and data-parallel replicas, so it is the
same number in every layout.

Entry point: ``launch/train.py`` (one process, ``torchrun`` or the ``deepspeed`` launcher).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from zoo.training.config import ConfigError, RunConfig, deepspeed_config, load, validate

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpt" / "tiny.yaml"


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


def build_engine(cfg: RunConfig, model_cfg, grid):
    import deepspeed

    from zoo.models.gpt import CHECKPOINTABLE_LAYERS, GPTLoss, ParallelOptions, layer_specs
    from zoo.models.specs import SpecSequential, build_pipeline
    from zoo.parallel.grad_norm import clip_grad_norm_
    from zoo.parallel.random import configure_activation_checkpointing, model_parallel_seed

    par, tr = cfg.parallel, cfg.training
    configure_activation_checkpointing(grid)
    specs = layer_specs(model_cfg, ParallelOptions(sequence_parallel=par.sequence_parallel))
    loss_fn = GPTLoss(model_cfg)
    if grid.pp > 1:
        module = build_pipeline(specs, grid, loss_fn=loss_fn, base_seed=tr.seed, partition_method=par.partition_method,
                                activation_checkpointing=par.activation_checkpointing,
                                checkpointable_layers=CHECKPOINTABLE_LAYERS)
        mpu = None  # the PipelineModule brings its own grid (same topology)
    else:
        module = SpecSequential(specs, base_seed=tr.seed, activation_checkpointing=par.activation_checkpointing,
                                checkpointable_layers=CHECKPOINTABLE_LAYERS)
        mpu = grid
    model_parallel_seed(tr.seed, grid.tp_rank)  # dropout streams, independent of how many layers this rank built
    schedule = partial(lr_factor, steps=tr.steps, warmup_steps=tr.warmup_steps, min_ratio=tr.min_lr / tr.lr)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=param_groups(module, tr.weight_decay),
                                      config=deepspeed_config(cfg), mpu=mpu,
                                      lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    if par.zero_stage == 0 and tr.precision == "fp32" and tr.grad_clip > 0:
        # DeepSpeed's fp32 clipping miscounts pipeline stages > 0 (see zoo.parallel.grad_norm).
        def clip_fp32_gradients():
            engine._global_grad_norm = clip_grad_norm_(engine.module.parameters(), tr.grad_clip, grid)

        engine.clip_fp32_gradients = clip_fp32_gradients
    return engine, loss_fn


class MetricsWriter:
    """One JSON object per line in ``out/metrics.jsonl``, written by global rank 0 only."""

    def __init__(self, out: Path, enabled: bool):
        self.enabled = enabled
        if enabled:
            out.mkdir(parents=True, exist_ok=True)
            self.f = open(out / "metrics.jsonl", "w")

    def write(self, record: dict) -> None:
        if self.enabled:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self):
        if self.enabled:
            self.f.close()


def train(cfg: RunConfig, model_cfg, grid, log=print) -> list[float]:
    """Run ``cfg.training.steps`` steps; returns the per-step losses (on every rank)."""
    from deepspeed.accelerator import get_accelerator

    from zoo.data.synthetic import SyntheticTokens, micro_batch
    from zoo.training.metrics import device_name, peak_memory_gb, peak_tflops, training_flops_per_token

    tr = cfg.training
    engine, loss_fn = build_engine(cfg, model_cfg, grid)
    device = get_accelerator().current_device_name()
    dataset = SyntheticTokens(model_cfg.vocab_size, tr.seq_length, seed=tr.seed)
    gas = cfg.gradient_accumulation_steps

    def batches(step):
        for m in range(gas):
            ids, labels = micro_batch(dataset, step, m, micro_batch_size=tr.micro_batch_size, accumulation=gas,
                                      dp_rank=grid.dp_rank, dp=grid.dp)
            yield ids.to(device), labels.to(device)

    out = Path(cfg.out)
    metrics = MetricsWriter(out, grid.rank == 0)
    tokens_per_step = cfg.global_batch_size * tr.seq_length
    flops_per_step = tokens_per_step * training_flops_per_token(model_cfg, tr.seq_length,
                                                                cfg.parallel.activation_checkpointing)
    peak = peak_tflops(device_name(), tr.precision)
    losses, start = [], time.perf_counter()
    for step in range(tr.steps):
        t0 = time.perf_counter()
        lr = engine.get_lr()[0]  # the rate this step uses
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
        loss = float(loss)
        dt = time.perf_counter() - t0
        losses.append(loss)
        grad_norm = engine.get_global_grad_norm()
        tflops = flops_per_step / dt / grid.world_size / 1e12
        record = {"step": step + 1, "loss": loss, "lr": lr,
                  "grad_norm": None if grad_norm is None else float(grad_norm),
                  "tokens_per_s": tokens_per_step / dt, "tflops_per_device": tflops,
                  "mfu": None if peak is None else tflops / peak, "peak_memory_gb": peak_memory_gb(),
                  "step_time_s": dt}
        metrics.write(record)
        if grid.rank == 0 and ((step + 1) % tr.log_interval == 0 or step + 1 == tr.steps):
            elapsed = time.perf_counter() - start
            eta = elapsed / (step + 1) * (tr.steps - step - 1)
            log(f"step {step + 1}/{tr.steps} | loss {loss:.4f} | lr {record['lr']:.2e} | "
                f"{record['tokens_per_s']:.0f} tok/s | {tflops:.3f} TFLOP/s/device | ETA {eta:.0f}s")
    metrics.close()
    engine.destroy()  # frees DeepSpeed's hooks and buffers; tests train many engines in one process
    return losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="launch/train.py",
        description="Train a zoo model. Works in one process, under torchrun and under the deepspeed launcher; "
                    "data parallelism is world_size / (tp x pp).")
    p.add_argument("--config", help=f"run config YAML (default: {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[2])})")
    p.add_argument("--tp", type=int, help="tensor-parallel size")
    p.add_argument("--pp", type=int, help="pipeline-parallel size")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (pp > 1 allows 0 or 1)")
    p.add_argument("--steps", type=int, help="number of optimizer steps")
    p.add_argument("--out", help="output folder (metrics.jsonl)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config field, e.g. --set training.lr=3e-4 model.num_hidden_layers=8")
    args, _unknown = p.parse_known_args(argv)  # the deepspeed launcher adds --local_rank=N
    return args


def config_from_args(args) -> RunConfig:
    overrides = list(args.set)
    for flag, key in (("tp", "parallel.tp"), ("pp", "parallel.pp"), ("zero", "parallel.zero_stage"),
                      ("steps", "training.steps"), ("out", "out")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load(args.config or DEFAULT_CONFIG, overrides)


def main(argv=None) -> int:
    from zoo.parallel.topology import destroy_model_parallel, initialize_model_parallel

    args = parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = config_from_args(args)
        model_cfg = validate(cfg, world)  # before any process group exists
    except ConfigError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)
    if grid.rank == 0:
        print(f"zoo: {model_cfg.num_parameters() / 1e6:.1f}M parameters | tp={grid.tp} pp={grid.pp} dp={grid.dp} "
              f"zero={cfg.parallel.zero_stage} | global batch {cfg.global_batch_size} x {cfg.training.seq_length} "
              f"tokens | {cfg.training.precision}", flush=True)
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    try:
        train(cfg, model_cfg, grid, log=lambda s: print(s, flush=True))
        if grid.rank == 0:
            print(f"done: metrics in {Path(cfg.out) / 'metrics.jsonl'}", flush=True)
    finally:
        destroy_model_parallel()
    return 0
