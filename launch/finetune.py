"""Fine-tune the model in --init: a GPT on instruction jsonl, a BERT classifier on csv/jsonl, a segmentation U-Net on
image/mask folders; one process, `torchrun --nproc_per_node N`, or `deepspeed --num_gpus N`.

    python launch/finetune.py --init runs/gpt-tiny/model --data instruct.jsonl
    torchrun --nproc_per_node 2 launch/finetune.py --init HF_FOLDER --data train.jsonl --tp 2 --out runs/sft
"""

import sys

from zoo.cli import finetune

if __name__ == "__main__":
    sys.exit(finetune())
