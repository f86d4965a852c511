"""Image folders for the U-Nets: image/mask pairs (segmentation) and images alone (diffusion), read with Pillow.

    images/  cat_001.jpg  cat_002.png ...     any format Pillow reads (PNG, JPEG, BMP, TIFF, WebP, GIF)
    masks/   cat_001.png  cat_002.png ...     one class index per pixel: a grayscale or palette PNG (0 = background)

An image and its mask are paired by file stem (``cat_001``), so their formats may differ. Images become
``[C, H, W]`` float32 in [-1, 1] (Pillow's RGB or L conversion, C = the model's ``in_channels``), masks ``[H, W]``
int64. Everything is checked up front by :meth:`ImageMaskFolders.check` (every file opened once): names that do not
pair up, masks whose size differs from their image's, labels the model has no class for, images of different sizes
(a batch needs one size), or sizes the U-Net cannot halve depth-1 times. Each problem is one line naming the first
offending files.

Sample ``i`` is a pure function of ``i`` (as ``zoo.data.shapes``): the index space repeats the folder epoch after
epoch, each epoch in its own seeded order, with a seeded horizontal flip when ``augment``; so every (tp, pp, dp)
layout reads the same global batch and a resumed run continues from its step alone. Decoded files are cached.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
MASK_MODES = ("1", "L", "P", "I", "I;16")  # Pillow modes whose pixel values are class indices
CACHE_ITEMS = 4096  # decoded samples kept in memory per dataset (a 256x256 RGB image is 0.8 MB as float32)


class ImageFolderError(ValueError):
    """A folder that cannot be used; the message is one line naming the files and what to do."""


def _few(names: list[str], n: int = 3) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" (+{len(names) - n} more)" if len(names) > n else "")


def list_images(folder: str | os.PathLike, what: str = "image") -> dict[str, Path]:
    """Stem -> file of the image files directly in ``folder`` (sorted by stem)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ImageFolderError(f"{what} folder {folder} does not exist")
    found: dict[str, Path] = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."):
            if p.stem in found:
                raise ImageFolderError(f"{what} folder {folder} holds two files named {p.stem}: "
                                       f"{found[p.stem].name} and {p.name}; keep one")
            found[p.stem] = p
    if not found:
        raise ImageFolderError(f"{what} folder {folder} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
    return found


def match_pairs(images_dir: str | os.PathLike, masks_dir: str | os.PathLike) -> list[tuple[str, Path, Path]]:
    """``(stem, image file, mask file)`` for every stem in both folders; any file without a partner is an error."""
    images, masks = list_images(images_dir, "image"), list_images(masks_dir, "mask")
    lone_images = sorted(set(images) - set(masks))
    lone_masks = sorted(set(masks) - set(images))
    if lone_images or lone_masks:
        parts = []
        if lone_images:
            parts.append(f"{len(lone_images)} image(s) in {images_dir} without a mask: "
                         f"{_few([images[s].name for s in lone_images])}")
        if lone_masks:
            parts.append(f"{len(lone_masks)} mask(s) in {masks_dir} without an image: "
                         f"{_few([masks[s].name for s in lone_masks])}")
        raise ImageFolderError("image and mask folders do not pair up by file name (stem): " + "; ".join(parts) +
                               "; every image needs a mask of the same name")
    return [(s, images[s], masks[s]) for s in sorted(images)]


def _open(path: Path):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(path)
        img.load()
    except (OSError, UnidentifiedImageError) as e:
        raise ImageFolderError(f"cannot read {path}: {e}") from None
    return img


def read_image(path: str | os.PathLike, channels: int = 3) -> torch.Tensor:
    """``[C, H, W]`` float32 in [-1, 1]; C = 3 (RGB) or 1 (grayscale)."""
    if channels not in (1, 3):
        raise ImageFolderError(f"image files give 1 (grayscale) or 3 (RGB) channels, the model has in_channels "
                               f"{channels}")
    img = _open(Path(path)).convert("RGB" if channels == 3 else "L")
    a = np.asarray(img, dtype=np.float32) / 127.5 - 1.0  # [H, W, C] or [H, W]
    a = a[:, :, None] if a.ndim == 2 else a
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))


def read_mask(path: str | os.PathLike) -> torch.Tensor:
    """``[H, W]`` int64 class indices. A colour (RGB) mask is accepted only when its three channels are equal."""
    img = _open(Path(path))
    if img.mode in MASK_MODES:
        a = np.asarray(img)
    else:
        a = np.asarray(img.convert("RGB"))
        if not (np.array_equal(a[..., 0], a[..., 1]) and np.array_equal(a[..., 0], a[..., 2])):
            raise ImageFolderError(f"mask {path} is a colour image (mode {img.mode}); store one class index per pixel "
                                   f"as a grayscale or palette PNG")
        a = a[..., 0]
    return torch.from_numpy(a.astype(np.int64))


def image_size(path: str | os.PathLike) -> tuple[int, int]:
    """``(H, W)`` from the file header alone."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            w, h = img.size
    except (OSError, UnidentifiedImageError) as e:
        raise ImageFolderError(f"cannot read {path}: {e}") from None
    return h, w


def check_halvable(path: Path, size: tuple[int, int], depth: int) -> None:
    multiple = 2 ** (depth - 1)
    if any(s % multiple for s in size):
        raise ImageFolderError(f"image {path} is {size[0]}x{size[1]} (HxW): the U-Net's {depth} levels halve it "
                               f"{depth - 1} time(s), so height and width must be multiples of {multiple}; "
                               f"resize or crop the images")


def split_stems(stems: list[str], valid_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, valid): a seeded ``valid_fraction`` of the stems held out (at least one when the fraction is > 0,
    and at least one left for training)."""
    if valid_fraction <= 0 or len(stems) < 2:
        return list(stems), []
    n_valid = min(len(stems) - 1, max(1, round(valid_fraction * len(stems))))
    order = np.random.default_rng([seed, 7]).permutation(len(stems))
    held = {stems[i] for i in order[:n_valid]}
    return [s for s in stems if s not in held], [s for s in stems if s in held]


class _Indexed:
    """The epoch-by-epoch index space over ``n`` files, and a small cache of decoded ones."""

    def __init__(self, n: int, seed: int, shuffle: bool, augment: bool):
        self.n, self.seed, self.shuffle, self.augment = n, seed, shuffle, augment
        self._epoch, self._order = -1, None
        self._cache: dict[int, object] = {}

    def __len__(self) -> int:
        return self.n

    def position(self, index: int) -> tuple[int, bool]:
        """(file position, flip) of global sample ``index``."""
        if index < 0:
            raise IndexError(f"sample index {index} is negative")
        epoch, k = divmod(index, self.n)
        if self.shuffle:
            if epoch != self._epoch:
                self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n)
            k = int(self._order[k])
        flip = self.augment and bool(np.random.default_rng([self.seed, index, 1]).integers(2))
        return k, flip

    def cached(self, k: int, load):
        if k not in self._cache:
            if len(self._cache) >= CACHE_ITEMS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[k] = load(k)
        return self._cache[k]


class ImageMaskFolders(_Indexed):
    """``ds[i] -> (image [C, H, W] float32 in [-1, 1], mask [H, W] int64)``; ``stems`` restricts to a subset."""

    def __init__(self, images_dir, masks_dir, *, channels: int = 3, seed: int = 0, stems: list[str] | None = None,
                 shuffle: bool = True, augment: bool = False):
        pairs = match_pairs(images_dir, masks_dir)
        if stems is not None:
            keep = set(stems)
            pairs = [p for p in pairs if p[0] in keep]
        self.pairs, self.channels = pairs, channels
        self.images_dir, self.masks_dir = Path(images_dir), Path(masks_dir)
        super().__init__(len(pairs), seed, shuffle, augment)

    @property
    def stems(self) -> list[str]:
        return [s for s, _, _ in self.pairs]

    @property
    def size(self) -> tuple[int, int]:
        """``(H, W)`` of the first image (:meth:`check` makes sure they all agree)."""
        return image_size(self.pairs[0][1])

    def check(self, classes: int, depth: int) -> tuple[int, int]:
        """Open every file; one-line :class:`ImageFolderError` for the first problem. Returns ``(H, W)``."""
        first = None
        for _stem, img_path, mask_path in self.pairs:
            size = image_size(img_path)
            if first is None:
                first = (img_path, size)
                check_halvable(img_path, size, depth)
            elif size != first[1]:
                raise ImageFolderError(f"images differ in size: {first[0].name} is {first[1][0]}x{first[1][1]}, "
                                       f"{img_path.name} is {size[0]}x{size[1]} (HxW); a batch needs one size, so "
                                       f"resize or crop them to one")
            mask = read_mask(mask_path)
            if tuple(mask.shape) != size:
                raise ImageFolderError(f"mask {mask_path} is {mask.shape[0]}x{mask.shape[1]} but its image "
                                       f"{img_path.name} is {size[0]}x{size[1]} (HxW)")
            top = int(mask.max())
            if top >= classes:
                raise ImageFolderError(f"mask {mask_path} holds label {top}, but the model has classes {classes} "
                                       f"(labels 0..{classes - 1}); set model.classes >= {top + 1} or fix the mask")
        return first[1]

    def _load(self, k: int):
        _, img_path, mask_path = self.pairs[k]
        return read_image(img_path, self.channels), read_mask(mask_path)

    def __getitem__(self, index: int):
        k, flip = self.position(index)
        image, mask = self.cached(k, self._load)
        if flip:
            image, mask = image.flip(-1), mask.flip(-1)
        return image, mask


class ImageFolder(_Indexed):
    """``ds[i] -> image [C, H, W]`` float32 in [-1, 1] (diffusion); ``stems`` restricts to a subset."""

    def __init__(self, images_dir, *, channels: int = 3, seed: int = 0, stems: list[str] | None = None,
                 shuffle: bool = True, augment: bool = False):
        files = list_images(images_dir, "image")
        if stems is not None:
            files = {s: files[s] for s in stems}
        self.files, self.channels = list(files.values()), channels
        super().__init__(len(self.files), seed, shuffle, augment)

    @property
    def stems(self) -> list[str]:
        return [p.stem for p in self.files]

    @property
    def size(self) -> tuple[int, int]:
        return image_size(self.files[0])

    def check(self, depth: int) -> tuple[int, int]:
        first = None
        for path in self.files:
            size = image_size(path)
            if first is None:
                first = (path, size)
                check_halvable(path, size, depth)
            elif size != first[1]:
                raise ImageFolderError(f"images differ in size: {first[0].name} is {first[1][0]}x{first[1][1]}, "
                                       f"{path.name} is {size[0]}x{size[1]} (HxW); a batch needs one size, so "
                                       f"resize or crop them to one")
        return first[1]

    def __getitem__(self, index: int):
        k, flip = self.position(index)
        image = self.cached(k, lambda k: read_image(self.files[k], self.channels))
        return image.flip(-1) if flip else image


def save_image(path: str | os.PathLike, image: torch.Tensor) -> None:
    """Write ``[C, H, W]`` in [-1, 1] (C = 1 or 3) as an 8-bit PNG."""
    from PIL import Image

    a = ((image.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(a[..., 0] if a.shape[2] == 1 else a).save(path)


def save_mask(path: str | os.PathLike, mask: torch.Tensor) -> None:
    """Write ``[H, W]`` class indices (< 256) as a grayscale PNG."""
    from PIL import Image

    if int(mask.max()) > 255 or int(mask.min()) < 0:
        raise ValueError("save_mask: labels must be in [0, 255]")
    Image.fromarray(mask.to(torch.uint8).numpy()).save(path)  # uint8 [H, W]: mode L


def grid_shape(n: int) -> tuple[int, int]:
    """(rows, cols) of a near-square grid holding ``n`` tiles."""
    cols = math.ceil(math.sqrt(n))
    return math.ceil(n / cols), cols
