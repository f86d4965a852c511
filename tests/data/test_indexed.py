"""Tests for the Megatron indexed dataset (zoo/data/indexed.py).

The reference for the contents is the Python lists written; the reference for the format is an ``.idx`` laid out
by hand with ``struct.pack`` below, so the file layout is checked, not only that the reader undoes the writer.
"""

import os
import random
import struct

import numpy as np
import pytest

from zoo.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype


def _write(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(prefix, dtype=dtype)
    for d in docs:
        b.add_document(d)
    b.finalize()
    return IndexedDataset(prefix)


def _leftovers(folder):
    return sorted(os.listdir(folder))


def test_round_trip_random_documents(tmp_path):
    rng = random.Random(0)
    docs = [[rng.randrange(65536) for _ in range(rng.randrange(0, 300))] for _ in range(200)]
    docs += [[], [65535], [0, 65535, 0]]  # empty documents are stored; 65535 is the top of uint16
    ds = _write(tmp_path / "d", docs)
    assert len(ds) == len(docs)
    assert ds.dtype == np.uint16
    assert ds.sizes.tolist() == [len(d) for d in docs]
    assert ds.doc_idx.tolist() == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
    assert ds[-1].tolist() == docs[-1]
    assert ds.get(0, 3, 5).tolist() == docs[0][3:8]
    assert _leftovers(tmp_path) == ["d.bin", "d.idx"]


def test_add_documents_writes_the_same_files_as_one_call_per_document(tmp_path):
    rng = random.Random(1)
    docs = [[rng.randrange(65536) for _ in range(rng.randrange(0, 50))] for _ in range(40)] + [[]]
    _write(tmp_path / "one", docs)
    with IndexedDatasetBuilder(tmp_path / "bulk", dtype=np.uint16) as b:
        for part in (docs[:7], docs[7:8], [], docs[8:]):
            b.add_documents(np.array([t for d in part for t in d], dtype=np.int64), [len(d) for d in part])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"bulk{ext}").read_bytes() == (tmp_path / f"one{ext}").read_bytes()
    with IndexedDatasetBuilder(tmp_path / "bad", dtype=np.uint16) as b:
        with pytest.raises(ValueError, match="not split by sizes summing to 3"):
            b.add_documents(np.arange(4), [1, 2])


def test_getitem_is_a_view(tmp_path):
    ds = _write(tmp_path / "d", [[1, 2, 3], [4, 5]])
    assert not ds[1].flags.owndata and not ds[1].flags.writeable


def test_other_dtypes(tmp_path):
    big = [[0, 70000, 2**31 - 1], [5]]
    assert _write(tmp_path / "i32", big, best_dtype(100_000)).dtype == np.int32
    assert [x.tolist() for x in IndexedDataset(tmp_path / "i32")] == big
    assert _write(tmp_path / "u8", [[255, 0]], np.uint8)[0].tolist() == [255, 0]
    assert best_dtype(50257) == np.uint16 and best_dtype(65500) == np.int32


def test_all_empty_and_no_documents(tmp_path):
    assert [x.tolist() for x in _write(tmp_path / "e", [[], []])] == [[], []]
    assert len(_write(tmp_path / "z", [])) == 0


def test_refuses_ids_outside_dtype(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "d", dtype=np.uint16)
    for bad in ([65536], [-1]):
        with pytest.raises(ValueError, match="does not fit uint16") as err:
            b.add_document(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="integer"):
        b.add_document([1.5])
    b.add_document([1, 2])
    b.finalize()
    assert [x.tolist() for x in IndexedDataset(tmp_path / "d")] == [[1, 2]]


def test_idx_bytes_match_hand_layout(tmp_path):
    docs = [[7, 8, 9], [], [10, 11]]
    _write(tmp_path / "t", docs)
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)            # version
        + struct.pack("<B", 8)            # dtype code 8 = uint16
        + struct.pack("<Q", 3)            # sequences
        + struct.pack("<Q", 4)            # doc_idx entries = documents + 1
        + struct.pack("<3i", 3, 0, 2)     # sizes, int32
        + struct.pack("<3q", 0, 6, 6)     # byte pointers: 0, 3*2, 3*2 (the empty document takes no bytes)
        + struct.pack("<4q", 0, 1, 2, 3)  # doc_idx
    )
    assert (tmp_path / "t.idx").read_bytes() == expected
    assert (tmp_path / "t.bin").read_bytes() == struct.pack("<5H", 7, 8, 9, 10, 11)


def _one_line_error(prefix, match):
    with pytest.raises(ValueError, match=match) as err:
        IndexedDataset(prefix)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_corruption_messages(tmp_path):
    docs = [[1, 2, 3, 4], [5, 6]]
    p = tmp_path / "c"

    _write(p, docs)
    with open(f"{p}.bin", "r+b") as f:
        f.truncate(os.path.getsize(f"{p}.bin") - 3)
    assert "c.bin" in _one_line_error(p, "corrupt or truncated")

    _write(p, docs)
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[0] ^= 0xFF
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    assert "c.idx" in _one_line_error(p, "not a Megatron indexed dataset")

    _write(p, docs)
    raw = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(raw[:-5])
    _one_line_error(p, "truncated")
    (tmp_path / "c.idx").write_bytes(raw[:20])  # inside the header
    _one_line_error(p, "truncated")

    _write(p, docs)
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[9] = 2  # version
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    _one_line_error(p, "unsupported version 2")
    raw[9], raw[17] = 1, 42  # dtype code
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    _one_line_error(p, "unsupported dtype code 42")

    _write(p, docs)
    os.remove(f"{p}.bin")
    assert "run preprocessing" in _one_line_error(p, "c.bin is missing")
    _one_line_error(tmp_path / "nothing", "nothing.idx is missing")


def test_crash_before_finalize_leaves_no_pair(tmp_path):
    prefix = tmp_path / "crash"
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix) as b:
            b.add_document([1, 2, 3])
            raise RuntimeError("simulated crash")
    assert _leftovers(tmp_path) == []

    # A hard crash (no cleanup at all) leaves only a temporary name, never prefix.bin or prefix.idx.
    b = IndexedDatasetBuilder(prefix)
    b.add_document([1, 2, 3])
    b._bin.flush()
    assert not (tmp_path / "crash.bin").exists() and not (tmp_path / "crash.idx").exists()
    b.abort()
    assert _leftovers(tmp_path) == []


def test_context_manager_finalizes(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "ok") as b:
        b.add_document([3, 1, 4])
    assert IndexedDataset(tmp_path / "ok")[0].tolist() == [3, 1, 4]
