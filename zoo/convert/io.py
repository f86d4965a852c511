"""The layout-free zoo model checkpoint: one folder, readable into any (tp, pp) layout.

    config.json                     {"zoo_format": 1, "family": "gpt", "config": {<the model config's fields>}}
    model.safetensors               every tensor full (as at tp=1), vocabulary unpadded, keys as in the state dict
                                    of ``SpecSequential`` / ``PipelineModule`` ("3.attention.qkv.weight", ...)
      or model-*.safetensors + model.safetensors.index.json   (sharded; the index is HuggingFace's format)
    tokenizer files                 optional, copied beside (AutoTokenizer.from_pretrained(folder) reads them)
    other files                     optional (``write_model_folder(extra_files=...)``), e.g. generation_config.json

Writing (:func:`save_model`): each TP group gathers its shards (``zoo.parallel.shards``), and one rank per pipeline
stage writes that stage's tensors; a tensor tied across stages is written once. The folder is built under a
temporary name and moved into place at the end, so a crash never leaves a half-written model under the final name.

Reading (:func:`load_model`): every rank opens the safetensors files lazily and reads only the rows or columns of
each tensor its shard holds (``safe_open(...).get_slice``), so memory stays at this rank's share of the model.
Vocabulary rows beyond ``vocab_size`` (padding to a multiple of 128 x tp) are zero. A parameter may hold given rows of
a stored tensor instead (``stored_name``, ``stored_rows``, ``stored_size``: the query rows and the replicated k/v rows
of ``zoo.parallel.layers.GroupedQKVLinear``, where tp exceeds the kv heads): it reads those rows, and the stored
tensor is written whole, from every TP rank's rows, replicated rows once. A tensor over 16 MB is copied
into its parameter a few rows at a time, each read through its own open of the file: pages a read maps stay
resident until the file closes, and would hold the tensor twice.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from zoo.parallel.shards import (
    barrier,
    full_tensor,
    gather_objects,
    gather_shards,
    global_rank,
    is_sharded,
    shard_ranges,
)
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


def resolve_model_folder(path: str | os.PathLike) -> Path:
    """A zoo model folder: ``path`` itself, or a training run folder's ``model/``."""
    path = Path(path).expanduser()
    for folder in (path, path / "model"):
        if is_model_folder(folder):
            return folder
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist")
    if (path / CONFIG_NAME).is_file():
        read_config(path)  # raises, saying what the config is instead (a HuggingFace one: convert it first)
    raise CheckpointError(f"{path} is neither a zoo model folder (config.json with zoo_format) nor a run folder with "
                          f"one in model/; pass a folder exported by launch/train.py or its run folder")


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


def read_adapter(folder: str | os.PathLike) -> dict | None:
    """The LoRA / DoRA settings of a zoo model folder whose tensors include adapters (``"lora"`` of its
    config.json, beside ``"config"`` or inside it); None for a plain model."""
    read_config(folder)  # the folder's own errors first
    meta = json.loads((Path(folder) / CONFIG_NAME).read_text())
    return meta.get("lora", (meta.get("config") or {}).get("lora"))


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


# safetensors' dtype names (its spec); the ``torch.uint*`` wider than 8 bits exist in recent torch only.
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
                      **{getattr(torch, f"uint{b}"): f"U{b}" for b in (16, 32, 64) if hasattr(torch, f"uint{b}")}}
_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
COPY_CHUNK_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class _Stored:
    """One tensor written to a writer's temporary data file: where its bytes are, and what they are."""

    name: str
    dtype: str  # safetensors' name
    itemsize: int
    shape: tuple[int, ...]
    begin: int  # byte offset in the temporary data file
    nbytes: int


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy (any dtype, 0-d and empty included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _copy_range(src, dst, begin: int, nbytes: int) -> None:
    """Append bytes ``[begin, begin + nbytes)`` of file ``src`` to file ``dst``: in the kernel where it can
    (``os.copy_file_range``), else through a buffer of ``COPY_CHUNK_BYTES``; never the whole range in memory."""
    dst.flush()
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < nbytes:
                got = os.copy_file_range(src.fileno(), dst.fileno(), nbytes - done, begin + done)
                if not got:
                    break
                done += got
        except OSError:  # not supported between these files (some filesystems, old kernels): copy by hand
            pass
        dst.seek(0, os.SEEK_END)  # copy_file_range moved the descriptor's offset; keep the file object in step
    buffer = memoryview(bytearray(min(COPY_CHUNK_BYTES, nbytes - done) or 1))
    src.seek(begin + done)
    while done < nbytes:
        got = src.readinto(buffer[: min(nbytes - done, len(buffer))])
        if not got:
            raise OSError(f"{src.name} ended early: {nbytes - done} byte(s) missing")
        dst.write(buffer[:got])
        done += got


class ShardedWriter:
    """Streams ``(name, tensor)`` pairs into safetensors files of at most ``max_shard_bytes`` each.

    ``add`` writes each tensor's bytes at once to a temporary data file in ``folder`` (``.<shard>.data``) and keeps
    only its name, dtype, shape and offset; ``flush`` writes the shard's safetensors file (8-byte little-endian
    header length, JSON header padded with spaces to a multiple of 8 bytes, then the data, tensors ordered by
    alignment then name as ``safetensors.torch.save_file`` orders them) by copying the data file across (in the
    kernel, or in ``COPY_CHUNK_BYTES`` chunks), then deletes the data file. Memory: the tensor being added (and at
    most one chunk); disk: up to two copies of one shard while it is flushed. ``close()`` returns the name -> file
    map. File names carry a ``prefix`` so several writers (one per pipeline stage) can fill one folder.
    """

    def __init__(self, folder: Path, prefix: str = "model", max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder, self.prefix, self.max_bytes = Path(folder), prefix, max_shard_bytes
        self.pending: list[_Stored] = []
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0
        self._names: set[str] = set()
        self._data = None  # the open temporary data file of the shard being filled

    def _shard_name(self) -> str:
        return f"{self.prefix}-{len(self.files) + 1:05d}.safetensors"

    def _data_path(self) -> Path:
        return self.folder / f".{self._shard_name()}.data"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name} is written twice")
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} cannot be stored in safetensors")
        if sys.byteorder != "little":
            raise NotImplementedError("safetensors files are little-endian; this writer runs on little-endian hosts")
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        if self._data is None:
            self._data = open(self._data_path(), "wb")
        data = tensor.detach().cpu().contiguous()  # a copy only where the tensor is not already one
        begin = self._data.tell()
        self._data.write(_tensor_bytes(data))
        del data
        self.pending.append(_Stored(name, SAFETENSORS_DTYPES[tensor.dtype], tensor.element_size(), tuple(tensor.shape),
                                    begin, nbytes))
        self._names.add(name)
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        name, data_path = self._shard_name(), self._data_path()
        self._data.close()
        self._data = None
        ordered = sorted(self.pending, key=lambda t: (-t.itemsize, t.name))  # aligned: widest dtypes first
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in ordered:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # the data starts at a multiple of 8 (safetensors' own writer pads the same)
        with open(data_path, "rb") as src, open(self.folder / name, "wb") as dst:
            dst.write(struct.pack("<Q", len(raw)))
            dst.write(raw)
            for t in ordered:
                _copy_range(src, dst, t.begin, t.nbytes)
        os.remove(data_path)
        self.files.append((name, [t.name for t in self.pending]))
        self.pending, self.pending_bytes = [], 0

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


def write_config(folder: Path, family: str, config: dict, adapter: dict | None = None) -> None:
    """``adapter``: the LoRA / DoRA settings of adapter tensors stored beside the weights (``zoo.models.lora``),
    recorded as ``"lora"`` beside ``"config"``."""
    meta = {"zoo_format": FORMAT_VERSION, "family": family, "config": config}
    if adapter is not None:
        meta["lora"] = adapter
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


def _check_extra_name(name: str) -> None:
    reserved = {CONFIG_NAME, SINGLE_FILE, INDEX_FILE}
    if not name or Path(name).name != name or name in (".", "..") or name in reserved or \
            name.endswith(".safetensors"):
        raise ValueError(f"extra file {name!r}: give a plain file name, not a path, a weight file or {CONFIG_NAME}")


def write_model_folder(folder: str | os.PathLike, family: str, config: dict,
                       tensors: Iterable[tuple[str, torch.Tensor]], *, tokenizer_dir=None,
                       max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                       extra_files: dict[str, str | bytes] | None = None) -> Path:
    """Write a zoo model folder from full (tp=1, unpadded) tensors, streamed one by one (one process).

    ``extra_files`` (file name -> text or bytes, e.g. ``generation_config.json``) are written into the folder
    before it is published, so they appear together with the weights or not at all.
    """
    extra_files = dict(extra_files or {})
    for name in extra_files:
        _check_extra_name(name)
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
    _write_extra_files(staging, extra_files)
    publish(staging, final)
    return final


def _write_extra_files(staging: Path, extra_files: dict[str, str | bytes]) -> None:
    for name, content in extra_files.items():
        if isinstance(content, str):
            (staging / name).write_text(content, encoding="utf-8")
        else:
            (staging / name).write_bytes(bytes(content))


READ_CHUNK_BYTES = 64 * 1024**2


def read_tensors(path: str | os.PathLike, keys) -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file, copied into this process's memory (they pin no memory map).

    ``safe_open(...).get_tensor`` returns a view of the file's memory map; while any view lives the map stays, and
    every page read through it counts in this process's RSS, so a caller keeping such views would hold the whole
    file. Here each tensor is copied out and the file is mapped again for every chunk of ``READ_CHUNK_BYTES``
    rows, so at most one chunk of the map is resident at a time.
    """
    out = {}
    for key in keys:
        with safe_open(path, "pt") as f:
            view = f.get_tensor(key)  # lazy: no page read yet
            if view.dim() == 0 or view.numel() * view.element_size() <= READ_CHUNK_BYTES:
                out[key] = view.clone()
                continue
            rows = max(1, READ_CHUNK_BYTES * view.shape[0] // (view.numel() * view.element_size()))
            copy = torch.empty_like(view)
            del view
        for start in range(0, copy.shape[0], rows):
            with safe_open(path, "pt") as f:
                copy[start:start + rows] = f.get_slice(key)[start:start + rows]
        out[key] = copy
    return out


def iter_tensors(folder: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a zoo model folder, one at a time (memory: one tensor).

    Each is a copy (:func:`read_tensors`), not a view of the file's memory map: keeping some of them does not keep
    the whole file resident.
    """
    folder = Path(folder)
    by_file: dict[str, list[str]] = {}
    for key, fname in weight_map(folder).items():
        by_file.setdefault(fname, []).append(key)
    for fname, keys in sorted(by_file.items()):
        for key in keys:
            yield key, read_tensors(folder / fname, [key])[key]


# ---------------------------------------------------------------------------------------------------------------
# A built (possibly sharded, possibly pipelined) module <-> a model folder
# ---------------------------------------------------------------------------------------------------------------


def _gathered(param: torch.Tensor):
    """A ZeRO-3 parameter is partitioned over data parallelism; gather it for the duration of the block (unless
    its ``.data`` holds a whole value put there for the block: ``zoo_whole``, the weight average's)."""
    if hasattr(param, "ds_id") and not getattr(param, "zoo_whole", False):
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=None)
    from contextlib import nullcontext

    return nullcontext()


def is_expert_parallel(param: torch.Tensor) -> bool:
    """An MoE expert tensor: this rank holds the experts of its expert-parallel rank along dimension 0."""
    return bool(getattr(param, "expert_parallel", False))


def stored_key(name: str, param: torch.Tensor) -> str:
    """The tensor of a model folder that holds ``param`` (named ``name`` in the module): itself, or for a parameter
    holding some rows of a stored tensor (``stored_name``: ``GroupedQKVLinear``'s k/v rows) that tensor."""
    stored = getattr(param, "stored_name", None)
    return name if stored is None else f"{name.rsplit('.', 1)[0]}.{stored}" if "." in name else stored


def full_stored(params: list[torch.Tensor], tp_group) -> torch.Tensor:
    """The full stored tensor whose rows ``params`` hold between them on the TP ranks (``stored_rows``): each
    parameter all-gathered over ``tp_group`` (collective) and its rows put in place; rows several ranks hold
    (replicated k/v rows) are equal there and written once."""
    out = None
    for param in params:
        with _gathered(param):
            parts = gather_shards(param.data, tp_group)  # [one per TP rank]
        if out is None:
            local = parts[0]
            out = local.new_zeros((params[0].stored_size, *local.shape[1:]))
        for r, part in enumerate(parts):
            offset = 0
            for start, stop in param.stored_rows[r]:
                out[start:stop] = part[offset:offset + stop - start]
                offset += stop - start
    return out


def full_param(param: torch.Tensor, tp_group, ep_group=None) -> torch.Tensor:
    """The tp=1, ep=1, unpadded value of a parameter (collective over ``tp_group`` for sharded ones, over
    ``ep_group`` for experts). A parameter holding rows of a larger stored tensor (``stored_rows``) has no value
    of its own: :func:`full_stored`."""
    if hasattr(param, "stored_rows"):
        raise ValueError("a parameter holding rows of a stored tensor (stored_rows) is written with full_stored")
    with _gathered(param):
        data = param.data
        if is_sharded(param):
            data = full_tensor(data, param.partition_dim, getattr(param, "partition_stride", 1), tp_group)
        elif is_expert_parallel(param):
            data = full_tensor(data, 0, 1, ep_group)  # rank r holds experts [r E/ep, (r+1) E/ep)
        else:
            data = data.detach().clone()
    rows = getattr(param, "unpadded_size", None)
    return data[:rows].contiguous() if rows is not None else data


def save_model(folder: str | os.PathLike, module: torch.nn.Module, grid, family: str, config: dict, *,
               tokenizer_dir=None, dtype: torch.dtype | None = None,
               max_shard_bytes: int = DEFAULT_SHARD_BYTES,
               extra_files: dict[str, str | bytes] | None = None, adapter: dict | None = None) -> Path | None:
    """Write ``module`` (this rank's part of a model in any layout) as a layout-free folder. Collective: every rank
    of the grid calls it. Returns the folder on global rank 0, else None. A write that fails on any rank (a full
    disk, a size limit) raises ``OSError`` on every rank once the collectives are done, with the staging folder
    removed and a folder already at ``folder`` unchanged. ``extra_files`` as :func:`write_model_folder`'s
    (written by global rank 0); ``adapter``: the settings of the module's LoRA / DoRA adapters
    (:func:`write_config`)."""
    extra_files = dict(extra_files or {})
    for name in extra_files:
        _check_extra_name(name)
    final = Path(folder)
    staging = staging_folder(final)
    rank = global_rank()
    tp_group = grid.tp_group if grid is not None else None
    ep_group = getattr(grid, "ep_group", None)
    tp_rank = group_rank_and_size(tp_group)[0]
    dp_rank = grid.dp_rank if grid is not None else 0
    pp_rank = grid.pp_rank if grid is not None else 0
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    # A tensor held by several stages (tied embeddings) is written by the first stage that holds it.
    stored: dict[str, list] = {}  # stored tensor -> the parameters that hold its rows (GroupedQKVLinear)
    for name, param in model_tensors(module).items():
        stored.setdefault(stored_key(name, param), []).append(param)
    names = list(stored)
    owner: dict[str, int] = {}
    for stage, stage_names in sorted(gather_objects((pp_rank, names))):
        for n in stage_names:
            owner.setdefault(n, stage)
    writer_rank = tp_rank == 0 and dp_rank == 0  # data-parallel rank 0 is also expert-parallel rank 0
    writer_rank = writer_rank and getattr(grid, "cp_rank", 0) == 0  # CP ranks hold the same weights
    writer = ShardedWriter(staging, prefix=f"model-stage{pp_rank:03d}", max_shard_bytes=max_shard_bytes)
    failure = None  # a write that failed here (disk full, a size limit): the collectives go on, the others learn it
    for name, params in stored.items():
        if hasattr(params[0], "stored_rows"):
            full = full_stored(params, tp_group)  # collective over TP
        else:
            full = full_param(params[0], tp_group, ep_group)  # collective over TP (ZeRO-3: DP; experts: EP)
        if writer_rank and owner[name] == pp_rank and failure is None:
            try:
                writer.add(name, full if dtype is None else full.to(dtype))
            except OSError as e:
                failure = e
    mapping = {}
    if writer_rank and failure is None:
        try:
            mapping = writer.close()
        except OSError as e:
            failure = e
    parts = gather_objects((mapping, writer.total_bytes if writer_rank else 0, _said(failure)))
    failure = next((f for _, _, f in parts if f), None)
    if rank == 0 and failure is None:
        try:
            merged = {k: v for m, _, _ in parts for k, v in m.items()}
            write_index(staging, merged, sum(b for _, b, _ in parts))
            write_config(staging, family, config, adapter)
            copy_tokenizer(tokenizer_dir, staging)
            _write_extra_files(staging, extra_files)
            publish(staging, final)
        except OSError as e:
            failure = _said(e)
    failure = gather_objects(failure if rank == 0 else None)[0] or failure  # rank 0's last word, to every rank
    if failure:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        barrier()
        raise OSError(f"{final} could not be written ({failure}); nothing of it is left"
                      + (" and the folder that was there is unchanged" if final.exists() else ""))
    return final if rank == 0 else None


def _said(failure: BaseException | None) -> str | None:
    return None if failure is None else f"{type(failure).__name__}: {failure}"[:300]


def model_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a model folder holds of ``module``: its parameters (each once) and its persistent buffers (an MoE
    router's balancing bias)."""
    tensors = dict(module.named_parameters())
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.nn.Parameter) and name not in tensors:
            tensors[name] = value
    return tensors


def _local_pieces(key: str, stored: tuple, param: torch.Tensor, tp_rank: int, tp: int, ep_rank: int = 0,
                  ep: int = 1) -> tuple[int, list]:
    """Where this rank's ``param`` lies in stored tensor ``key``: ``(dim, pieces)``, the pieces in order along
    ``dim``, each ``(index into the stored tensor, or None for zero padding rows, its size along dim)``."""
    expected = list(param.shape)
    rows = getattr(param, "unpadded_size", None)
    if hasattr(param, "stored_rows"):  # some rows of the stored tensor (GroupedQKVLinear's q or k/v rows)
        ranges = param.stored_rows[tp_rank]
        expected[0] = param.stored_size
        if tuple(expected) != stored:
            raise CheckpointError(f"tensor {key}: checkpoint has shape {stored}, the model expects {tuple(expected)} "
                                  f"(unsharded)")
        return 0, [((slice(a, b),) + (slice(None),) * (len(stored) - 1), b - a) for a, b in ranges]
    if is_expert_parallel(param):
        local = param.shape[0]
        expected[0] = local * ep
        if tuple(expected) != stored:
            raise CheckpointError(f"tensor {key}: checkpoint has shape {stored}, the model expects {tuple(expected)} "
                                  f"(all {local * ep} experts)")
        return 0, [(slice(ep_rank * local, (ep_rank + 1) * local), local)]
    if not is_sharded(param):
        if rows is not None:
            expected[0] = rows
        if tuple(expected) != stored:
            raise CheckpointError(f"tensor {key}: checkpoint has shape {stored}, the model expects {tuple(expected)}")
        return 0, [(slice(None), stored[0] if stored else 1)]
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
        if real_stop > start:
            index = [slice(None)] * len(stored)
            index[dim] = slice(start, real_stop)
            pieces.append((tuple(index), real_stop - start))
        if real_stop < stop:  # padded vocabulary rows
            pieces.append((None, stop - max(start, real_stop)))
    return dim, pieces


def _local_slice(handle, key: str, param: torch.Tensor, tp_rank: int, tp: int, ep_rank: int = 0,
                 ep: int = 1) -> torch.Tensor:
    """Read the part of stored tensor ``key`` that this rank's ``param`` holds (only those bytes)."""
    sl = handle.get_slice(key)
    dim, pieces = _local_pieces(key, tuple(sl.get_shape()), param, tp_rank, tp, ep_rank, ep)
    parts = []
    for index, size in pieces:
        if index is None:
            shape = list(param.shape)
            shape[dim] = size
            parts.append(torch.zeros(shape, dtype=param.dtype))
        else:
            parts.append(sl[index])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _read_in_chunks(path: Path, key: str, param: torch.Tensor, tp_rank: int, tp: int, ep_rank: int, ep: int,
                    chunk_bytes: int = COPY_CHUNK_BYTES) -> None:
    """Copy this rank's part of ``key`` into ``param`` ``chunk_bytes`` of rows at a time, each through its own open
    of the file: the pages a read maps stay resident until the file is closed, so reading a large tensor through one
    open file would hold it twice (its pages and the parameter)."""
    with safe_open(path, "pt") as f:
        stored = tuple(f.get_slice(key).get_shape())
    dim, pieces = _local_pieces(key, stored, param, tp_rank, tp, ep_rank, ep)
    offset = 0
    for index, size in pieces:
        dest = param.narrow(dim, offset, size)
        offset += size
        if index is None:
            dest.zero_()
            continue
        index = index if isinstance(index, tuple) else (index,) + (slice(None),) * (len(stored) - 1)
        first = range(stored[0])[index[0]]  # the stored rows this piece reads
        step = max(1, chunk_bytes // max(1, dest[0].numel() * dest.element_size()))
        for a in range(0, len(first), step):
            rows = slice(first.start + a, first.start + min(a + step, len(first)))
            with safe_open(path, "pt") as f:
                dest[a:a + step].copy_(f.get_slice(key)[(rows, *index[1:])])


def local_row_blocks(folder: str | os.PathLike, key: str, param: torch.Tensor, tp_group=None,
                     block_bytes: int = COPY_CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """This rank's rows of stored tensor ``key``, as ``param`` (a vocabulary-sized weight split along its rows, or
    not split; it may live on the meta device) holds them, ``block_bytes`` of rows at a time (:class:`RowReader`);
    padding rows come as zeros. A forward can run a layer too large for memory block by block
    (``zoo.convert.verify``'s streamed LM head). Each block is valid until the next one is asked for: they share
    one buffer."""
    folder = Path(folder)
    reader = RowReader(folder / weight_map(folder)[key], key)
    dim, pieces = _local_pieces(key, reader.shape, param, *group_rank_and_size(tp_group))
    if dim != 0:
        raise ValueError(f"tensor {key} is split along dim {dim}; row blocks need a row split")
    step = max(1, block_bytes // reader.row_bytes)
    for index, size in pieces:
        if index is None:
            yield torch.zeros((size, *param.shape[1:]), dtype=param.dtype)
            continue
        first = range(reader.shape[0])[index[0] if isinstance(index, tuple) else index]
        for a in range(0, len(first), step):
            rows = range(first.start + a, first.start + min(a + step, len(first)))
            yield reader.read(rows, reuse=True).to(param.dtype)


def read_rows(folder: str | os.PathLike, key: str, rows) -> torch.Tensor:
    """Rows ``rows`` (ascending) of tensor ``key`` of a zoo model folder (:class:`RowReader`)."""
    folder = Path(folder)
    return RowReader(folder / weight_map(folder)[key], key).read(rows)


class RowReader:
    """Rows of one tensor of a safetensors file, read with plain file reads, one per run of consecutive rows: only
    those bytes, and no memory map. (Through a map, every row touched also brings the page-cache folio around it
    into this process's RSS: up to megabytes per row of an embedding table looked up at random ids.)"""

    def __init__(self, path: str | os.PathLike, key: str):
        self.path, self.key = Path(path), key
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            info = json.loads(f.read(header_len))[key]
        self.dtype, self.shape = _TORCH_DTYPES[info["dtype"]], tuple(info["shape"])
        if not self.shape:
            raise ValueError(f"tensor {key} of {path} is a scalar; it has no rows")
        self.row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        self.offset = 8 + header_len + info["data_offsets"][0]
        self._buffer = bytearray()

    def release(self) -> None:
        """Drop the buffer ``reuse`` reads fill (views of it keep it alive until they go)."""
        self._buffer = bytearray()

    def read(self, rows, reuse: bool = False) -> torch.Tensor:
        """Rows ``rows`` (ascending ints), ``[len(rows), ...]`` in the stored dtype. ``reuse``: read into a buffer
        this reader keeps and return a view of it, valid until the next ``reuse`` read (a loop over blocks then
        holds one block: fresh blocks freed between small allocations fragment the heap, and it grows)."""
        rows = list(rows)
        size = len(rows) * self.row_bytes
        if reuse and len(self._buffer) < size:
            self._buffer = None
            self._buffer = bytearray(size)
        data = self._buffer if reuse else bytearray(size)
        if not rows:
            return torch.empty((0, *self.shape[1:]), dtype=self.dtype)
        view = memoryview(data)
        with open(self.path, "rb", buffering=0) as f:
            i = 0
            while i < len(rows):
                j = i + 1
                while j < len(rows) and rows[j] == rows[j - 1] + 1:
                    j += 1
                if rows[i] < 0 or rows[j - 1] >= self.shape[0]:
                    raise IndexError(f"rows {rows[i]}..{rows[j - 1]} outside tensor {self.key} of shape {self.shape}")
                f.seek(self.offset + rows[i] * self.row_bytes)
                done, want = i * self.row_bytes, j * self.row_bytes
                while done < want:  # a read may return less than asked
                    got = f.readinto(view[done:want])
                    if not got:
                        raise CheckpointError(f"{self.path} ends inside tensor {self.key}; the file is truncated")
                    done += got
                i = j
        view.release()
        return torch.frombuffer(data, dtype=self.dtype, count=size // self.dtype.itemsize).view(len(rows),
                                                                                              *self.shape[1:])


def load_model(folder: str | os.PathLike, module: torch.nn.Module, tp_group=None, ep_group=None) -> None:
    """Fill ``module``'s parameters and persistent buffers (this rank's shards and experts, this stage's layers)
    from a zoo model folder.

    Call it on the built module before ``deepspeed.initialize``. Every tensor must be in the folder with the
    right full shape; tensors of other pipeline stages, and experts of other expert-parallel ranks, are not read.
    """
    load_tensors(folder, model_tensors(module), tp_group, ep_group)


def load_tensors(folder: str | os.PathLike, params: dict[str, torch.Tensor], tp_group=None, ep_group=None) -> None:
    """:func:`load_model` for the tensors of ``params`` (name in the folder -> this rank's tensor to fill)."""
    folder = Path(folder)
    mapping = weight_map(folder)
    tp_rank, tp = group_rank_and_size(tp_group)
    ep_rank, ep = group_rank_and_size(ep_group)
    keys = {name: stored_key(name, param) for name, param in params.items()}  # module name -> stored tensor
    missing = sorted(set(keys.values()) - set(mapping))
    if missing:
        raise CheckpointError(f"{folder} lacks {len(missing)} tensor(s) this model needs, e.g. {missing[:3]}; "
                              f"was it written for another model or family?")
    by_file: dict[str, list[str]] = {}
    for name in params:
        by_file.setdefault(mapping[keys[name]], []).append(name)
    with torch.no_grad():
        for fname, names in by_file.items():
            large = [n for n in names if params[n].numel() * params[n].element_size() > COPY_CHUNK_BYTES]
            with safe_open(folder / fname, "pt") as f:
                for name in (n for n in names if n not in large):
                    param = params[name]
                    param.copy_(_local_slice(f, keys[name], param, tp_rank, tp, ep_rank, ep))
            for name in large:
                _read_in_chunks(folder / fname, keys[name], params[name], tp_rank, tp, ep_rank, ep)
