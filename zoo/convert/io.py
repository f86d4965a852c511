"""The layout-free zoo model checkpoint: one folder, readable into any (tp, pp) layout.

    config.json                     {"zoo_format": 1, "family": "gpt", "config": {<the model config's fields>}}
    model.safetensors               every tensor full (as at tp=1), vocabulary unpadded, keys as in the state dict
                                    of ``SpecSequential`` / ``PipelineModule`` ("3.attention.qkv.weight", ...)
      or model-*.safetensors + model.safetensors.index.json   (sharded; the index is HuggingFace's format)
    tokenizer files                 optional, copied beside (AutoTokenizer.from_pretrained(folder) reads them)

Writing (:func:`save_model`): each TP group gathers its shards (``zoo.parallel.shards``), and one rank per pipeline
stage writes that stage's tensors; a tensor tied across stages is written once. The folder is built under a
temporary name and moved into place at the end, so a crash never leaves a half-written model under the final name.

Reading (:func:`load_model`): every rank opens the safetensors files lazily and reads only the rows or columns of
each tensor its shard holds (``safe_open(...).get_slice``), so memory stays at this rank's share of the model.
Vocabulary rows beyond ``vocab_size`` (padding to a multiple of 128 x tp) are zero.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zoo.parallel.shards import barrier, full_tensor, gather_objects, global_rank, is_sharded, shard_ranges
from zoo.parallel.topology import group_rank_and_size

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "vocab.txt", "tokenizer.model", "chat_template.jinja")
DEFAULT_SHARD_BYTES = 2 * 1024**3


class CheckpointError(ValueError):
    """A model folder that cannot be read into this model; the message names the file, tensor or field."""


def mark_vocab_padded(param: torch.Tensor, vocab_size: int) -> None:
    """Dimension 0 of ``param`` (summed over TP shards) is a padded vocabulary: only ``vocab_size`` rows are real."""
    param.unpadded_size = vocab_size


# ---------------------------------------------------------------------------------------------------------------
# Folder-level reading and writing
# ---------------------------------------------------------------------------------------------------------------


def is_model_folder(folder: str | os.PathLike) -> bool:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        return False
    try:
        return "zoo_format" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def read_config(folder: str | os.PathLike) -> tuple[str, dict]:
    """``(family, config dict)`` of a zoo model folder, with a clear error for anything else."""
    folder = Path(folder)
    path = folder / CONFIG_NAME
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_NAME}; pass a folder written by zoo (launch/train.py's "
                              f"model/ export or launch/convert.py hf-to-zoo)")
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if "zoo_format" not in meta:
        hint = " (it looks like a HuggingFace folder: import it with launch/convert.py hf-to-zoo)" \
            if "model_type" in meta or "architectures" in meta else ""
        raise CheckpointError(f"{path} is not a zoo model config{hint}")
    if meta["zoo_format"] > FORMAT_VERSION:
        raise CheckpointError(f"{path} has zoo_format {meta['zoo_format']}, newer than this zoo reads "
                              f"({FORMAT_VERSION}); update zoo")
    return meta["family"], meta["config"]


def weight_map(folder: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> safetensors file name (relative to the folder)."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        return dict(json.loads((folder / INDEX_FILE).read_text())["weight_map"])
    if (folder / SINGLE_FILE).is_file():
        with safe_open(folder / SINGLE_FILE, "pt") as f:
            return {k: SINGLE_FILE for k in f.keys()}
    raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; the model folder is incomplete "
                          f"(was it written by an interrupted run?)")


class ShardedWriter:
    """Streams ``(name, tensor)`` pairs into safetensors files of at most ``max_shard_bytes`` each.

    Only one shard is held in memory at a time. ``close()`` returns the name -> file map. File names carry a
    ``prefix`` so several writers (one per pipeline stage) can fill one folder.
    """

    def __init__(self, folder: Path, prefix: str = "model", max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder, self.prefix, self.max_bytes = Path(folder), prefix, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.detach().contiguous().cpu()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"{self.prefix}-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        self.flush()
        return {key: fname for fname, keys in self.files for key in keys}


def write_index(folder: Path, mapping: dict[str, str], total_bytes: int) -> None:
    """One file: rename it to ``model.safetensors``; several: HuggingFace's ``model.safetensors.index.json``."""
    files = sorted(set(mapping.values()))
    if len(files) == 1:
        os.replace(folder / files[0], folder / SINGLE_FILE)
        return
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(mapping.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))


def write_config(folder: Path, family: str, config: dict) -> None:
    meta = {"zoo_format": FORMAT_VERSION, "family": family, "config": config}
    (folder / CONFIG_NAME).write_text(json.dumps(meta, indent=2, sort_keys=False))


def copy_tokenizer(src: str | os.PathLike | None, dst: Path) -> list[str]:
    if src is None:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)
            copied.append(name)
    return copied


def staging_folder(final: Path) -> Path:
    return final.parent / f".{final.name}.tmp"


def publish(staging: Path, final: Path) -> None:
    """Move a finished ``staging`` folder to ``final``, replacing an older one only once the new one is complete."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{int(time.time() * 1e6)}"
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_model_folder(folder: str | os.PathLike, family: str, config: dict, tensors: Iterable[tuple[str, torch.Tensor]],
                       *, tokenizer_dir=None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write a zoo model folder from full (tp=1, unpadded) tensors, streamed one by one (one process)."""
    final = Path(folder)
    staging = staging_folder(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    writer = ShardedWriter(staging, max_shard_bytes=max_shard_bytes)
    for name, tensor in tensors:
        writer.add(name, tensor)
    write_index(staging, writer.close(), writer.total_bytes)
    write_config(staging, family, config)
    copy_tokenizer(tokenizer_dir, staging)
    publish(staging, final)
    return final


def iter_tensors(folder: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a zoo model folder, one at a time (memory: one tensor)."""
    folder = Path(folder)
    by_file: dict[str, list[str]] = {}
    for key, fname in weight_map(folder).items():
        by_file.setdefault(fname, []).append(key)
    for fname, keys in sorted(by_file.items()):
        with safe_open(folder / fname, "pt") as f:
            for key in keys:
                yield key, f.get_tensor(key)


# ---------------------------------------------------------------------------------------------------------------
# A built (possibly sharded, possibly pipelined) module <-> a model folder
# ---------------------------------------------------------------------------------------------------------------


def _gathered(param: torch.Tensor):
    """A ZeRO-3 parameter is partitioned over data parallelism; gather it for the duration of the block."""
    if hasattr(param, "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=None)
    from contextlib import nullcontext

    return nullcontext()


def full_param(param: torch.Tensor, tp_group) -> torch.Tensor:
    """The tp=1, unpadded value of a parameter (collective over ``tp_group`` for sharded ones)."""
    with _gathered(param):
        data = param.data
        if is_sharded(param):
            data = full_tensor(data, param.partition_dim, getattr(param, "partition_stride", 1), tp_group)
        else:
            data = data.detach().clone()
    rows = getattr(param, "unpadded_size", None)
    return data[:rows].contiguous() if rows is not None else data


def save_model(folder: str | os.PathLike, module: torch.nn.Module, grid, family: str, config: dict, *,
               tokenizer_dir=None, dtype: torch.dtype | None = None,
               max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path | None:
    """Write ``module`` (this rank's part of a model in any layout) as a layout-free folder. Collective: every rank
    of the grid calls it. Returns the folder on global rank 0, else None."""
    final = Path(folder)
    staging = staging_folder(final)
    rank = global_rank()
    tp_group = grid.tp_group if grid is not None else None
    tp_rank = group_rank_and_size(tp_group)[0]
    dp_rank = grid.dp_rank if grid is not None else 0
    pp_rank = grid.pp_rank if grid is not None else 0
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    # A tensor held by several stages (tied embeddings) is written by the first stage that holds it.
    names = [n for n, _ in module.named_parameters()]
    owner: dict[str, int] = {}
    for stage, stage_names in sorted(gather_objects((pp_rank, names))):
        for n in stage_names:
            owner.setdefault(n, stage)
    writer_rank = tp_rank == 0 and dp_rank == 0
    writer = ShardedWriter(staging, prefix=f"model-stage{pp_rank:03d}", max_shard_bytes=max_shard_bytes)
    for name, param in module.named_parameters():
        full = full_param(param, tp_group)  # collective: every TP (and, for ZeRO-3, DP) rank takes part
        if writer_rank and owner[name] == pp_rank:
            writer.add(name, full if dtype is None else full.to(dtype))
    mapping = writer.close() if writer_rank else {}
    parts = gather_objects((mapping, writer.total_bytes if writer_rank else 0))
    if rank == 0:
        merged = {k: v for m, _ in parts for k, v in m.items()}
        write_index(staging, merged, sum(b for _, b in parts))
        write_config(staging, family, config)
        copy_tokenizer(tokenizer_dir, staging)
        publish(staging, final)
    barrier()
    return final if rank == 0 else None


def _local_slice(handle, key: str, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """Read the part of stored tensor ``key`` that this rank's ``param`` holds (only those bytes)."""
    sl = handle.get_slice(key)
    stored = tuple(sl.get_shape())
    expected = list(param.shape)
    rows = getattr(param, "unpadded_size", None)
    if not is_sharded(param):
        if rows is not None:
            expected[0] = rows
        if tuple(expected) != stored:
            raise CheckpointError(f"tensor {key}: checkpoint has shape {stored}, the model expects {tuple(expected)}")
        return sl[:]
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    full_size = param.shape[dim] * tp
    expected[dim] = full_size
    if rows is not None:
        expected[0] = rows
    if tuple(expected) != stored:
        raise CheckpointError(f"tensor {key}: checkpoint has shape {stored}, the model expects {tuple(expected)} "
                              f"(unsharded)")
    pieces = []
    for start, stop in shard_ranges(full_size, tp_rank, tp, stride):
        real_stop = min(stop, stored[dim])
        index = [slice(None)] * len(stored)
        if real_stop > start:
            index[dim] = slice(start, real_stop)
            pieces.append(sl[tuple(index)])
        if real_stop < stop:  # padded vocabulary rows
            shape = list(param.shape)
            shape[dim] = stop - max(start, real_stop)
            pieces.append(torch.zeros(shape, dtype=param.dtype))
    return torch.cat(pieces, dim=dim)


def load_model(folder: str | os.PathLike, module: torch.nn.Module, tp_group=None) -> None:
    """Fill ``module``'s parameters (this rank's shards, this stage's layers) from a zoo model folder.

    Call it on the built module before ``deepspeed.initialize``. Every parameter must be in the folder with the
    right full shape; tensors of other pipeline stages are simply not read.
    """
    folder = Path(folder)
    mapping = weight_map(folder)
    tp_rank, tp = group_rank_and_size(tp_group)
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(mapping))
    if missing:
        raise CheckpointError(f"{folder} lacks {len(missing)} tensor(s) this model needs, e.g. {missing[:3]}; "
                              f"was it written for another model or family?")
    by_file: dict[str, list[str]] = {}
    for name in params:
        by_file.setdefault(mapping[name], []).append(name)
    with torch.no_grad():
        for fname, names in by_file.items():
            with safe_open(folder / fname, "pt") as f:
                for name in names:
                    param = params[name]
                    value = _local_slice(f, name, param, tp_rank, tp)
                    param.copy_(value.to(param.dtype))
