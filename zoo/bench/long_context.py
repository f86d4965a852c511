"""Activation memory and step time of long sequences under context parallelism, and the longest one that fits.

    python launch/benchmark_long_context.py                                   # tiny Llama, 2k..32k tokens, cp 1 2 4
    python launch/benchmark_long_context.py --seq-lengths 2048 4096 8192 --cp 1 2 --memory-budget-gb 80
    python launch/benchmark_long_context.py --cp-algorithm ring --json runs/long.json
    python launch/benchmark_long_context.py --help                            # all flags

One command: for each cp it spawns cp processes itself (``torch.multiprocessing``, a gloo world on CPU, nccl with one
GPU per rank on GPUs: cp GPUs needed), so it needs no launcher. Each rank builds the training engine of
``launch/train.py --cp <cp>`` (``zoo.training.engine.build_engine``: the run config of ``--config``, synthetic data,
ZeRO-0, DeepSpeed averaging gradients over the CP group) and trains each sequence length with its own share of the
sequence (``local_micro_batch``).

Measured per rank and sequence length:

- activation memory: the bytes of the storages that the tensors autograd saves for backward in one training step
  keep alive (forward and loss, ``torch.autograd.graph.saved_tensors_hooks``), each once; parameters and cached
  RoPE tables left out (:class:`SavedTensorBytes`). This is what grows with the sequence; on an accelerator the
  allocator's peak above the model's state during the step is shown too;
- the step time: the median of ``--steps`` timed steps (forward, loss, backward, optimizer step) after ``--warmup``.

From the longest measured length, the activation bytes per local token (a rank holds s/cp tokens of each sequence)
and the model state (fp32 weights, gradients and AdamW's two moments: 16 bytes per parameter, replicated over CP) give
the longest sequence that fits ``--memory-budget-gb`` per rank at each cp: (budget - state) / bytes per token x cp,
rounded down to what the split allows. The extrapolation assumes activations linear in s, which holds while
attention keeps O(s) state (``scaled_dot_product_attention``'s flash kernels, Ulysses; the ring's CPU blocks
materialise their scores only inside its own forward and backward, never saved).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import sys
import time
import traceback

import torch

from zoo.bench.common import cores, write_report
from zoo.flags import Parser
from zoo.package import config_file

DEFAULT_CONFIG = config_file("gpt/tiny-llama.yaml")
DEFAULT_SEQ_LENGTHS = (2048, 4096, 8192, 16384, 32768)
DEFAULT_CP = (1, 2, 4)


def _config_hints() -> dict[str, str]:
    """A flag that names a run config field: the --set to write (built only when a flag is refused)."""
    from zoo.training.run import config_flag_hints

    return config_flag_hints()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="launch/benchmark_long_context.py", hints=_config_hints,
               description="Per-rank activation memory and step time of the GPT training step at "
                                            "long sequence lengths and several context-parallel sizes (spawns the "
                                            "ranks itself), and the longest sequence that fits a memory budget.")
    shown = DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[2])  # configs/..., in a checkout or installed
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help=f"run config YAML whose model is measured (default {shown})")
    p.add_argument("--seq-lengths", type=int, nargs="+", default=list(DEFAULT_SEQ_LENGTHS), metavar="S",
                   help=f"sequence lengths (default {' '.join(map(str, DEFAULT_SEQ_LENGTHS))})")
    p.add_argument("--cp", type=int, nargs="+", default=list(DEFAULT_CP), metavar="C",
                   help=f"context-parallel sizes, one spawned world each (default {' '.join(map(str, DEFAULT_CP))})")
    p.add_argument("--cp-algorithm", choices=["ulysses", "ring"], default="ulysses",
                   help="context-parallel attention (default ulysses)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per length (default 2; the median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per length before them (default 1)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="training precision (default fp32)")
    p.add_argument("--memory-budget-gb", type=float, default=80.0,
                   help="memory per rank for the longest-sequence estimate, GiB (default 80)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch CPU threads per rank (default: the cores, here {cores()}, divided by cp)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.KEY=VALUE",
                   help="override run config fields, e.g. --set model.num_hidden_layers=8")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    return p


# ---------------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------------


class SavedTensorBytes:
    """Bytes of the storages autograd saves tensors of while active: what the saved tensors keep alive.

    Each storage counts once and whole (a saved view keeps its whole storage: v viewing the fused QKV output holds all
    of it). Storages that outlive the step are not activations and are left out: ``exclude``'s (the parameters) and,
    measured when the forward ends, the cached RoPE tables (``zoo.models.gpt.rope_table``)."""

    def __init__(self, exclude=()):
        self.exclude = list(exclude)
        self.storages: dict[int, int] = {}

    def _pack(self, t):
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        from zoo.models.gpt import _ROPE_TABLES

        # While the saved tensors are alive no other storage can sit at their addresses: compare pointers now.
        lasting = self.exclude + [t for table in _ROPE_TABLES.values() for t in table]
        skip = {t.untyped_storage().data_ptr() for t in lasting}
        self.total = sum(n for ptr, n in self.storages.items() if ptr not in skip)


def run_config(args, cp: int, seq_length: int):
    from zoo.training.config import load

    return load(args.config, [*args.set, f"parallel.cp={cp}", f"parallel.cp_algorithm={args.cp_algorithm}",
                              f"training.seq_length={seq_length}",
                              f"model.max_position_embeddings={max(args.seq_lengths)}",
                              f"training.micro_batch_size={args.batch_size}",
                              f"training.global_batch_size={args.batch_size}",
                              "training.gradient_accumulation_steps=null",
                              "data.source=synthetic", "parallel.zero_stage=0", "parallel.tp=1", "parallel.pp=1",
                              f"training.precision={args.precision}", f"training.steps={args.warmup + args.steps + 1}",
                              "training.save=false", "training.eval_interval=0"])


def measure_rank(args, cp: int) -> list[dict]:
    """Every sequence length on this rank of a cp-rank world: one measured step, then warm-up and timed steps."""
    from deepspeed.accelerator import get_accelerator

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.config import validate
    from zoo.training.engine import build_engine, destroy_engine
    from zoo.training.families import get_family
    from zoo.training.trainer import local_micro_batch

    grid = initialize_model_parallel(cp=cp)
    accel = get_accelerator()
    device = accel.current_device_name()
    on_gpu = accel.device_name() != "cpu"
    rows = []
    for s in args.seq_lengths:
        cfg = run_config(args, cp, s)
        model_cfg = validate(cfg, cp)
        data = get_family(cfg.model.family).build_data(cfg, model_cfg, grid)
        engine, loss_fn = build_engine(cfg, model_cfg, grid)
        params = list(engine.module.parameters())

        def step(i: int, saved: SavedTensorBytes | None = None) -> float:
            ids, labels = local_micro_batch(data.train, i, 0, cfg, grid, device)
            accel.synchronize()
            t0 = time.perf_counter()
            if saved is None:
                loss = loss_fn(engine(ids), labels)
            else:
                with saved:
                    loss = loss_fn(engine(ids), labels)
            engine.backward(loss)
            engine.step()
            accel.synchronize()
            return time.perf_counter() - t0

        if on_gpu:
            accel.reset_peak_memory_stats()
            before = accel.memory_allocated()
        saved = SavedTensorBytes(exclude=params)
        step(0, saved)
        peak = accel.max_memory_allocated() - before if on_gpu else None
        for i in range(args.warmup):
            step(1 + i)
        times = [step(1 + args.warmup + i) for i in range(args.steps)]
        rows.append({"cp": cp, "rank": grid.cp_rank, "seq_length": s, "local_tokens": args.batch_size * s // cp,
                     "activation_bytes": saved.total, "allocator_peak_bytes": peak,
                     "state_bytes": 16 * sum(p.numel() for p in params),
                     "step_time_s": statistics.median(times),
                     "tokens_per_s": args.batch_size * s / statistics.median(times)})
        destroy_engine(engine)
        engine = data = None  # this length's engine and data go before the next length's are built
    return rows


def _worker(rank: int, world: int, port: int, threads: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS=str(threads))
    try:
        torch.set_num_threads(threads)
        results.put((rank, True, measure_rank(args, world)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        from zoo.parallel.topology import destroy_model_parallel

        destroy_model_parallel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args, cp: int, timeout: float = 3600.0) -> list[dict]:
    """The rows of every rank of a cp-rank world, spawned here."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    threads = args.threads or max(1, cores() // cp)
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, cp, port, threads, args, results)) for r in range(cp)]
    for p in procs:
        p.start()
    rows, errors, deadline = [], [], time.monotonic() + timeout
    try:
        for _ in range(cp):
            while True:
                try:
                    rank, ok, value = results.get(timeout=5)
                    break
                except queue.Empty:
                    if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError(f"cp={cp}: a rank died or timed out; errors so far: {errors}") from None
            rows += value if ok else []
            errors += [] if ok else [f"rank {rank}:\n{value}"]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError(f"cp={cp} failed:\n" + "\n".join(errors))
    return sorted(rows, key=lambda r: (r["seq_length"], r["rank"]))


# ---------------------------------------------------------------------------------------------------------------
# The whole benchmark
# ---------------------------------------------------------------------------------------------------------------


def longest_fit(rows: list[dict], cp: int, budget_bytes: float, batch: int, algorithm: str) -> dict:
    """The longest sequence whose activations (at the measured bytes per local token) and model state fit."""
    last = max(rows, key=lambda r: r["seq_length"])
    per_token = max(r["activation_bytes"] for r in rows if r["seq_length"] == last["seq_length"]) / last["local_tokens"]
    room = budget_bytes - last["state_bytes"]
    step = cp if algorithm == "ulysses" else 2 * cp
    tokens = max(0, int(room // per_token)) * cp // batch  # the whole sequence: cp ranks' local tokens each
    return {"cp": cp, "bytes_per_local_token": per_token, "max_seq_length": tokens // step * step}


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def main(argv=None, world=None) -> int:
    """The benchmark. ``world(args, cp)`` returns the rows of every rank of a cp-rank world running
    :func:`measure_rank` (default :func:`spawn`: processes started here; tests pass their long-lived pools)."""
    world = world or spawn
    args = build_parser().parse_args(argv)
    for name in ("batch_size", "steps"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    if args.warmup < 0 or any(c < 1 for c in args.cp) or any(s < 1 for s in args.seq_lengths):
        print("error: --warmup must be >= 0, --cp and --seq-lengths positive", file=sys.stderr)
        return 2
    from zoo.training.config import ConfigError, validate

    args.seq_lengths = sorted(set(args.seq_lengths))
    for cp in args.cp:  # every layout checked before anything is spawned: one line, nothing run
        for s in args.seq_lengths:
            try:
                validate(run_config(args, cp, s), cp)
            except ConfigError as e:
                print(f"error: cp={cp}, sequence length {s}: {e}", file=sys.stderr)
                return 2

    print(f"long-context benchmark: {args.config} | {args.cp_algorithm} | batch {args.batch_size} | {args.precision} | "
          f"cores {cores()} | threads per rank {args.threads or 'cores / cp'}", flush=True)
    rows, fits = [], []
    for cp in args.cp:
        got = world(args, cp)
        for r in got:
            print(f"cp={cp} rank {r['rank']} | seq {r['seq_length']:>6} ({r['local_tokens']} local tokens) | "
                  f"activations {_mib(r['activation_bytes'])} MiB ({r['activation_bytes'] / r['local_tokens']:.0f} "
                  f"B/token) | allocator peak {_mib(r['allocator_peak_bytes'])} MiB | step {r['step_time_s']:.3f} s | "
                  f"{r['tokens_per_s']:.0f} tok/s", flush=True)
        rows += got
        fits.append(longest_fit(got, cp, args.memory_budget_gb * 2**30, args.batch_size, args.cp_algorithm))

    print(f"\n{'seq':>6} " + " ".join(f"{f'cp={cp} MiB/rank':>15} {f'cp={cp} step s':>12}" for cp in args.cp))
    for s in args.seq_lengths:
        cells = []
        for cp in args.cp:
            mine = [r for r in rows if r["cp"] == cp and r["seq_length"] == s]
            cells.append(f"{_mib(max(r['activation_bytes'] for r in mine)):>15} "
                         f"{max(r['step_time_s'] for r in mine):>12.3f}")
        print(f"{s:>6} " + " ".join(cells))
    base = {r["seq_length"]: r["activation_bytes"] for r in rows if r["cp"] == args.cp[0]}
    for cp in args.cp[1:]:
        ratios = [max(r["activation_bytes"] for r in rows if r["cp"] == cp and r["seq_length"] == s) / base[s]
                  for s in args.seq_lengths]
        print(f"activations per rank at cp={cp} / cp={args.cp[0]}: " + ", ".join(f"{x:.3f}" for x in ratios))
    print(f"\nlongest sequence in {args.memory_budget_gb:g} GiB per rank (state {_mib(rows[0]['state_bytes'])} MiB, "
          f"batch {args.batch_size}):")
    for f in fits:
        print(f"  cp={f['cp']}: {f['max_seq_length']:,} tokens ({f['bytes_per_local_token']:.0f} B per local token)")
    if args.json:
        write_report(args.json, json.dumps({"args": {k: v for k, v in vars(args).items()}, "rows": rows,
                                            "longest": fits}, indent=2))
    return 0
