"""GPT training samples from Megatron indexed datasets: packing, blending, splitting, and the embedded corpus.

The ideas are Megatron-LM's ``GPTDataset`` and ``BlendedDataset`` (megatron/core/datasets), rewritten so that every
sample is a pure function of its index: ``dataset[i]`` depends only on (files, seq_length, seed, documents, i), for
any ``i >= 0``. A resumed run therefore continues exactly from its step number, with no saved iterator state, and
any rank can read any sample.

Packing (``PackedDataset``). GPT training has no padding: the chosen documents (each already ending with an EOD
token when preprocessed with ``--append-eod``) are concatenated into one token stream and cut into windows of
``seq_length + 1`` tokens, consecutive windows sharing one token, so that ``inputs = s[:-1]`` and
``labels = s[1:]`` cover every next-token prediction of the stream once::

    stream  d7 d2 d9 d0 ...  (documents in a seeded order, a new order each epoch)
    sample k covers stream tokens [k*L, (k+1)*L + 1)          (L = seq_length)

The samples of an epoch are then visited in a second seeded order. Megatron builds ``doc_idx``/``sample_idx``/
``shuffle_idx`` arrays over all epochs up front and caches them on disk; here one epoch's document order, its int64
cumulative offsets (O(#documents)) and its sample permutation are built on demand (with numpy) and only the
current epoch is kept, so nothing is cached on disk and ``i`` may be arbitrarily large. The index costs 4 bytes per
sample of one epoch (the permutation, int32) and 16 per document (order and offsets, int64), about 10 s per 10^8
samples to build (numpy's shuffle, whose exact order resumed runs depend on), once per epoch. Tokens are read from the
memory-mapped ``.bin`` slice by slice; the corpus is never loaded.

Blending (``BlendedDataset``). Megatron's greedy rule: position ``i`` goes to the dataset whose realised share lags
its target weight the most, ``argmax_d(w_d * (i + 1) - count_d)``, and takes that dataset's next own sample. The rule
is sequential, but the counts after any number of positions can be found without walking there: every reachable
state keeps each lag above ``-(D - 1)/D``, which leaves a handful of candidate count vectors at any position, and
running all candidates from a little before ``i`` until they agree gives the true counts (``counts_before``, coupling
from the past). So position ``10**9`` costs milliseconds, like position 0, and the blend keeps no per-position
array: the assignment is computed and cached a block of positions at a time, starting from those counts.
"""

from __future__ import annotations

import math
import operator
import os
import random
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import torch

from zoo.data.cache import cached_build
from zoo.data.indexed import IndexedDataset, IndexedDatasetBuilder

__all__ = ["PackedDataset", "BlendedDataset", "counts_before", "parse_blend", "build_gpt_datasets",
           "prepare_embedded_corpus", "split_document_ids"]


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    # SeedSequence mixes the tuple into independent streams: (seed, epoch, 0) orders documents, (..., 1) samples.
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & (2**64 - 1), epoch, stream])))


class PackedDataset:
    """Megatron-style packed GPT samples of ``seq_length + 1`` tokens over the sequences ``documents`` of ``indexed``.

    ``len()`` is the number of samples in one epoch, ``(tokens_in_epoch - 1) // seq_length``; the last
    ``(tokens_in_epoch - 1) % seq_length`` tokens of each epoch's stream are not used in that epoch (they are a
    different tail in the next epoch's order). ``ds[i]`` is defined for every ``i >= 0``: epoch ``i // len``,
    position ``i % len`` of that epoch's sample permutation. Returns a ``torch.int64`` tensor.
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, seed: int, documents: Sequence[int] | None = None):
        if int(seq_length) < 1:
            raise ValueError(f"seq_length={seq_length} must be >= 1")
        self.indexed, self.seq_length, self.seed = indexed, int(seq_length), int(seed)
        self.prefix = indexed.prefix
        n = len(indexed)
        if documents is None:
            docs = np.arange(n, dtype=np.int64)
        else:
            docs = np.asarray(documents)
            if docs.ndim != 1 or (docs.size and docs.dtype.kind not in "iu"):
                raise ValueError(f"documents must be a 1-D array of integer sequence ids, got shape {docs.shape} "
                                 f"dtype {docs.dtype}")
            docs = docs.astype(np.int64, copy=False)
            if docs.size and (docs.min() < 0 or docs.max() >= n):
                raise ValueError(f"documents hold ids in [{docs.min()}, {docs.max()}], outside the {n} sequences "
                                 f"of {self.prefix}")
        self.documents = docs
        self.tokens_per_epoch = int(indexed.sizes[docs].sum(dtype=np.int64)) if docs.size else 0
        self.samples_per_epoch = (self.tokens_per_epoch - 1) // self.seq_length if self.tokens_per_epoch else 0
        if self.samples_per_epoch < 1:
            raise ValueError(f"{self.tokens_per_epoch} tokens in {self.prefix} ({docs.size} documents) cannot fill "
                             f"one sample of seq_length+1 = {self.seq_length + 1} tokens; lower seq_length or add data")
        self._epoch: int | None = None  # the one cached epoch: its order, offsets and sample permutation

    def __len__(self) -> int:
        return self.samples_per_epoch

    # Pickling (DataLoader workers under spawn) reopens the files by prefix instead of copying the memory maps.
    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in ("indexed", "_order", "_cum", "_perm")}
        state["_epoch"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.indexed = IndexedDataset(self.prefix)

    def _load_epoch(self, epoch: int) -> None:
        if self._epoch == epoch:
            return
        order = _rng(self.seed, epoch, 0).permutation(self.documents)
        cum = np.zeros(order.size + 1, dtype=np.int64)
        np.cumsum(self.indexed.sizes[order], dtype=np.int64, out=cum[1:])
        n = self.samples_per_epoch
        # Shuffling an int32 arange in place gives the same permutation as ``permutation(n)`` (the same draws, the
        # values only moved) at 4 bytes per sample instead of 8 plus a copy.
        perm = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
        _rng(self.seed, epoch, 1).shuffle(perm)
        self._order, self._cum, self._perm, self._epoch = order, cum, perm, epoch

    def document_order(self, epoch: int) -> np.ndarray:
        """The sequence ids in the order they are concatenated in ``epoch``'s stream."""
        self._load_epoch(epoch)
        return self._order

    def sample_position(self, i: int) -> tuple[int, int]:
        """``(epoch, k)``: sample ``i`` is window ``k`` (covering stream tokens ``[k*L, (k+1)*L+1)``) of ``epoch``."""
        i = operator.index(i)
        if i < 0:
            raise IndexError(f"sample {i} is negative; samples are addressed by i >= 0")
        epoch, pos = divmod(i, self.samples_per_epoch)
        self._load_epoch(epoch)
        return epoch, int(self._perm[pos])

    def stream_sample(self, epoch: int, k: int) -> torch.Tensor:
        """Window ``k`` of ``epoch``'s stream, before the sample shuffle."""
        if not 0 <= k < self.samples_per_epoch:
            raise IndexError(f"window {k} is outside [0, {self.samples_per_epoch}) of {self.prefix}")
        self._load_epoch(epoch)
        start, remaining = k * self.seq_length, self.seq_length + 1
        cum, order = self._cum, self._order
        # side="right": the last document starting at or before `start`, which skips empty documents.
        j = int(np.searchsorted(cum, start, side="right")) - 1
        offset = start - int(cum[j])
        pieces = []
        while remaining:
            size = int(cum[j + 1] - cum[j])
            take = min(size - offset, remaining)
            if take > 0:
                pieces.append(self.indexed.get(int(order[j]), offset, take))
                remaining -= take
            j, offset = j + 1, 0
        out = pieces[0].astype(np.int64) if len(pieces) == 1 else np.concatenate(pieces).astype(np.int64)
        return torch.from_numpy(out)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.stream_sample(*self.sample_position(i))


def _normalize_weights(weights: Sequence[float], count: int | None = None) -> np.ndarray:
    try:
        w = np.asarray([float(x) for x in weights], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"blend weights {list(weights)!r} are not all numbers") from None
    if count is not None and w.size != count:
        raise ValueError(f"{w.size} blend weights for {count} datasets; pass one weight per dataset")
    if w.size == 0:
        raise ValueError("no datasets to blend; pass at least one dataset and weight")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"blend weights {w.tolist()} must be finite and >= 0")
    if w.sum() <= 0:
        raise ValueError(f"blend weights {w.tolist()} are all zero; give at least one dataset a positive weight")
    return w / w.sum()


def _greedy_steps(weights: Sequence[float], first: int, counts: list[int], n: int,
                  which: bytearray | array | None = None) -> None:
    """Positions ``[first, first + n)`` by the greedy rule: ``counts`` (taken before ``first``) is advanced in place,
    and ``which[t]`` records the dataset of position ``first + t`` when given (it must start zeroed).

    The choice is sequential (each depends on the counts so far), so it is a plain Python loop, about 1 s per
    million positions. This loop is the definition of the blend: every faster path is checked against it.
    """
    w = list(weights)
    others = range(1, len(w))
    pos = first
    for t in range(n):
        pos += 1
        best, best_err = 0, w[0] * pos - counts[0]
        for d in others:
            err = w[d] * pos - counts[d]
            if err > best_err:  # ties go to the lowest index, as with argmax
                best, best_err = d, err
        if best and which is not None:
            which[t] = best
        counts[best] += 1


def _greedy_block(weights: Sequence[float], first: int, counts: Sequence[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Dataset index and per-dataset sample index of positions ``[first, first + n)``, given ``counts`` at ``first``;
    the sample indices follow with numpy (the k-th pick of ``d`` in the block is its sample ``counts[d] + k``)."""
    which = bytearray(n) if len(weights) <= 256 else array("H", bytes(2 * n))
    _greedy_steps(weights, first, list(counts), n, which)
    which_np = np.frombuffer(which, dtype=np.uint8 if isinstance(which, bytearray) else np.uint16)
    own = np.empty(n, dtype=np.int64)
    for d in range(len(weights)):
        at = np.flatnonzero(which_np == d)
        own[at] = np.arange(counts[d], counts[d] + at.size, dtype=np.int64)
    return which_np, own


def _candidate_counts(weights: Sequence[float], q: int) -> np.ndarray:
    """``[K, D]``: every count vector the greedy rule can hold after ``q`` positions, the true one among them.

    The dataset taken at a position has the largest lag ``w_d * pos - count_d``; the lags sum to about 1, so that
    one was at least ``1/D`` and is at least ``1/D - 1`` after the take, and a lag only grows between takes. Hence
    ``count_d <= w_d * q + (D - 1)/D`` for every reachable state. The float rounding of the rule (``2**-53`` of
    ``pos`` per product, at most twice) and the weights' sum missing 1 by a few ulps widen the bound by ``slack``;
    the bound is evaluated in exact rationals, so no rounding here can drop the true state. With the counts summing
    to ``q`` this leaves a few candidates for 2-3 datasets (at most ``C(2D-2, D-1)`` or so in general).
    """
    D = len(weights)
    w = [Fraction(x) for x in weights]
    slack = abs(sum(w) - 1) * q + Fraction(q + D, 2**50)
    upper = [math.floor(wd * q + Fraction(D - 1, D) + slack) for wd in w]
    rest = [sum(upper[d + 1:]) for d in range(D)]  # the most the datasets after d can still take
    out: list[list[int]] = []

    def fill(prefix: list[int], d: int, left: int) -> None:
        if d == D - 1:
            out.append(prefix + [left])  # left <= upper[d] holds: rest[d - 1] bounded it
            return
        for c in range(max(0, left - rest[d]), min(upper[d], left) + 1):
            fill(prefix + [c], d + 1, left - c)

    if sum(upper) >= q:
        fill([], 0, q)
    return np.asarray(out, dtype=np.int64).reshape(-1, D)


def _coalesce(weights: Sequence[float], q: int, states: np.ndarray, n: int) -> tuple[np.ndarray, int]:
    """Run every row of ``states`` (counts after ``q`` positions) through the greedy rule, all at once, until they
    agree or ``n`` positions are done; return the distinct rows left and the positions done.

    ``w * pos - counts`` in float64 and ``argmax`` (first maximum) are the same IEEE operations, in the same
    order, as the scalar rule in ``_greedy_steps``, so each row follows exactly the path the scalar rule would.
    """
    w = np.asarray(weights, dtype=np.float64)
    rows = np.arange(len(states))
    t = 0
    while t < n and len(states) > 1:
        t += 1
        states[rows, np.argmax(w * (q + t) - states, axis=1)] += 1
        if t % 8 == 0 or t == n:
            states = np.unique(states, axis=0)
            rows = np.arange(len(states))
    return states, t


def counts_before(weights: Sequence[float], p: int, lookback: int = 64) -> list[int]:
    """How many of the positions ``[0, p)`` the greedy rule gives each dataset, in time independent of ``p``.

    Coupling from the past: the state after ``q = p - lookback`` positions is one of ``_candidate_counts(q)``; the
    rule is deterministic, so if all candidates reach the same counts by ``p``, those are the true counts. They
    meet within a few positions for weights of similar size; a candidate that gave a small dataset one sample too
    many may wait up to about ``1 / weight`` positions (measured: at most 152 with a 0.001 weight, 968 with 0.0002
    among 10 datasets; milliseconds either way). If they have not met, the look-back grows fourfold; at ``q = 0``
    there is one candidate (all zeros) and this is the sequential rule itself, so the answer is always exact, and at
    worst as slow as walking there.
    """
    if p >= 2**53:
        raise IndexError(f"sample {p} is at or past 2**53, where positions are no longer exact float64 values")
    T = lookback
    while True:
        q = max(p - T, 0)
        candidates = _candidate_counts(weights, q)
        if len(candidates) == 0:
            raise RuntimeError(f"no count vector after {q} positions satisfies the greedy bound for weights {weights}")
        states, done = _coalesce(weights, q, candidates, p - q)
        if len(states) == 1:
            counts = [int(x) for x in states[0]]
            _greedy_steps(weights, q + done, counts, p - q - done)
            return counts
        T *= 4


class BlendedDataset:
    """A deterministic weighted blend of index-addressable datasets (Megatron's greedy BlendedDataset rule).

    ``ds[i]`` for any ``i >= 0`` is ``datasets[d][s]`` with ``(d, s) = ds.locate(i)``: ``d`` maximises
    ``w_d * (i + 1) - count_d`` (``count_d`` = positions before ``i`` given to ``d``, ties to the lowest ``d``) and
    ``s = count_d``, so each dataset's own samples are taken in order and its share stays within about one sample of
    ``w_d * i``. ``len()`` is the sum of the datasets' lengths (one nominal epoch); indexing is not limited by it.

    The assignment is computed in blocks of ``block_size`` positions (about 16 ms for 16K positions); the last
    ``cached_blocks`` are kept with the counts they end with, so reading on from a block costs nothing extra, and a
    block reached any other way starts from ``counts_before`` (milliseconds at any position). Memory: 9 bytes per
    position of a cached block, nothing per position of the blend.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], block_size: int = 1 << 14, cached_blocks: int = 4):
        self.datasets = list(datasets)
        self.weights = _normalize_weights(weights, len(self.datasets))
        self.block_size, self.cached_blocks = int(block_size), int(cached_blocks)
        if self.block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        # block -> (dataset of each position, sample of each position, counts at the block's end)
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray, list[int]]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        hit = self._blocks.get(b)
        if hit is not None:
            self._blocks.move_to_end(b)
            return hit
        weights, first = self.weights.tolist(), b * self.block_size
        before = self._blocks.get(b - 1)
        start = before[2] if before is not None else counts_before(weights, first)
        which, own = _greedy_block(weights, first, start, self.block_size)
        counts = np.bincount(which, minlength=len(start))
        block = which, own, [int(x) + int(y) for x, y in zip(start, counts)]
        self._blocks[b] = block
        while len(self._blocks) > self.cached_blocks:
            self._blocks.popitem(last=False)
        return block

    def locate(self, i: int) -> tuple[int, int]:
        """``(dataset_index, dataset_sample_index)`` of position ``i``."""
        i = operator.index(i)
        if i < 0:
            raise IndexError(f"sample {i} is negative; samples are addressed by i >= 0")
        b, t = divmod(i, self.block_size)
        which, own, _ = self._block(b)
        return int(which[t]), int(own[t])

    def __getitem__(self, i: int):
        d, s = self.locate(i)
        return self.datasets[d][s]


def _is_number(s: str) -> bool:
    try:
        float(s)
    except (TypeError, ValueError):
        return False
    return True


def parse_blend(paths: Sequence[str] | str) -> tuple[list[float], list[str]]:
    """Megatron's ``--data-path``: ``[prefix, ...]`` (equal weights) or ``[w1, prefix1, w2, prefix2, ...]``.

    Returns ``(weights, prefixes)`` with the weights normalised to sum to 1. A single string is split on whitespace.
    """
    items = paths.split() if isinstance(paths, str) else [str(p) for p in paths]
    if not items:
        raise ValueError("no data path given; pass prefixes ('a b') or weighted prefixes ('0.3 a 0.7 b')")
    numeric = [_is_number(x) for x in items]
    if not numeric[0]:
        if any(numeric):
            bad = items[numeric.index(True)]
            raise ValueError(f"data path {items} mixes prefixes with the number {bad!r}; use either "
                             f"'prefix ...' or 'weight prefix weight prefix ...'")
        return [1.0 / len(items)] * len(items), items
    if len(items) % 2:
        raise ValueError(f"weighted data path {items} has {len(items)} items; it needs weight/prefix pairs "
                         f"('0.3 a 0.7 b')")
    weights, prefixes = items[0::2], items[1::2]
    for w, p in zip(weights, prefixes):
        if not _is_number(w) or _is_number(p):
            raise ValueError(f"weighted data path {items} is not 'weight prefix' pairs at {w!r} {p!r}; "
                             f"use '0.3 a 0.7 b'")
    return _normalize_weights(weights).tolist(), prefixes


def split_document_ids(num_documents: int, valid_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train_ids, valid_ids)``, sorted int64: the same held-out choice as ``corpus.split_documents`` makes on a
    list of ``num_documents`` documents, without building that list."""
    if not 0.0 <= valid_fraction <= 1.0:
        raise ValueError(f"valid_fraction={valid_fraction} is outside [0, 1]; pass a fraction such as 0.05")
    n = int(num_documents)
    if n < 2:
        return np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64)
    n_valid = min(max(1, round(n * valid_fraction)), n - 1)
    valid = np.sort(np.fromiter(random.Random(seed).sample(range(n), n_valid), dtype=np.int64, count=n_valid))
    mask = np.ones(n, dtype=bool)
    mask[valid] = False
    return np.flatnonzero(mask).astype(np.int64), valid


def _sequences_of(indexed: IndexedDataset, doc_ids: np.ndarray) -> np.ndarray:
    """Sequence ids of documents ``doc_ids``; Megatron files may hold several sequences (sentences) per document."""
    doc_idx = np.asarray(indexed.doc_idx)
    if doc_idx.size == len(indexed) + 1 and np.array_equal(doc_idx, np.arange(doc_idx.size)):
        return doc_ids  # one sequence per document, as this zoo writes
    starts, ends = doc_idx[doc_ids], doc_idx[doc_ids + 1]
    lengths = ends - starts
    # Concatenated aranges [starts[j], ends[j]) without a Python loop.
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + offsets


def _open(prefix: str) -> IndexedDataset:
    try:
        ds = IndexedDataset(prefix)
    except ValueError as e:
        raise ValueError(f"data path {prefix}: {e}") from None
    n_docs = max(len(ds.doc_idx) - 1, 0)
    if n_docs == 0 or len(ds) == 0:
        raise ValueError(f"data path {prefix} holds no documents; preprocess a non-empty input into it "
                         f"(python launch/preprocess.py --input FILE --output-prefix {prefix} ...)")
    if int(ds.sizes.sum(dtype=np.int64)) == 0:
        raise ValueError(f"data path {prefix} holds {n_docs} documents but 0 tokens; preprocess a non-empty input "
                         f"into it (python launch/preprocess.py --input FILE --output-prefix {prefix} ...)")
    return ds


def _blend(parts: list, weights: list[float]):
    return parts[0] if len(parts) == 1 else BlendedDataset(parts, weights)


def build_gpt_datasets(paths: Sequence[str] | str, seq_length: int, seed: int, valid_fraction: float = 0.05,
                       valid_paths: Sequence[str] | str | None = None):
    """``(train, valid)`` packed datasets from Megatron data paths (see ``parse_blend``).

    Without ``valid_paths``, each dataset's documents are split with ``split_document_ids(valid_fraction, seed)``:
    train packs the rest, valid the held-out ones (``valid`` is None when ``valid_fraction`` is 0). With
    ``valid_paths``, train uses all documents of ``paths`` and valid those of ``valid_paths``. Several prefixes
    give a ``BlendedDataset`` with the blend's weights.
    """
    weights, prefixes = parse_blend(paths)
    opened = [_open(p) for p in prefixes]
    if valid_paths is not None:
        v_weights, v_prefixes = parse_blend(valid_paths)
        train = [PackedDataset(ds, seq_length, seed) for ds in opened]
        valid = [PackedDataset(_open(p), seq_length, seed + 1) for p in v_prefixes]
        return _blend(train, weights), _blend(valid, v_weights)
    train, valid = [], []
    for ds in opened:
        n_docs = len(ds.doc_idx) - 1
        if valid_fraction == 0:  # split_documents would still hold one out; 0 means no validation set
            train.append(PackedDataset(ds, seq_length, seed))
            continue
        train_ids, valid_ids = split_document_ids(n_docs, valid_fraction, seed)
        if valid_ids.size == 0:
            raise ValueError(f"data path {ds.prefix} has {n_docs} document, too few to hold one out for validation; "
                             f"add documents, pass valid_paths, or set valid_fraction=0")
        train.append(PackedDataset(ds, seq_length, seed, _sequences_of(ds, train_ids)))
        try:
            valid.append(PackedDataset(ds, seq_length, seed + 1, _sequences_of(ds, valid_ids)))
        except ValueError as e:
            raise ValueError(f"validation split (valid_fraction={valid_fraction}): {e}, raise valid_fraction or "
                             f"pass valid_paths") from None
    return _blend(train, weights), (_blend(valid, weights) if valid else None)


EMBEDDED_NAME = "embedded_text_document"


def _embedded_marker(vocab_size: int, n_docs: int) -> dict:
    return {"vocab_size": int(vocab_size), "python": "{}.{}".format(*sys.version_info[:2]), "documents": n_docs}


def prepare_embedded_corpus(cache_dir: str | os.PathLike, vocab_size: int, seed: int = 0) -> dict[str, str]:
    """Tokenizer and indexed dataset of the embedded pydoc corpus, built once into ``cache_dir`` and reused.

    Trains a byte-level BPE of ``vocab_size`` on ``embedded_documents()`` and writes every document followed by the
    EOS id (Megatron's ``--append-eod``) as one uint16 indexed dataset. Returns ``{"tokenizer": folder,
    "prefix": prefix}``. The result sits in ``cache_dir/embedded-py<X.Y>-v<vocab>/``, built and reused as
    ``zoo.data.cache.cached_build`` does (``done.json``: vocab size, Python version, document count). ``seed``
    does not change the output (BPE training and tokenization are deterministic); it is accepted for a uniform
    interface.
    """
    from zoo.data.corpus import embedded_documents
    from zoo.data.tokenizer import load_tokenizer, train_bpe_tokenizer

    del seed
    docs = embedded_documents()
    marker = _embedded_marker(vocab_size, len(docs))

    def build(folder: str) -> None:
        train_bpe_tokenizer(docs, vocab_size, os.path.join(folder, "tokenizer"))
        tok = load_tokenizer(os.path.join(folder, "tokenizer"))
        eos = tok.eos_token_id
        encoded = tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False)
        with IndexedDatasetBuilder(os.path.join(folder, EMBEDDED_NAME), dtype=np.uint16) as builder:
            for enc in encoded:
                builder.add_document(enc.ids + [eos])

    final = cached_build(cache_dir, f"embedded-py{marker['python']}-v{int(vocab_size)}", marker, build)
    return {"tokenizer": os.path.join(final, "tokenizer"), "prefix": os.path.join(final, EMBEDDED_NAME)}
