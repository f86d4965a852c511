"""Predict the memory and speed of every parallel layout of a GPT model on a cluster (zoo/plan).

    python launch/plan.py --model llama-7b --gpu h100 --gpus 64 --seq-length 4096 --global-batch 512
    python launch/plan.py --model gpt2-1.5b --gpu a100-40g --gpus 8 --global-batch 64 --write-config plan.yaml
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # arithmetic only: no device is touched, so none is looked for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoo.progress import no_bars_in_logs  # noqa: E402

no_bars_in_logs()  # in a log file no \r-drawn bars: before any library imports tqdm

from zoo.plan.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
