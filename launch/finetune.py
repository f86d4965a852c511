"""Fine-tune the model in --init: a GPT on instruction jsonl, a BERT classifier on csv/jsonl, a segmentation U-Net on
image/mask folders; one process, `torchrun --nproc_per_node N`, or `deepspeed --num_gpus N`.

    python launch/finetune.py --init runs/gpt-tiny/model --data instruct.jsonl
    torchrun --nproc_per_node 2 launch/finetune.py --init HF_FOLDER --data train.jsonl --tp 2 --out runs/sft
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoo.progress import no_bars_in_logs  # noqa: E402

no_bars_in_logs()  # in a log file no \r-drawn bars: before any library imports tqdm

from zoo.dispatch import finetune_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
