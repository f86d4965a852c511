"""Generate from a zoo model folder: text from a GPT (one process, or `torchrun --nproc_per_node T ... --tp T`), or a
PNG grid of images from a diffusion U-Net (`--ckpt DIR --out grid.png`).

    python launch/generate.py --ckpt runs/tiny/model --prompt "Once upon a time" --max-new-tokens 64
    torchrun --nproc_per_node 2 launch/generate.py --tp 2 --ckpt DIR --prompt "..." --temperature 0.8 --top-p 0.9
"""

import sys

from zoo.cli import generate

if __name__ == "__main__":
    sys.exit(generate())
