"""A long run stays flat: 2,000 steps of the tiny GPT in one process; resident memory after step 200 (warm-up done)
must not grow by 2% or more (no leak from metrics, caches, data loaders or TensorBoard).

Run by .ci/run after the test suite (it takes about a minute, too long for the suite's budget):
    python .ci/long_run_memory.py
Prints the resident memory at steps 200, 1000 and 2000 and exits 1 when it grew.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# launch/*.py import this checkout's zoo, ahead of any installed copy
PYTHONPATH = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
STEPS, WARM, LIMIT = 2000, 200, 0.02


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, str(ROOT / "launch/train.py"), "--config", str(ROOT / "configs/gpt/tiny.yaml"),
               "--steps", str(STEPS), "--no-sample", "--out", str(out), "--set", "data.source=synthetic",
               "training.save=false", "training.eval_interval=0", "training.seq_length=32",
               "training.micro_batch_size=2", "training.global_batch_size=2", f"training.log_interval={STEPS}"]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH))
        if proc.returncode != 0:
            print(proc.stdout[-2000:] + proc.stderr[-3000:])
            return 1
        rss = {r["step"]: r["rss_gb"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if "rss_gb" in r}
    base = rss[WARM]
    worst = max(v for s, v in rss.items() if s > WARM)
    growth = worst / base - 1
    print(f"resident memory: step {WARM} {base * 1024:.1f} MiB, step {STEPS // 2} {rss[STEPS // 2] * 1024:.1f} MiB, "
          f"step {STEPS} {rss[STEPS] * 1024:.1f} MiB; largest after step {WARM}: +{100 * growth:.2f}% "
          f"(limit {100 * LIMIT:.0f}%)")
    return 0 if growth < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
