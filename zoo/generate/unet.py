"""A zoo U-Net folder as one plain module, and a grid of images sampled from a diffusion U-Net.

    python launch/generate.py --ckpt runs/unet-diffusion --out grid.png --num 16 --steps 250 --seed 0
    python -m zoo.generate.unet --ckpt runs/unet-diffusion --out grid.png       # the same, without the dispatch

:class:`PretrainedUNet` follows huggingface_hub's ``ModelHubMixin`` conventions: ``from_pretrained(folder)`` reads
``config.json`` and ``model.safetensors`` (or the sharded index) and ``save_pretrained(folder)`` writes them. The
folder is a zoo model folder (``zoo.convert.io``: ``config.json`` holds ``{"zoo_format", "family", "config"}``),
so what launch/train.py exports, in any layout, loads here and what this writes trains on with ``--init``.
Sampling follows the folder's ``scheduler_config.json`` (diffusers' format; what the training run's objective
wrote): DDPM's ancestral sampler (``zoo.models.unet.ddpm_sample``, Ho et al. 2020, Algorithm 2; ``--steps`` of the
1000 training timesteps, "leading" spacing, default 250) for a ``DDPMScheduler`` or a folder without one, and Euler
steps (``zoo.models.unet.flow_sample``, default 50) for a flow-matching model's ``FlowMatchEulerDiscreteScheduler``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from zoo.convert import io
from zoo.data.image_folders import grid_shape
from zoo.flags import Parser
from zoo.models.specs import SpecSequential
from zoo.models.unet import DIFFUSION_FAMILY, SEG_FAMILY


class PretrainedUNet(SpecSequential):
    """A segmentation or diffusion U-Net (``zoo.models.unet``) in one process, tp=1: the same layers, names and
    forward as in training. Segmentation: ``model(images) -> logits [b, classes, H, W]``; diffusion:
    ``model((x_t, timesteps)) -> predicted noise``."""

    def __init__(self, config):
        from zoo.models.gpt import ParallelOptions
        from zoo.models.unet import family_of, layer_specs

        super().__init__(layer_specs(config, ParallelOptions()))
        self.config, self.family = config, family_of(config)
        self.scheduler_config: dict | None = None  # diffusion: how it was trained (None: DDPM)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, *, device=None,
                        dtype: torch.dtype = torch.float32) -> PretrainedUNet:
        """Load a zoo U-Net folder (or a run folder with ``model/``) on ``device`` (default CPU), in eval mode."""
        from zoo.models.unet import config_from_dict

        folder = io.resolve_model_folder(folder)
        family, config = io.read_config(folder)
        try:
            model = cls(config_from_dict(family, config))
        except ValueError as e:
            raise io.CheckpointError(f"{folder}: {e}") from None
        io.load_model(folder, model)
        if model.family == DIFFUSION_FAMILY:
            model.scheduler_config = read_scheduler_config(folder)
        return model.to(device=device or "cpu", dtype=dtype).eval()

    @property
    def objective(self) -> str | None:
        """Diffusion U-Nets: ``"ddpm"`` or ``"flow"``, from the scheduler config; None for segmentation."""
        from zoo.models.unet import objective_of

        if self.family != DIFFUSION_FAMILY:
            return None
        return objective_of(self.scheduler_config)

    def save_pretrained(self, folder: str | os.PathLike) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (a zoo model folder), replacing ``folder`` once complete."""
        import json

        from zoo.models.unet import SCHEDULER_CONFIG

        tensors = ((name, p.detach().cpu().contiguous()) for name, p in self.named_parameters())
        extra = {SCHEDULER_CONFIG: json.dumps(self.scheduler_config, indent=2)} if self.scheduler_config else None
        return io.write_model_folder(folder, self.family, self.config.to_dict(), tensors, extra_files=extra)

    @torch.no_grad()
    def segment(self, images: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
        """Per-pixel classes ``[b, H, W]`` int64 of ``images [b, C, H, W]`` in [-1, 1] (segmentation U-Nets)."""
        if self.family != SEG_FAMILY:
            raise ValueError(f"segment() needs a segmentation U-Net, this is {self.family}")
        dtype = next(self.parameters()).dtype
        return torch.cat([self(chunk.to(dtype)).argmax(1) for chunk in images.split(batch_size)])

    @torch.no_grad()
    def sample(self, num: int, *, steps: int | None = None, seed: int = 0, batch_size: int = 64) -> torch.Tensor:
        """``num`` images ``[num, C, H, W]`` in [-1, 1] by the sampler of the model's objective (diffusion U-Nets):
        DDPM's ancestral chain (``steps`` default 250) or flow matching's Euler steps (default 50). Deterministic
        in ``seed``; drawn ``batch_size`` at a time (batch k seeded ``seed + k``)."""
        from zoo.models.unet import default_sample_steps, schedule_from_config

        if self.family != DIFFUSION_FAMILY:
            raise ValueError(f"sample() needs a diffusion U-Net, this is {self.family}")
        schedule = schedule_from_config(self.scheduler_config)
        steps = steps or default_sample_steps(self.objective)
        h, w = self.config.sizes
        dtype = next(self.parameters()).dtype
        model_fn = lambda x, t: self((x.to(dtype), t)).float()  # noqa: E731
        out = []
        for k, first in enumerate(range(0, num, batch_size)):
            n = min(batch_size, num - first)
            out.append(schedule.sample(model_fn, (n, self.config.in_channels, h, w), seed=seed + k,
                                       num_inference_steps=steps))
        return torch.cat(out)


def read_scheduler_config(folder: str | os.PathLike) -> dict | None:
    """The diffusers scheduler config beside a diffusion model (None: there is none, the model is DDPM's);
    :class:`zoo.convert.io.CheckpointError` when it is unreadable or names a sampler zoo does not implement."""
    import json

    from zoo.models.unet import SCHEDULER_CONFIG, schedule_from_config

    path = Path(folder) / SCHEDULER_CONFIG
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
        schedule_from_config(config)
    except ValueError as e:
        raise io.CheckpointError(f"{path}: {e}") from None
    return config


def image_grid(images: torch.Tensor, cols: int | None = None, pad: int = 2, scale: int = 1):
    """``[n, C, H, W]`` in [-1, 1] -> one uint8 ``[rows (H + pad) + pad, cols (W + pad) + pad, 3]`` array,
    tiles in row-major order on a white background, each pixel repeated ``scale`` times."""
    import numpy as np

    n, c, h, w = images.shape
    rows, cols = grid_shape(n) if cols is None else ((n + cols - 1) // cols, cols)
    tiles = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    tiles = tiles.repeat(1, 3, 1, 1) if c == 1 else tiles[:, :3]
    tiles = tiles.repeat_interleave(scale, 2).repeat_interleave(scale, 3)  # [n, 3, sH, sW]
    h, w = h * scale, w * scale
    canvas = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 255, dtype=np.uint8)
    for i in range(n):
        r, q = divmod(i, cols)
        y, x = pad + r * (h + pad), pad + q * (w + pad)
        canvas[y:y + h, x:x + w] = tiles[i].permute(1, 2, 0).numpy()
    return canvas


def save_grid(path: str | os.PathLike, images: torch.Tensor, *, scale: int | None = None) -> Path:
    """Write :func:`image_grid` as a PNG; small images are enlarged (nearest) to about 64 pixels a tile."""
    from PIL import Image

    scale = scale or max(1, 64 // max(images.shape[-2:]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image_grid(images, scale=scale)).save(path)
    return path


def parse_args(argv=None):
    p = Parser(prog="python -m zoo.generate.unet",
               description="Sample a PNG grid of images from a zoo diffusion U-Net folder (DDPM "
                                            "ancestral sampling or flow matching's Euler steps, as the folder's "
                                            "scheduler_config.json says; one process).")
    p.add_argument("--ckpt", required=True, metavar="DIR",
                   help="a zoo unet-diffusion model folder, or a run folder holding model/")
    p.add_argument("--out", required=True, metavar="GRID.png", help="where to write the grid")
    p.add_argument("--num", type=int, default=16, help="images to sample (default 16)")
    p.add_argument("--steps", type=int, default=None,
                   help="sampling steps, 1..1000 (default: 250 DDPM steps, 50 is 5x faster and skews a small model's "
                        "colours; a flow-matching model: 50 Euler steps)")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same images (default 0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.num < 1:
        print(f"error: --num must be >= 1, got {args.num}", file=sys.stderr)
        return 2
    if args.steps is not None and not 1 <= args.steps <= 1000:
        print(f"error: --steps must be in [1, 1000] (of the 1000 training timesteps), got {args.steps}",
              file=sys.stderr)
        return 2
    try:
        model = PretrainedUNet.from_pretrained(args.ckpt)
        if model.family != DIFFUSION_FAMILY:
            raise io.CheckpointError(f"{args.ckpt} holds a {model.family!r} model; sampling needs a {DIFFUSION_FAMILY} "
                                     f"folder")
    except io.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from zoo.models.unet import default_sample_steps

    steps = args.steps or default_sample_steps(model.objective)
    path = save_grid(args.out, model.sample(args.num, steps=steps, seed=args.seed))
    what = "Euler (flow matching)" if model.objective == "flow" else "DDPM"
    print(f"wrote {path} ({args.num} images, {steps} {what} steps, seed {args.seed})")
    return 0


# zoo.generate's tables: the class load_model returns; the command of launch/generate.py (a segmentation U-Net has
# none of its own: its folders go to the GPT's, which refuses them in one line).
PRETRAINED = {SEG_FAMILY: PretrainedUNet, DIFFUSION_FAMILY: PretrainedUNet}
COMMANDS = {SEG_FAMILY: None, DIFFUSION_FAMILY: main}

if __name__ == "__main__":
    sys.exit(main())
