"""``launch/benchmark.py --gpu-suite``: every GPU benchmark in one command, each in a process of its own."""

from __future__ import annotations

import sys
import time
from pathlib import Path

GPU_SUITE = [  # (name, argument list): about 2-3 minutes each on one H200
    ("gpt2-124m", ["--preset", "gpt2-124m", "--dtype", "bf16"]),
    ("llama-1b", ["--preset", "llama-1b", "--dtype", "bf16", "--batch-size", "4", "--seq-length", "2048"]),
]


def gpu_suite(args, accel) -> int:
    """Every GPU benchmark in its own process (a fresh allocator and compile cache each), then one summary."""
    import subprocess

    if accel.device_name() == "cpu":
        print("error: --gpu-suite needs a GPU and deepspeed.accelerator finds only the CPU here; run it on a GPU "
              "machine (python launch/benchmark.py --gpu-suite)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).resolve().parents[2] / "launch" / "benchmark.py")
    runs = [(name, [sys.executable, script, *extra, "--json", str(out / f"{name}.json")]) for name, extra in GPU_SUITE]
    if accel.device_count() >= 2:
        runs.append(("gpt2-124m-tp2", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script,
                                       "--preset", "gpt2-124m", "--dtype", "bf16", "--tp", "2", "--json",
                                       str(out / "gpt2-124m-tp2.json")]))
    else:
        print("note: one GPU here: the --tp 2 run needs two and is skipped", flush=True)
    failed = []
    for name, cmd in runs:
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        if subprocess.run(cmd).returncode != 0:
            failed.append(name)
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)
    print(f"reports in {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
