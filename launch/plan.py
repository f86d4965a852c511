"""Predict the memory and speed of every parallel layout of a GPT model on a cluster (zoo/plan).

    python launch/plan.py --model llama-7b --gpu h100 --gpus 64 --seq-length 4096 --global-batch 512
    python launch/plan.py --model gpt2-1.5b --gpu a100-40g --gpus 8 --global-batch 64 --write-config plan.yaml
"""

import sys

from zoo.cli import plan

if __name__ == "__main__":
    sys.exit(plan())
