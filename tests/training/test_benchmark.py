"""launch/benchmark.py end to end at a very tiny size: output format, positive throughputs, equal parameter counts.

No timing assertions: the numbers depend on the machine and its load.
"""

import json
import re

import pytest

from zoo.bench.gpt import main
from zoo.models.gpt import GPTConfig
from zoo.training.metrics import training_flops_per_token

SUMMARY = re.compile(r"^(gpt2|llama): zoo (\d+(?:\.\d+)?) tok/s, transformers (\d+(?:\.\d+)?) tok/s, "
                     r"ratio (\d+(?:\.\d+)?)$", re.MULTILINE)


def test_benchmark_tiny_both_styles(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rc = main(["--style", "both", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
               "--seq-length", "16", "--batch-size", "2", "--vocab-size", "256", "--steps", "2", "--warmup", "1",
               "--threads", "1", "--no-compile", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out

    lines = {m.group(1): m for m in SUMMARY.finditer(out)}
    assert sorted(lines) == ["gpt2", "llama"], out
    for m in lines.values():
        zoo_tok_s, hf_tok_s, ratio = float(m.group(2)), float(m.group(3)), float(m.group(4))
        assert zoo_tok_s > 0 and hf_tok_s > 0 and ratio > 0
    assert re.search(r"^style\s+impl\s+params\s+tok/s", out, re.MULTILINE), out  # the table

    report = json.loads(out_json.read_text())
    assert [s["style"] for s in report["styles"]] == ["gpt2", "llama"]
    for style in report["styles"]:
        assert style["zoo_params"] == style["transformers_params"] > 0
        assert style["zoo_params_allocated"] == style["zoo_params"]  # vocab 256: a multiple of 128, no padding
        assert f"zoo {style['zoo_params']:,} (cfg.num_parameters()), transformers {style['zoo_params']:,}" in out
        impls = {r["impl"]: r for r in style["results"]}
        assert sorted(impls) == ["transformers", "zoo"]
        for r in impls.values():
            assert r["tokens_per_s"] > 0 and r["tokens_per_step"] == 2 * 16 and len(r["step_times_s"]) == 2
            assert r["params"] == style["zoo_params"]
        # The roofline's GEMMs are exactly the step's FLOPs (forward once, backward twice: inputs' and weights'
        # gradients, as the training FLOP counter says), the attention core's inside SDPA included, less the part
        # of it a causal mask removes: the counter takes all s x s scores, the work is s (s + 1) / 2 of them.
        cfg = GPTConfig.from_dict(style["config"])
        roof = style["roofline"]
        attention = 3 * 4 * 16 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers  # per token
        masked = attention * (1 - 17 / 32)  # s = 16: 136 of 256 scores kept
        assert roof["gemm_flops"] == pytest.approx(2 * 16 * (training_flops_per_token(cfg, 16) - masked), rel=1e-12)
        assert roof["gemm_seconds"] > 0 and roof["fraction_of_matmul"] > 0 and roof["square_gemm_flops_per_s"] > 0
        assert roof["gemm_seconds"] <= min(roof["gemm_seconds_before_after"])  # each shape's faster time of two

    # --json's last line: tokens/s per style and model (no compiled models with --no-compile)
    summary = json.loads(out.strip().splitlines()[-1])
    assert sorted(summary) == ["gpt2", "llama"]
    for style in report["styles"]:
        entry = summary[style["style"]]
        assert entry["zoo_eager"] > 0 and entry["hf_eager"] > 0 and entry["zoo_compiled"] is None
        assert entry["fraction_of_matmul"] == style["roofline"]["fraction_of_matmul"]


def test_benchmark_tiny_moe_against_mixtral(tmp_path, capsys):
    import torch

    out_json = tmp_path / "bench.json"
    rc = main(["--style", "moe", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
               "--experts", "4", "--experts-per-token", "2", "--seq-length", "16", "--batch-size", "2",
               "--vocab-size", "256", "--steps", "2", "--warmup", "1", "--threads", "1", "--no-memory",
               "--no-compile", "--no-roofline", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    grouped = hasattr(torch.nn.functional, "grouped_mm")  # transformers' grouped_mm experts run where torch has it
    line = r"^moe: zoo \d+ tok/s, transformers \d+ tok/s, ratio \d+\.\d+" + (
        r", transformers-grouped_mm \d+ tok/s \(ratio \d+\.\d+\)" if grouped else "") + "$"
    assert re.search(line, out, re.MULTILINE), out
    style = json.loads(out_json.read_text())["styles"][0]
    assert style["style"] == "moe" and style["config"]["num_experts"] == 4
    assert style["zoo_params"] == style["transformers_params"] > 0  # the same Mixtral, counted by both
    impls = {r["impl"] for r in style["results"]}
    assert impls == {"zoo", "transformers"} | ({"transformers-grouped_mm"} if grouped else set())
    assert all(r["tokens_per_s"] > 0 for r in style["results"])


def tp_benchmark(out):
    import contextlib
    import io

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        rc = main(["--style", "gpt2", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--seq-length", "16",
                   "--batch-size", "2", "--vocab-size", "256", "--steps", "2", "--warmup", "1", "--tp", "2",
                   "--no-compile", "--no-memory", "--json"])
    return rc, text.getvalue()


def test_benchmark_tp2_counts_megatrons_collectives(dist_run, tmp_path):
    """--tp 2: per step 4 all-reduces of [b, s, h] per block and 2 more (embedding, LM head), and the cross
    entropy's 3 rows of b*s fp32 numbers: nothing else."""
    (rc, out), _ = dist_run(2, tp_benchmark, str(tmp_path))
    assert rc == 0, out
    row = json.loads(out.strip().splitlines()[-1])["results"][0]
    b, s, h, layers = 2, 16, 32, 1
    assert row["tp"] == 2 and row["tokens_per_s"] > 0
    assert row["comm_bytes"] == {"tp/all_reduce": (4 * layers + 2) * b * s * h * 4 + 3 * b * s * 4}
    assert row["comm_calls"] == {"tp/all_reduce": 4 * layers + 2 + 3}


def test_gpu_suite_needs_a_gpu(capsys):
    assert main(["--gpu-suite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --gpu-suite needs a GPU") and len(err.splitlines()) == 1


def test_roofline_counts_the_fused_loss_gemms(monkeypatch):
    """The fused head + loss runs the head's three GEMMs in chunks (its input gradient written with ``mm(out=)``,
    its weight gradient accumulated over the chunks with ``addmm_``): the recorded GEMM FLOPs equal the unfused
    model's, which the test above holds to the FLOP counter. Chunks of 8 tokens make 4 of the 32 here."""
    import torch

    import zoo.parallel.cross_entropy as ce
    from zoo.bench.compare import build_zoo, zoo_config
    from zoo.bench.gpt import build_parser
    from zoo.bench.roofline import gemm_shapes

    monkeypatch.setattr(ce, "CPU_CHUNK_ELEMENTS", 8 * 256)

    args = build_parser().parse_args(["--hidden-size", "32", "--layers", "1", "--heads", "2", "--vocab-size", "256"])
    cfg = zoo_config("gpt2", args)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def flops(shapes):
        return sum(calls * 2 * b * m * n * k for (b, m, n, k, *_), calls in shapes.items())

    plain = gemm_shapes(build_zoo(cfg, torch.device("cpu"), torch.float32, 0, 1e-3), ids, labels)
    fused = gemm_shapes(build_zoo(cfg, torch.device("cpu"), torch.float32, 0, 1e-3, fused_cross_entropy=True),
                        ids, labels)
    assert flops(fused) == flops(plain) > 0


TINY = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate-size", "64",
        "--seq-length", "16", "--batch-size", "2", "--vocab-size", "256", "--steps", "1", "--warmup", "0",
        "--threads", "1", "--no-compile", "--no-roofline", "--no-memory"]


def _bench_main(argv):
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return main(argv)


def test_gpu_suite_runs_every_benchmark_it_lists(dist_run, tmp_path, monkeypatch, capsys):
    """--gpu-suite on a pretend two-GPU machine: every command it would launch is run here instead, at a tiny size
    (the suite's own flags first, so its presets, dtype and --json FILE are exercised; the --tp 2 one in the 2-rank
    pool): each exits 0 and leaves its JSON report where the suite says."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from zoo.bench.gpt import build_parser
    from zoo.bench.gpu_suite import GPU_SUITE, gpu_suite

    launched, real_run = [], subprocess.run

    def run_here(cmd, *args, **kwargs):
        if not any(str(a).endswith("benchmark.py") for a in cmd):  # DeepSpeed's own probes (ninja, compilers)
            return real_run(cmd, *args, **kwargs)
        launched.append(cmd)
        argv = [str(a) for a in cmd[1 + next(i for i, a in enumerate(cmd) if str(a).endswith("benchmark.py")):]] + TINY
        if "torch.distributed.run" in cmd:
            assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
            rc = dist_run(2, _bench_main, argv)[0]
        else:
            rc = _bench_main(argv)
        return subprocess.CompletedProcess(cmd, rc)

    monkeypatch.setattr(subprocess, "run", run_here)
    gpus = SimpleNamespace(device_name=lambda: "cuda", device_count=lambda: 2)
    args = build_parser().parse_args(["--gpu-suite", "--out", str(tmp_path)])
    assert gpu_suite(args, gpus) == 0
    assert capsys.readouterr().out.strip().endswith(f"reports in {tmp_path}")
    assert [cmd[0] for cmd in launched] == [sys.executable] * 3
    names = [name for name, _ in GPU_SUITE] + ["gpt2-124m-tp2"]
    reports = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}
    assert [s["style"] for s in reports["gpt2-124m"]["styles"]] == ["gpt2"]
    assert [s["style"] for s in reports["llama-1b"]["styles"]] == ["llama"]
    assert reports["gpt2-124m"]["dtype"] == reports["llama-1b"]["dtype"] == reports["gpt2-124m-tp2"]["dtype"] == "bf16"
    assert reports["gpt2-124m-tp2"]["tp"] == 2 and reports["gpt2-124m-tp2"]["results"][0]["tokens_per_s"] > 0


@pytest.mark.parametrize("causal", [True, False])
def test_roofline_counts_the_attention_products(causal):
    """SDPA's fused kernel runs its products inside (no aten GEMM is dispatched): the recorder counts them, one per
    query head, 2 forward and 4 backward, at the share of the scores a causal mask keeps (s (s + 1) / 2 of s^2);
    an explicit mask keeps all of them. GQA: 4 query heads over 2 key/value heads."""
    import torch
    import torch.nn.functional as F

    from zoo.bench.compare import Trainee
    from zoo.bench.roofline import gemm_shapes

    b, heads, kv_heads, s, d = 2, 4, 2, 8, 4
    q = torch.nn.Parameter(torch.randn(b, heads, s, d))
    kv = torch.nn.Parameter(torch.randn(2, b, kv_heads, s, d))
    model = torch.nn.ParameterList([q, kv])
    mask = None if causal else torch.ones(s, s, dtype=torch.bool).tril()  # the same scores, but all computed

    def loss_of(ids, labels):
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, is_causal=causal,
                                              enable_gqa=True).square().sum()

    shapes = gemm_shapes(Trainee("sdpa", model, loss_of, 1e-3), None, None)
    share = s * (s + 1) / 2 / s**2 if causal else 1.0
    f32 = str(torch.float32)
    expected = {(b * heads, s, s, d, False, True, f32): 2 * share,  # S = Q K^T, dP = dO V^T
                (b * heads, s, d, s, False, False, f32): 2 * share,  # O = P V, dQ = dS K
                (b * heads, s, d, s, True, False, f32): 2 * share}  # dV = P^T dO, dK = dS^T Q
    assert shapes == pytest.approx(expected, rel=1e-12)
