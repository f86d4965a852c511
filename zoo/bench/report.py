"""What a GPT benchmark reports: one :class:`Result` per model, one :class:`StyleReport` per style, and their
text (the table, one summary line per style).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass


class Result:
    style: str
    impl: str
    params: int
    tokens_per_step: int
    step_time_s: float  # median
    cpu_time_s: float  # median process CPU time of a step (all threads)
    tokens_per_s: float
    tflops: float
    mfu: float | None
    peak_memory_gb: float | None
    loss_first: float
    loss_last: float
    step_times_s: list = field(default_factory=list)


@dataclass


class StyleReport:
    style: str
    config: dict
    zoo_params: int  # cfg.num_parameters(): the unpadded model, as a HF checkpoint counts it
    zoo_params_allocated: int  # zoo's tensors, padded vocabulary included
    hf_params: int
    results: list = field(default_factory=list)
    roofline: dict | None = None  # the step's GEMMs at this device's measured rates (gemm_shapes, roofline)

    @property
    def ratio(self) -> float:
        zoo, hf = (next(r for r in self.results if r.impl == impl) for impl in ("zoo", "transformers"))
        return zoo.tokens_per_s / hf.tokens_per_s

    def tokens_per_s(self, impl: str) -> float | None:
        return next((r.tokens_per_s for r in self.results if r.impl == impl), None)

    def summary(self) -> dict:
        """The ``--json`` line's entry of this style."""
        return {"zoo_eager": self.tokens_per_s("zoo"), "zoo_compiled": self.tokens_per_s("zoo-compiled"),
                "hf_eager": self.tokens_per_s("transformers"),
                "hf_compiled": self.tokens_per_s("transformers-compiled"),
                "fraction_of_matmul": None if self.roofline is None else self.roofline["fraction_of_matmul"]}


def format_table(results: list[Result]) -> str:
    """One row per model, numbers right-aligned, under a header and a rule."""
    header = ("style", "impl", "params", "tok/s", "step ms", "cpu ms", "TFLOP/s", "MFU", "peak GB", "loss first>last")
    rows = [header]
    for r in results:
        rows.append((r.style, r.impl, f"{r.params:,}", f"{r.tokens_per_s:,.0f}", f"{r.step_time_s * 1e3:.1f}",
                     f"{r.cpu_time_s * 1e3:.1f}",
                     f"{r.tflops:.3g}", "-" if r.mfu is None else f"{r.mfu:.1%}",
                     "-" if r.peak_memory_gb is None else f"{r.peak_memory_gb:.3f}",
                     f"{r.loss_first:.3f}>{r.loss_last:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    left = {0, 1}
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_line(report: StyleReport) -> str:
    """The style's tokens/s of zoo against transformers (eager, compiled) and its roofline, one line each."""
    zoo, hf = (next(r for r in report.results if r.impl == impl) for impl in ("zoo", "transformers"))
    extra = "".join(f", {r.impl} {r.tokens_per_s:.0f} tok/s (ratio {zoo.tokens_per_s / r.tokens_per_s:.2f})"
                    for r in report.results if r.impl.startswith("transformers-") and not r.impl.endswith("-compiled"))
    line = (f"{report.style}: zoo {zoo.tokens_per_s:.0f} tok/s, transformers {hf.tokens_per_s:.0f} tok/s, "
            f"ratio {report.ratio:.2f}{extra}")
    zc, hc = report.tokens_per_s("zoo-compiled"), report.tokens_per_s("transformers-compiled")
    if zc is not None and hc is not None:
        line += (f"\n{report.style} compiled: zoo {zc:.0f} tok/s, transformers {hc:.0f} tok/s, ratio {zc / hc:.2f}; "
                 f"zoo compiled / transformers eager {zc / hf.tokens_per_s:.2f}, zoo compiled / eager "
                 f"{zc / zoo.tokens_per_s:.2f}")
    roof = report.roofline
    if roof is not None:
        passes = " and ".join(f"{t * 1e3:.1f}" for t in roof["gemm_seconds_before_after"])
        line += (f"\n{report.style} roofline ({roof['of']}): its {roof['gemm_shapes']} GEMM shapes (attention's "
                 f"products included) at this device's measured rates take {roof['gemm_seconds'] * 1e3:.1f} ms "
                 f"(each shape's faster time of two, before and after the steps: {passes} ms) of the step's "
                 f"{roof['gemm_seconds'] / roof['fraction_of_matmul'] * 1e3:.1f} ms: fraction_of_matmul "
                 f"{roof['fraction_of_matmul']:.2f}; the step runs {roof['step_flops_per_s'] / 1e9:.1f} GFLOP/s, a "
                 f"square GEMM {roof['square_gemm_flops_per_s'] / 1e9:.1f} GFLOP/s "
                 f"({roof['step_flops_per_s'] / roof['square_gemm_flops_per_s']:.0%})")
    return line


def to_json(reports: list[StyleReport], **run) -> dict:
    """The ``--json FILE`` report: the run's settings (``run``, in order), then every style's config, parameter
    counts, results and roofline."""
    return {**run, "styles": [{"style": rep.style, "config": rep.config, "zoo_params": rep.zoo_params,
                               "zoo_params_allocated": rep.zoo_params_allocated, "transformers_params": rep.hf_params,
                               "ratio": rep.ratio, "roofline": rep.roofline,
                               "results": [asdict(r) for r in rep.results]} for rep in reports]}
