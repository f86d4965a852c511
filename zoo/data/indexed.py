"""Megatron-LM's memory-mapped indexed dataset: the ``.bin``/``.idx`` pair that ``preprocess_data.py`` writes.

Written here from the format itself, so that datasets move between this zoo and Megatron-LM in both directions.

``prefix.bin`` holds the tokens of every sequence back to back, in one dtype, with no header. ``prefix.idx`` says
where each sequence starts; all numbers little-endian, with no padding between fields::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version, 1
    uint8     dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    uint64    S, the number of sequences
    uint64    D + 1, the number of entries in doc_idx (D documents)
    int32     sizes[S]       tokens in each sequence
    int64     pointers[S]    byte offset of each sequence in the .bin
    int64     doc_idx[D + 1] doc_idx[0] = 0; doc_idx[d + 1] = index of the first sequence after document d

Megatron may split a document into several sequences (one per sentence); this builder writes one sequence per
document, so here doc_idx is simply 0, 1, ..., D. The reader accepts either.
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Sequence

import numpy as np

from zoo.data import files

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
# magic, version, dtype code, sequence count, doc_idx count.
_HEADER = struct.Struct("<9sQBQQ")
_INT32_MAX = np.iinfo(np.int32).max


def best_dtype(vocab_size: int) -> type:
    """The dtype Megatron picks for token ids: uint16 below 65500 tokens (half the disk of int32), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def data_file(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def index_file(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


class IndexedDatasetBuilder:
    """Writes ``prefix.bin``/``prefix.idx`` one document at a time, streaming tokens to disk.

    Only the per-document sizes stay in memory (4 bytes each), so the corpus may be larger than memory. Both files
    are written under temporary names in the target folder and moved into place by ``finalize`` (the ``.bin``
    first, then the ``.idx``), so a crash never leaves a half-written pair under the final names. Used as a context
    manager, it finalizes on a clean exit and discards its temporary file on an exception.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            names = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code; use one of {names}")
        self._sizes = array("i")  # int32, as stored in the .idx
        folder = os.path.dirname(self.prefix) or "."
        fd, self._tmp_bin = files.mkstemp(dir=folder, prefix=os.path.basename(self.prefix) + ".bin.", suffix=".tmp")
        self._bin = os.fdopen(fd, "wb")
        self._closed = False

    def add_document(self, token_ids: Sequence[int]) -> None:
        """Append one document as one sequence. An empty document is allowed and stored with size 0."""
        ids = np.asarray(token_ids)
        if ids.ndim != 1:
            raise ValueError(f"token_ids has shape {ids.shape}; pass a flat sequence of ints, one document per call")
        self.add_documents(ids, [ids.size])

    def add_documents(self, tokens: np.ndarray, sizes: Sequence[int]) -> None:
        """Append ``len(sizes)`` documents whose tokens lie back to back in the flat array ``tokens``: the same
        bytes as one ``add_document`` per document, in one write (preprocessing workers hand over whole batches)."""
        if self._closed:
            raise ValueError(f"builder for {self.prefix} is already finalized or aborted; start a new builder")
        ids = np.asarray(tokens)
        sizes = np.asarray(sizes, dtype=np.int64)
        if ids.ndim != 1 or sizes.ndim != 1 or int(sizes.sum()) != ids.size or (sizes.size and sizes.min() < 0):
            raise ValueError(f"tokens of shape {ids.shape} are not split by sizes summing to {int(sizes.sum())}; "
                             f"pass the documents' tokens back to back and one size per document")
        if ids.size and self.dtype.kind in "iu":
            if ids.dtype.kind not in "iu":
                raise ValueError(f"token_ids has dtype {ids.dtype}; pass integer token ids")
            info = np.iinfo(self.dtype)
            lo, hi = int(ids.min()), int(ids.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"token id range [{lo}, {hi}] does not fit {self.dtype.name} [{info.min}, "
                                 f"{info.max}]; pass a wider dtype, e.g. best_dtype(vocab_size)")
        if sizes.size and int(sizes.max()) > _INT32_MAX:
            raise ValueError(f"document of {int(sizes.max())} tokens exceeds the int32 size field; split it into "
                             f"documents")
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.extend(sizes.tolist())

    def __len__(self) -> int:
        return len(self._sizes)

    def finalize(self) -> None:
        """Write the ``.idx`` and move both files to ``prefix.bin`` and ``prefix.idx``."""
        if self._closed:
            raise ValueError(f"builder for {self.prefix} is already finalized or aborted; start a new builder")
        self._bin.close()
        tmp_idx = None
        try:
            sizes = np.frombuffer(self._sizes, dtype=np.int32) if len(self._sizes) else np.zeros(0, np.int32)
            n = sizes.size
            pointers = np.zeros(n, dtype=np.int64)
            # Byte offsets: exclusive prefix sum of the sizes, in int64 so that large corpora do not overflow.
            np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
            pointers *= self.dtype.itemsize
            doc_idx = self._doc_index()
            folder = os.path.dirname(self.prefix) or "."
            fd, tmp_idx = files.mkstemp(dir=folder, prefix=os.path.basename(self.prefix) + ".idx.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], n, doc_idx.size))
                f.write(sizes.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(doc_idx.astype("<i8").tobytes())
            # .bin first: the .idx is the commit point, and an .idx never describes a .bin that is not there yet.
            os.replace(self._tmp_bin, data_file(self.prefix))
            os.replace(tmp_idx, index_file(self.prefix))
        except BaseException:
            self.abort()
            if tmp_idx is not None and os.path.exists(tmp_idx):
                os.remove(tmp_idx)
            raise
        self._closed = True

    def _doc_index(self) -> np.ndarray:
        """``doc_idx`` of the ``.idx``: one sequence per document here, so 0, 1, ..., D."""
        return np.arange(len(self._sizes) + 1, dtype=np.int64)

    def abort(self) -> None:
        """Drop what was written; the final names are left untouched."""
        self._closed = True
        if not self._bin.closed:
            self._bin.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _read_array(path: str, dtype: str, offset: int, count: int) -> np.ndarray:
    # np.memmap refuses a zero-length map, so empty arrays are made directly.
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


class IndexedDataset:
    """Read-only view of a ``prefix.bin``/``prefix.idx`` pair; ``ds[i]`` is sequence ``i``, a view into the map.

    Both files are memory-mapped, so opening costs the same for any corpus size, and the pair is checked on open:
    a missing file, a foreign or truncated index, or a ``.bin`` whose size disagrees with the index is a
    ``ValueError`` naming the file.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        idx_path, bin_path = index_file(self.prefix), data_file(self.prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"{path} is missing; run preprocessing (IndexedDatasetBuilder or Megatron's "
                                 f"preprocess_data.py) to write the .bin/.idx pair")
        idx_bytes = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if head[:len(MAGIC)] != MAGIC:
            if len(head) < len(MAGIC) and MAGIC.startswith(head):
                raise ValueError(f"{idx_path} is truncated ({idx_bytes} bytes, header needs {_HEADER.size}); "
                                 f"rerun preprocessing")
            raise ValueError(f"{idx_path} is not a Megatron indexed dataset (bad magic {head[:len(MAGIC)]!r}); "
                             f"pass the prefix of a .bin/.idx pair")
        if len(head) < _HEADER.size:
            raise ValueError(f"{idx_path} is truncated ({idx_bytes} bytes, header needs {_HEADER.size}); "
                             f"rerun preprocessing")
        _, version, code, n_seq, n_doc_idx = _HEADER.unpack(head)
        if version != VERSION:
            raise ValueError(f"{idx_path} has unsupported version {version} (only {VERSION} is read); "
                             f"rewrite it with this preprocessing")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path} has unsupported dtype code {code} (known: {sorted(DTYPE_CODES)}); "
                             f"rewrite it with this preprocessing")
        self.dtype = np.dtype(DTYPE_CODES[code])
        need = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc_idx
        if idx_bytes < need:
            raise ValueError(f"{idx_path} is truncated ({idx_bytes} bytes, its header's counts need {need}); "
                             f"rerun preprocessing")
        if idx_bytes > need:
            raise ValueError(f"{idx_path} has {idx_bytes - need} bytes past what its header describes; "
                             f"it is corrupt, rerun preprocessing")
        off = _HEADER.size
        self.sizes = _read_array(idx_path, "<i4", off, n_seq)
        off += 4 * n_seq
        self.pointers = _read_array(idx_path, "<i8", off, n_seq)
        off += 8 * n_seq
        self.doc_idx = _read_array(idx_path, "<i8", off, n_doc_idx)

        bin_bytes = os.path.getsize(bin_path)
        expected = int(self.sizes.sum(dtype=np.int64)) * self.dtype.itemsize
        if bin_bytes != expected:
            raise ValueError(f"{bin_path} is corrupt or truncated ({bin_bytes} bytes, index expects {expected}); "
                             f"rerun preprocessing")
        # The pointers are trusted from here on, so the last one is checked against the sizes (cheap, O(1)).
        if n_seq and int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize != bin_bytes:
            raise ValueError(f"{idx_path} has pointers that disagree with its sizes; it is corrupt, "
                             f"rerun preprocessing")
        self._bin = _read_array(bin_path, self.dtype.newbyteorder("<").str, 0, bin_bytes // self.dtype.itemsize)

    def __len__(self) -> int:
        return int(self.sizes.size)

    def _check_index(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} is out of range for {n} sequences in {self.prefix}")
        return i % n

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence ``i`` as a read-only view into the memory-mapped ``.bin`` (no copy)."""
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end when ``length`` is None), no copy."""
        i = self._check_index(int(i))
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) is outside sequence {i} of {size} tokens")
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    def __iter__(self):
        for i in range(len(self)):
            yield self.get(i)
