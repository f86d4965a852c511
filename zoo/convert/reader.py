"""Reading checkpoints tensor by tensor: an HF folder's weights (:class:`HFCheckpoint`) and a zoo folder's headers,
and checking them against a key table before a byte is written.

Names and shapes come from the file headers; values are read on demand, one conversion group at a time, each
safetensors file mapped only while it is read (``io.read_tensors``), so memory stays near one block.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from zoo.convert import io
from zoo.convert.errors import ConvertError
from zoo.convert.hub import PICKLE_INDEX, PICKLE_SINGLE, SAFE_INDEX, SAFE_SINGLE
from zoo.convert.tables import Row

# Copy tensors out of a safetensors file without pinning its memory map (see io.read_tensors).
read_safetensors = io.read_tensors


def header_shapes(folder: Path, files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every safetensors file ``files`` names (read from the headers only)."""
    shapes = {}
    for fname in sorted(set(files.values())):
        if not (folder / fname).is_file():
            raise ConvertError(f"{folder / fname} is listed in the index but missing")
        with safe_open(folder / fname, "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


class HFCheckpoint:
    """The weights of a HF folder: names and shapes from the file headers, values read on demand.

    safetensors only, unless ``allow_pickle`` (then ``torch.load(weights_only=True)``, which unpickles tensors
    and plain containers only).
    """

    def __init__(self, folder: Path, allow_pickle: bool = False):
        self.folder, self.pickled = folder, False
        self.files: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._loaded: dict[str, dict] = {}
        if (folder / SAFE_INDEX).is_file():
            self.files = dict(json.loads((folder / SAFE_INDEX).read_text())["weight_map"])
        elif (folder / SAFE_SINGLE).is_file():
            with safe_open(folder / SAFE_SINGLE, "pt") as f:
                self.files = {k: SAFE_SINGLE for k in f.keys()}
        elif (folder / PICKLE_INDEX).is_file() or (folder / PICKLE_SINGLE).is_file():
            if not allow_pickle:
                raise ConvertError(f"{folder} holds only a pickle checkpoint ({PICKLE_SINGLE}), which can run code "
                                   f"when loaded; convert it to safetensors, or pass --allow-pickle if you trust it")
            self.pickled = True
            if (folder / PICKLE_INDEX).is_file():
                self.files = dict(json.loads((folder / PICKLE_INDEX).read_text())["weight_map"])
            else:
                self.files = {k: PICKLE_SINGLE for k in self._load(PICKLE_SINGLE)}
        else:
            raise ConvertError(f"{folder} has no weights ({SAFE_SINGLE}, {SAFE_INDEX} or {PICKLE_SINGLE})")
        if self.pickled:
            for fname in sorted(set(self.files.values())):
                if not (folder / fname).is_file():
                    raise ConvertError(f"{folder / fname} is listed in the index but missing")
                self.shapes.update({k: tuple(v.shape) for k, v in self._load(fname).items()})
        else:
            self.shapes = header_shapes(folder, self.files)

    def _load(self, fname: str) -> dict:
        if fname not in self._loaded:
            path = self.folder / fname
            try:
                try:
                    self._loaded[fname] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                    self._loaded[fname] = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # weights_only refuses anything but tensors and plain containers
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ConvertError(f"{path} could not be read with torch.load(weights_only=True): {first}") from None
        return self._loaded[fname]

    def read(self, keys) -> dict[str, torch.Tensor]:
        """The tensors named by ``keys``, copied out of their files (see :func:`read_safetensors`)."""
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.files[k], []).append(k)
        out = {}
        for fname, names in by_file.items():
            if self.pickled:
                out.update({k: self._load(fname)[k].clone() for k in names})
            else:
                out.update(read_safetensors(self.folder / fname, names))
        return out


def check_shapes(rows: list[Row], shapes: dict[str, tuple], where: str) -> None:
    """Every HF tensor the rows read is in the checkpoint, in the shape the config implies."""
    for row in rows:
        for key, expected in zip(row.hf, row.hf_shapes):
            if key not in shapes:
                raise ConvertError(f"tensor {key} is missing from {where}")
            if tuple(shapes[key]) != tuple(expected):
                raise ConvertError(f"tensor {key}: checkpoint has shape {tuple(shapes[key])}, config.json implies "
                                   f"{tuple(expected)}")


def streamed_groups(ckpt, groups: list[list[Row]], dtype: torch.dtype | None):
    """``(zoo key, tensor)`` of every row, read from ``ckpt`` one group at a time (so memory holds one block)."""
    for group in groups:
        values = ckpt.read([k for r in group for k in r.hf])
        for row in group:
            t = row.to_zoo(*(values.pop(k) for k in row.hf))
            yield row.zoo, t if dtype is None else t.to(dtype)


def read_zoo_config(folder) -> tuple[str, dict]:
    """``io.read_config`` with its refusal as a ConvertError."""
    try:
        return io.read_config(folder)
    except io.CheckpointError as e:
        raise ConvertError(str(e)) from None


def zoo_weights(src: Path) -> tuple[dict[str, str], dict[str, tuple]]:
    """``(tensor -> file, tensor -> shape)`` of a zoo model folder, the shapes from the safetensors headers."""
    try:
        files = io.weight_map(src)
    except io.CheckpointError as e:
        raise ConvertError(str(e)) from None
    return files, header_shapes(Path(src), files)


def check_zoo_rows(groups: list[list[Row]], shapes: dict[str, tuple], src: Path) -> None:
    """Every zoo tensor the rows export is in the folder, in the shape its config implies."""
    for row in (r for g in groups for r in g):
        if row.zoo not in shapes:
            raise ConvertError(f"tensor {row.zoo} is missing from {src}")
        if shapes[row.zoo] != row.zoo_shape():
            raise ConvertError(f"tensor {row.zoo}: checkpoint has shape {shapes[row.zoo]}, its config implies "
                               f"{row.zoo_shape()}")
