"""Train a zoo model: one process, `torchrun --nproc_per_node N`, or `deepspeed --num_gpus N`.

    python launch/train.py                                   # the main job (configs/gpt/main.yaml)
    python launch/train.py --config configs/gpt/tiny.yaml
    torchrun --nproc_per_node 4 launch/train.py --config configs/gpt/tiny-llama.yaml --tp 2 --pp 2
"""

import sys

from zoo.cli import train

if __name__ == "__main__":
    sys.exit(train())
