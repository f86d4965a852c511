"""Convert models between HuggingFace and zoo, and check a conversion at any (tp, pp).

    python launch/convert.py hf-to-zoo --src HF_FOLDER_OR_HUB_ID --out models/NAME [--dtype bf16] [--allow-pickle]
    python launch/convert.py zoo-to-hf --src models/NAME --out hf/NAME
    torchrun --nproc_per_node 4 launch/convert.py verify --hf HF --zoo models/NAME --tp 2 --pp 2

See zoo/convert/cli.py for every option.
"""

import sys

from zoo.cli import convert

if __name__ == "__main__":
    sys.exit(convert())
