"""Training throughput of zoo's GPT against HuggingFace ``transformers`` on the same model, in one process.

    python launch/benchmark.py                                   # both styles, small CPU-sized models
    python launch/benchmark.py --style llama --steps 20
    python launch/benchmark.py --style moe                       # Mixtral-like mixture of experts
    python launch/benchmark.py --preset gpt2-124m --dtype bf16 --batch-size 8 --seq-length 1024   # on a GPU

For each style the two models have the same shape and parameter count:

- GPT-2 style: zoo's learned-position / LayerNorm / GELU(tanh) / biased / tied model against ``GPT2LMHeadModel``
  (``activation_function="gelu_new"``, every dropout 0);
- Llama style: zoo's RoPE / RMSNorm / SwiGLU / bias-free / GQA model against ``LlamaForCausalLM``;
- MoE style: the Llama style with every MLP a mixture of ``--experts`` SwiGLU experts, top-``--experts-per-token``
  softmax routing renormalised (Mixtral's), against ``MixtralForCausalLM`` with its default (eager) experts, and
  again with transformers' ``grouped_mm`` experts implementation where torch has ``grouped_mm`` (CPU too).
  Router losses are off on both sides (same work); FLOPs count the active experts only.

Both train on the same batch ``[b, s]`` (inputs and next-token labels of one random token sequence), with the same
dtype (parameters cast to it; fp32 on CPU), the same optimizer (``torch.optim.AdamW``, fused where the device
has the kernel) and the same step: zero grads, forward, loss, backward, optimizer step.
HF attention is ``sdpa``, as zoo calls ``F.scaled_dot_product_attention``; HF's loss is its own
``ForCausalLMLoss`` fed the already shifted labels (``shift_labels``), so both average over the same b*s tokens.

Timing: warm-up steps first, then N timed steps with the accelerator synchronised around each; the two models'
steps are interleaved (and their order alternated), so load from other processes hits both alike. Reported:
median step time, tokens/s = b*s / median, the median CPU time of the process per step (steadier than wall time
on a shared CPU), TFLOP/s from :func:`zoo.training.metrics.training_flops_per_token`
(no recomputation; the same count for both, since the models are the same), MFU where the device's peak is
known, and the peak memory of one step: parameters + optimizer state + the most the step allocates on top
(accelerator allocator statistics; on CPU the profiler's allocation events).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

from zoo.bench.common import DTYPES, cores, write_report
from zoo.bench.compare import (
    DEFAULT_EXPERTS,
    DEFAULT_EXPERTS_PER_TOKEN,
    DEFAULT_SIZE,
    PRESET_BATCH_SIZE,
    PRESET_SEQ_LENGTH,
    STYLES,
    style_of,
)
from zoo.bench.gpu_suite import gpu_suite
from zoo.bench.measure import benchmark_style, benchmark_tp
from zoo.bench.report import StyleReport, format_table, summary_line, to_json
from zoo.flags import Parser

# The flags that count something: each at least 1, --warmup at least 0
COUNT_FLAGS = ("steps", "warmup", "threads", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size",
               "seq_length", "batch_size", "vocab_size", "experts", "experts_per_token")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="launch/benchmark.py",
        description="Training tokens/s of zoo's GPT vs transformers' GPT2LMHeadModel / LlamaForCausalLM of the same "
                    "size, batch, dtype and optimizer, in one process.",
    )
    p.add_argument("--style", choices=[*STYLES, "both"], default=None,
                   help="model style (default: both = gpt2 and llama; with --preset, the preset's style)")
    p.add_argument("--preset", help="a zoo GPT preset (e.g. gpt2-124m, llama-1b); size flags override its fields. "
                                    f"Default batch/seq with a preset: {PRESET_BATCH_SIZE} x {PRESET_SEQ_LENGTH}")
    p.add_argument("--hidden-size", type=int, help=f"hidden size (default {DEFAULT_SIZE['hidden_size']})")
    p.add_argument("--layers", type=int, help=f"transformer blocks (default {DEFAULT_SIZE['layers']})")
    p.add_argument("--heads", type=int, help=f"attention (query) heads (default {DEFAULT_SIZE['heads']})")
    p.add_argument("--kv-heads", type=int, help="key/value heads, Llama style only (default: half the heads, "
                                                "grouped-query attention; GPT-2 is multi-head)")
    p.add_argument("--intermediate-size", type=int, help="MLP size, Llama style only (default: 2.75 h rounded up "
                                                         "to a multiple of 64; GPT-2 style uses 4 h)")
    p.add_argument("--experts", type=int, help=f"MoE style: experts per layer (default {DEFAULT_EXPERTS})")
    p.add_argument("--experts-per-token", type=int,
                   help=f"MoE style: experts each token is routed to (default {DEFAULT_EXPERTS_PER_TOKEN})")
    p.add_argument("--seq-length", type=int, help=f"tokens per sequence (default {DEFAULT_SIZE['seq_length']})")
    p.add_argument("--batch-size", type=int, help=f"sequences per step (default {DEFAULT_SIZE['batch_size']})")
    p.add_argument("--vocab-size", type=int, help=f"vocabulary (default {DEFAULT_SIZE['vocab_size']}; a multiple of "
                                                  "128 keeps zoo unpadded, so both models do the same work)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per model (default 10; the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per model (default 3)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="parameter and compute dtype of both models (default fp32; bf16/fp16 for GPUs)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch CPU threads (default: all cores available, here {cores()})")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the weights and of the token batch")
    p.add_argument("--no-memory", action="store_true", help="skip the extra step that measures peak memory")
    p.add_argument("--no-compile", action="store_true",
                   help="eager models only (default: also both models with torch.compile on every block)")
    p.add_argument("--no-roofline", action="store_true",
                   help="skip measuring the rate of every GEMM shape the step runs (fraction_of_matmul)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size, under torchrun with that many processes: zoo only (eager and "
                        "compiled), with the bytes each collective moves per step")
    p.add_argument("--gpu-suite", action="store_true",
                   help="the whole GPU set in one command: gpt2-124m and llama-1b in bf16 (eager and compiled, "
                        "against transformers) and, with 2 GPUs, gpt2-124m at --tp 2 under torchrun; results in "
                        "--out (default runs/bench-gpu)")
    p.add_argument("--out", default="runs/bench-gpu", help="--gpu-suite: where the JSON reports go")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="end the output with one JSON line of tokens/s per style and model (zoo_eager, "
                        "zoo_compiled, hf_eager, hf_compiled, fraction_of_matmul); with FILE also write the whole "
                        "report there")
    return p


def run_tp(args, styles, accel, device, dtype, log) -> None:
    """``--tp N``: zoo alone on a grid of N tensor-parallel ranks; rank 0 prints (and with --json writes)."""
    from zoo.parallel.topology import initialize_model_parallel

    grid = initialize_model_parallel(args.tp, 1)
    say = log if grid.rank == 0 else (lambda line: None)
    say(f"device {accel.current_device_name()} x {grid.world_size}, tp={grid.tp}, {args.dtype}, "
        f"{args.warmup} warm-up + {args.steps} timed steps (median)")
    rows = [row for style in styles for row in benchmark_tp(style, args, accel, device, dtype, grid, say)]
    if grid.rank == 0 and args.json:
        text = json.dumps({"tp": grid.tp, "device": accel.current_device_name(), "dtype": args.dtype,
                           "results": rows})
        if args.json != "-":
            write_report(args.json, text + "\n")
        log(text)


def flag_error(args) -> str | None:
    """The first count flag out of range, as its error line (None when all are in range)."""
    for name in COUNT_FLAGS:
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            return f"--{name.replace('_', '-')} must be {'>= 0' if name == 'warmup' else 'positive'}, got {value}"
    return None


def styles_to_run(args) -> list[str]:
    """The preset's style (``--style`` must agree), else ``--style``'s (both: gpt2 then llama). ValueError for a
    preset that no transformers model matches or a ``--style`` that contradicts it."""
    if args.preset is None:
        return ["gpt2", "llama"] if args.style in (None, "both") else [args.style]
    from zoo.models.gpt import GPTConfig

    preset_style = style_of(GPTConfig.from_preset(args.preset))
    if args.style not in (None, preset_style):
        raise ValueError(f"preset {args.preset!r} is {preset_style} style; drop --style or use --style "
                         f"{preset_style}")
    return [preset_style]


def run_styles(args, styles, accel, device, dtype, threads: int, log) -> list[StyleReport] | None:
    """Every style's report on ``threads`` CPU threads (None after ``--tp``: its rank 0 printed its rows). The
    thread count is restored and a process group started here destroyed, however it ends."""
    import torch.distributed as dist

    from zoo.parallel.topology import destroy_model_parallel, initialize_model_parallel

    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    started_dist = not (dist.is_available() and dist.is_initialized())
    try:
        if args.tp > 1:
            run_tp(args, styles, accel, device, dtype, log)
            return None
        initialize_model_parallel(1, 1)  # a world of one: zoo's layers take their single-rank path
        log(f"device {accel.current_device_name()} ({threads} CPU threads), {args.dtype}, AdamW lr {args.lr}, "
            f"{args.warmup} warm-up + {args.steps} timed steps per model (median), steps of the two models "
            f"interleaved")
        reports = []
        for style in styles:
            reports.append(benchmark_style(style, args, accel, device, dtype, log))
            gc.collect()
            if accel.device_name() != "cpu":
                accel.empty_cache()
        return reports
    finally:
        torch.set_num_threads(threads_before)
        if started_dist:
            destroy_model_parallel()


def print_reports(reports: list[StyleReport], args, accel, threads: int, log) -> None:
    """The table, a note when other processes load the CPU, each style's summary; with ``--json`` the summary
    line last (and with a FILE the whole report there)."""
    results = [r for rep in reports for r in rep.results]
    log("")
    log(format_table(results))
    log("")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if accel.device_name() == "cpu" and load > cores():
        log(f"note: load average {load:.1f} on {cores()} cores: other processes share the CPU, so step times include "
            "waiting for it; 'cpu ms' (this process's CPU time per step) compares the work done more steadily")
    for rep in reports:
        log(summary_line(rep))
    if args.json and args.json != "-":
        out = to_json(reports, device=accel.current_device_name(), dtype=args.dtype, threads=threads,
                      warmup=args.warmup, steps=args.steps, load_average=load)
        write_report(args.json, json.dumps(out, indent=2) + "\n")
        log(f"results written to {args.json}")
    if args.json:
        log(json.dumps({rep.style: rep.summary() for rep in reports}))


def main(argv=None) -> int:
    """``launch/benchmark.py``: check the flags, then the GPU suite, the ``--tp`` run or every style, and print."""
    args = build_parser().parse_args(argv)
    error = flag_error(args)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2

    from deepspeed.accelerator import get_accelerator

    try:
        styles = styles_to_run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    accel = get_accelerator()
    if args.gpu_suite:
        return gpu_suite(args, accel)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or args.tp != world:
        print(f"error: --tp {args.tp} runs under a launcher with that many processes (here {world}): torchrun "
              f"--nproc_per_node {max(args.tp, 1)} launch/benchmark.py ... --tp {max(args.tp, 1)}", file=sys.stderr)
        return 2
    device = torch.device(accel.current_device_name())
    dtype = DTYPES[args.dtype]
    if accel.device_name() == "cpu" and dtype != torch.float32:
        print(f"note: {args.dtype} on CPU is measured as asked, but CPU kernels are tuned for fp32", flush=True)

    threads = args.threads or cores()
    log = lambda s: print(s, flush=True)  # noqa: E731
    try:
        reports = run_styles(args, styles, accel, device, dtype, threads, log)
    except (ValueError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if reports is not None:
        print_reports(reports, args, accel, threads, log)
    return 0
