"""Every entry point that succeeded exits 0, every time: launch/convert.py verify,
launch/generate.py and a 2-step launch/train.py, 20 plain-process runs each, two at a time. Seen before the fix:
about 1 run in 15 printed its result and then aborted with "terminate called without an active exception" (gloo
threads alive at interpreter exit; tests/parallel/test_topology.py probes the cause).

Run by .ci/run after the test suite (a few minutes, too long for the suite's budget):
    python .ci/clean_exits.py
Prints the count of non-zero exits per command and exits 1 if there was any.
"""

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# launch/*.py import this checkout's zoo, ahead of any installed copy
PYTHONPATH = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
RUNS = 20
SMALL = ["--set", "data.source=synthetic", "training.seq_length=32", "training.micro_batch_size=2",
         "training.global_batch_size=2"]


def run(cmd) -> tuple[int, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH))
    return proc.returncode, (proc.stdout + proc.stderr)[-1500:]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train = [sys.executable, str(ROOT / "launch/train.py"), "--config", str(ROOT / "configs/gpt/tiny.yaml"),
                 "--steps", "2", "--no-sample"]
        base = ["--set", "training.seq_length=32", "training.micro_batch_size=2", "training.global_batch_size=2"]
        for cmd in (train + ["--out", str(tmp / "base"), *base],  # the embedded corpus: a tokenizer to generate with
                    [sys.executable, str(ROOT / "launch/convert.py"), "zoo-to-hf", "--src", str(tmp / "base/model"),
                     "--out", str(tmp / "hf")]):
            code, out = run(cmd)
            if code:
                print(out)
                return 1
        commands = {
            "verify": [sys.executable, str(ROOT / "launch/convert.py"), "verify", "--hf", str(tmp / "hf"), "--zoo",
                       str(tmp / "base/model")],
            "generate": [sys.executable, str(ROOT / "launch/generate.py"), "--ckpt", str(tmp / "base/model"),
                         "--prompt", "The", "--max-new-tokens", "8"],
            "train": train + ["--out", str(tmp / "again{i}"), *SMALL, "training.save=false"],
        }
        jobs = [(name, [a.format(i=i) for a in cmd]) for name, cmd in commands.items() for i in range(RUNS)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(lambda job: (job[0], *run(job[1])), jobs))
    bad = 0
    for name in commands:
        failed = [(code, out) for n, code, out in results if n == name and code != 0]
        bad += len(failed)
        print(f"{name}: {RUNS - len(failed)}/{RUNS} runs exited 0" +
              (f"; exit codes {sorted(c for c, _ in failed)}; last output:\n{failed[-1][1]}" if failed else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
