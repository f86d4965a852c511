"""Train a zoo model: one process, `torchrun --nproc_per_node N`, or `deepspeed --num_gpus N`.

    python launch/train.py                                   # the main job (configs/gpt/main.yaml)
    python launch/train.py --config configs/gpt/tiny.yaml
    torchrun --nproc_per_node 4 launch/train.py --config configs/gpt/tiny-llama.yaml --tp 2 --pp 2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoo.progress import no_bars_in_logs  # noqa: E402

no_bars_in_logs()  # in a log file no \r-drawn bars: before any library imports tqdm

from zoo.training.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
