"""One GPT benchmark run: the two models of a style trained on the same batch, their steps interleaved, then the
report (throughput, TFLOP/s, MFU, peak memory, roofline); and zoo alone at tensor parallelism, its collectives counted.
"""

from __future__ import annotations

import math
import statistics

import torch

from zoo.bench.compare import (
    Trainee,
    batch_shape,
    build_hf,
    build_zoo,
    compiled,
    hf_num_parameters,
    token_batch,
    zoo_config,
)
from zoo.bench.memory import step_peak_memory_gb
from zoo.bench.report import Result, StyleReport
from zoo.bench.roofline import device_rates, gemm_shapes, roofline_report


def run_interleaved(trainees: list[Trainee], ids, labels, accel, warmup: int, steps: int) -> None:
    """Warm-up then timed steps, one step of each model in turn, the order flipped every round."""
    for i in range(warmup + steps):
        order = trainees if i % 2 == 0 else trainees[::-1]
        for t in order:
            t.timed_step(ids, labels, accel, record=i >= warmup)


def benchmark_style(style: str, args, accel, device, dtype, log) -> StyleReport:
    """zoo's model of this style against transformers' (and, unless ``--no-compile``, both with compiled blocks),
    on one batch: tokens/s, TFLOP/s, MFU, peak memory and, unless ``--no-roofline``, the roofline of zoo's step."""
    from zoo.training.metrics import device_name, peak_tflops, training_flops_per_token

    cfg = zoo_config(style, args)
    b, s = batch_shape(args, cfg)

    zoo = build_zoo(cfg, device, dtype, args.seed, args.lr)
    hf = build_hf(cfg, device, dtype, args.seed, args.lr)
    report = StyleReport(style, cfg.to_dict(), cfg.num_parameters(), sum(p.numel() for p in zoo.model.parameters()),
                         hf_num_parameters(hf.model))
    log(describe(style, cfg, b, s, report))
    if report.zoo_params != report.hf_params:
        raise ValueError(f"{style}: parameter counts differ (zoo {report.zoo_params:,}, transformers "
                         f"{report.hf_params:,}): the two configs do not describe the same model")

    ids, labels = token_batch(cfg, b, s, args.seed, device)
    trainees = [zoo, hf]
    if style == "moe" and hasattr(torch.nn.functional, "grouped_mm"):  # transformers' fused-experts path
        trainees.append(build_hf(cfg, device, dtype, args.seed, args.lr, experts_implementation="grouped_mm"))
    if args.no_compile:
        shapes = None if args.no_roofline else gemm_shapes(zoo, ids, labels)
    else:  # zoo's fast path: training.compile + training.fused_cross_entropy
        fast = build_zoo(cfg, device, dtype, args.seed, args.lr, fused_cross_entropy=True)
        shapes = None if args.no_roofline else gemm_shapes(fast, ids, labels)  # eager: the same GEMMs
        trainees += [compiled(fast), compiled(build_hf(cfg, device, dtype, args.seed, args.lr))]
        log(f"{style}: compiling the blocks of both models (the first warm-up steps)")
    # The GEMMs are timed before and after the steps and each shape keeps its faster time: a machine that slows
    # down for a while (a shared VM) must not make the roofline longer than the steps it is compared with
    before = None if shapes is None else device_rates(shapes, device, accel, dtype)
    run_interleaved(trainees, ids, labels, accel, args.warmup, args.steps)
    memory = {t.impl: None if args.no_memory else step_peak_memory_gb(t, ids, labels, accel) for t in trainees}

    flops_per_token = training_flops_per_token(cfg, s)  # no activation recomputation
    peak = peak_tflops(device_name(), args.dtype)
    for t in trainees:
        params = report.hf_params if t.impl.startswith("transformers") else report.zoo_params
        report.results.append(result_of(style, t, params, b * s, flops_per_token, peak, memory[t.impl]))
    if shapes is not None:
        after = device_rates(shapes, device, accel, dtype)
        of = "zoo" if args.no_compile else "zoo-compiled"  # the model whose GEMMs were recorded
        recorded = next(r for r in report.results if r.impl == of)
        report.roofline = roofline_report(recorded.impl, shapes, before, after, recorded.step_time_s,
                                          flops_per_token * b * s)
    return report


def describe(style: str, cfg, b: int, s: int, report: StyleReport) -> str:
    """The line that opens a style: the model's shape, the batch and both parameter counts."""
    padded = cfg.padded_vocab_size()
    experts = (f" experts={cfg.num_experts} top-{cfg.num_experts_per_tok} ({cfg.num_parameters(active=True):,} "
               f"active parameters)" if cfg.num_experts else "")
    return (f"{style}: h={cfg.hidden_size} layers={cfg.num_hidden_layers} heads={cfg.num_attention_heads}/"
            f"{cfg.num_key_value_heads} (q/kv) ffn={cfg.intermediate_size}{experts} vocab={cfg.vocab_size}"
            + (f" (zoo pads to {padded})" if padded != cfg.vocab_size else "")
            + f" tied={cfg.tie_word_embeddings}, batch [{b}, {s}] = {b * s} tokens/step | parameters: "
              f"zoo {report.zoo_params:,} (cfg.num_parameters()), transformers {report.hf_params:,}"
            + (f", zoo allocates {report.zoo_params_allocated:,} with the padded vocabulary"
               if report.zoo_params_allocated != report.zoo_params else ""))


def result_of(style: str, t: Trainee, params: int, tokens: int, flops_per_token: float, peak: float | None,
              memory: float | None) -> Result:
    """One model's row from its timed steps (medians), refused if any loss was not finite."""
    median = statistics.median(t.step_times)
    tok_s = tokens / median
    tflops = flops_per_token * tok_s / 1e12
    if not all(math.isfinite(x) for x in t.losses):
        raise FloatingPointError(f"{style}/{t.impl}: non-finite loss {t.losses}")
    return Result(style, t.impl, params, tokens, median, statistics.median(t.cpu_times), tok_s, tflops,
                  None if peak is None else tflops / peak, memory, t.losses[0], t.losses[-1], list(t.step_times))


def benchmark_tp(style: str, args, accel, device, dtype, grid, log) -> list[dict]:
    """zoo alone at tp = the world (transformers has no tensor parallelism): eager and compiled, each step's
    collectives counted (``zoo.parallel.comm_count``). Every rank runs the same batch; rank 0 reports."""
    from zoo.parallel.comm_count import CommCounter
    from zoo.training.metrics import device_name, peak_tflops, training_flops_per_token

    cfg = zoo_config(style, args)
    b, s = batch_shape(args, cfg)
    ids, labels = token_batch(cfg, b, s, args.seed, device)
    trainees = [build_zoo(cfg, device, dtype, args.seed, args.lr)]
    if not args.no_compile:
        trainees.append(compiled(build_zoo(cfg, device, dtype, args.seed, args.lr, fused_cross_entropy=True)))
    run_interleaved(trainees, ids, labels, accel, args.warmup, args.steps)
    peak = peak_tflops(device_name(), args.dtype)
    rows = []
    for t in trainees:
        with CommCounter(grid) as comm:
            t.timed_step(ids, labels, accel, record=False)
            nbytes, calls = comm.take()
        median = statistics.median(t.step_times)
        tflops = training_flops_per_token(cfg, s) * b * s / median / grid.world_size / 1e12
        memory = None if args.no_memory else step_peak_memory_gb(t, ids, labels, accel)
        rows.append({"style": style, "impl": t.impl, "tp": grid.tp, "tokens_per_s": b * s / median,
                     "step_time_s": median, "tflops_per_device": tflops,
                     "mfu": None if peak is None else tflops / peak, "peak_memory_gb": memory,
                     "comm_bytes": nbytes, "comm_calls": calls})
        log(f"{style} tp={grid.tp} {t.impl}: {b * s / median:.0f} tok/s, {tflops:.3g} TFLOP/s per device"
            + ("" if peak is None else f", MFU {tflops / peak:.1%}")
            + ("" if memory is None else f", peak {memory:.2f} GB")
            + f", per step {', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in nbytes.items())}")
    return rows
