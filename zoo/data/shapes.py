"""Procedural image datasets of simple shapes: segmentation (image + mask) and images alone (diffusion).

Sample ``i`` is a pure function of ``(seed, i)`` (NumPy's generator seeded with the pair), so any rank reads any
sample, every (tp, pp, dp) layout sees the same global batch, and a resumed run continues from its step alone, as
with ``zoo.data.synthetic``. Nothing is downloaded or stored; a 32x32 sample takes tens of microseconds.

An image: a background of a random colour with a linear gradient, then 1..``max_shapes`` filled shapes (circle,
square, equilateral triangle; random centre, size, rotation, colour clearly apart from the background), painted in
order so later shapes cover earlier ones, then Gaussian pixel noise; values in [-1, 1], ``[C, H, W]`` float32.
``centre_offset`` keeps the centres near the image's (0: centred; the flow diffusion example uses it with one size,
which a small model learns to draw within a few CPU minutes; anywhere, the default, needs far more training).
The mask ``[H, W]`` int64 holds, per pixel, the class of the shape visible there (:data:`CLASSES`; 0 = background).
A pixel belongs to a shape when its centre ``(x + 0.5, y + 0.5)`` lies inside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CLASSES = ("background", "circle", "square", "triangle")
KINDS = CLASSES[1:]


@dataclass(frozen=True)
class Shape:
    kind: str  # "circle" | "square" | "triangle"
    cx: float  # centre, in pixels from the top-left corner
    cy: float
    radius: float  # circle radius; square half-side; triangle circumradius
    angle: float  # rotation, radians (no effect on circles)
    color: tuple[float, ...]  # per channel, in [-1, 1]

    @property
    def label(self) -> int:
        return CLASSES.index(self.kind)


def shape_region(shape: Shape, height: int, width: int) -> np.ndarray:
    """Boolean ``[H, W]``: the pixels whose centre lies inside ``shape``."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64) + 0.5
    dx, dy = x - shape.cx, y - shape.cy
    r = shape.radius
    if shape.kind == "circle":
        return dx * dx + dy * dy <= r * r
    c, s = math.cos(shape.angle), math.sin(shape.angle)
    if shape.kind == "square":  # the point in the square's own frame
        return (np.abs(c * dx + s * dy) <= r) & (np.abs(-s * dx + c * dy) <= r)
    # Equilateral triangle: inside every edge's half-plane; edge k's outward normal points at angle + pi/3 + k 2pi/3
    # and the edge lies at the apothem, r/2, from the centre.
    inside = np.ones((height, width), dtype=bool)
    for k in range(3):
        a = shape.angle + math.pi / 3 + 2 * math.pi * k / 3
        inside &= dx * math.cos(a) + dy * math.sin(a) <= r / 2
    return inside


class ShapesSegmentation:
    """``ds[i] -> (image [channels, size, size] float32 in [-1, 1], mask [size, size] int64)``."""

    num_classes = len(CLASSES)

    def __init__(self, size: int = 32, *, seed: int = 0, length: int = 100_000, channels: int = 3,
                 max_shapes: int = 3, noise: float = 0.05, radius_range: tuple[float, float] = (0.12, 0.3),
                 centre_offset: float | None = None):
        """``radius_range``: the shapes' radius as [min, max] fractions of ``size``; ``centre_offset``: their centres
        at most this fraction of ``size`` from the image centre in x and y (0: centred), or anywhere (None) such that
        at least half the radius lies inside."""
        if size < 8:
            raise ValueError(f"shapes images need size >= 8, got {size}")
        if not 1 <= max_shapes:
            raise ValueError(f"max_shapes must be >= 1, got {max_shapes}")
        if centre_offset is not None and not 0 <= centre_offset <= 0.5:
            raise ValueError(f"centre_offset must be in [0, 0.5] (a fraction of the image side) or None, got "
                             f"{centre_offset}")
        self.size, self.seed, self.length, self.channels = size, seed, length, channels
        self.max_shapes, self.noise, self.radius_range = max_shapes, noise, radius_range
        self.centre_offset = centre_offset

    def __len__(self) -> int:
        return self.length

    def _rng(self, index: int) -> np.random.Generator:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for a dataset of {self.length} samples")
        return np.random.default_rng([self.seed, index])

    def _draw(self, index: int):
        """Background parameters and shapes, all from the sample's own generator (fixed order of draws)."""
        rng = self._rng(index)
        s, ch = self.size, self.channels
        base = rng.uniform(-0.6, 0.6, ch)
        gradient = rng.uniform(-0.3, 0.3, (2, ch))  # per channel, change across the image in y and x
        shapes = []
        for _ in range(rng.integers(1, self.max_shapes + 1)):
            kind = KINDS[rng.integers(len(KINDS))]
            radius = rng.uniform(*self.radius_range) * s
            if self.centre_offset is None:
                cx, cy = rng.uniform(0.5 * radius, s - 0.5 * radius, 2)
            else:  # the same number of draws: the rest of the sample does not depend on the option
                cx, cy = s / 2 + rng.uniform(-self.centre_offset, self.centre_offset, 2) * s
            angle = rng.uniform(0.0, 2 * math.pi)
            color = rng.uniform(-1.0, 1.0, ch)
            while np.abs(color - base).max() < 0.6:  # keep shapes visible against the background
                color = rng.uniform(-1.0, 1.0, ch)
            shapes.append(Shape(kind, float(cx), float(cy), float(radius), float(angle),
                                tuple(float(v) for v in color)))
        return rng, base, gradient, shapes

    def shapes(self, index: int) -> list[Shape]:
        """The shapes of sample ``index``, in the order they are painted."""
        return self._draw(index)[3]

    def __getitem__(self, index: int):
        rng, base, gradient, shapes = self._draw(index)
        s = self.size
        ramp = (np.arange(s) + 0.5) / s - 0.5  # [-0.5, 0.5) across the image
        image = base[:, None, None] + gradient[0][:, None, None] * ramp[None, :, None] \
            + gradient[1][:, None, None] * ramp[None, None, :]  # [C, H, W]
        mask = np.zeros((s, s), dtype=np.int64)
        for shape in shapes:
            region = shape_region(shape, s, s)
            image[:, region] = np.asarray(shape.color)[:, None]
            mask[region] = shape.label
        if self.noise > 0:
            image = image + rng.normal(0.0, self.noise, image.shape)
        image = np.clip(image, -1.0, 1.0).astype(np.float32)
        return torch.from_numpy(image), torch.from_numpy(mask)


class ShapesImages(ShapesSegmentation):
    """The same images without masks, for diffusion: ``ds[i] -> image [channels, size, size]`` in [-1, 1]."""

    def __getitem__(self, index: int):
        return super().__getitem__(index)[0]


def stack(dataset, indices) -> tuple[torch.Tensor, ...] | torch.Tensor:
    """Samples ``indices`` as one batch: ``[b, ...]`` tensors (a tuple for datasets returning pairs)."""
    samples = [dataset[i] for i in indices]
    if isinstance(samples[0], tuple):
        return tuple(torch.stack(parts) for parts in zip(*samples))
    return torch.stack(samples)


def write_folders(out, num: int, size: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """Write ``num`` samples as ``out/images/NNNNN.png`` and ``out/masks/NNNNN.png`` (the folder format that
    ``data.source: folders`` and ``launch/finetune.py --images --masks`` read)."""
    from zoo.data.image_folders import save_image, save_mask

    out = Path(out)
    images, masks = out / "images", out / "masks"
    images.mkdir(parents=True, exist_ok=True)
    masks.mkdir(parents=True, exist_ok=True)
    ds = ShapesSegmentation(size, seed=seed, length=num)
    for i in range(num):
        image, mask = ds[i]
        save_image(images / f"{i:05d}.png", image)
        save_mask(masks / f"{i:05d}.png", mask)
    return images, masks


def main(argv=None) -> int:
    from zoo.flags import Parser

    p = Parser(prog="python -m zoo.data.shapes",
               description="Write the procedural shapes segmentation data as image/mask PNG folders.")
    p.add_argument("--out", required=True, help="folder to create images/ and masks/ in")
    p.add_argument("--num", type=int, default=64, help="number of pairs (default 64)")
    p.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    p.add_argument("--seed", type=int, default=0, help="another seed gives other images (default 0)")
    args = p.parse_args(argv)
    images, masks = write_folders(args.out, args.num, args.size, args.seed)
    print(f"wrote {args.num} image/mask pairs to {images} and {masks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
