"""Tests for packing, blending, splitting and the embedded corpus (zoo/data/gpt_dataset.py).

The references are built here directly from the Python token lists written to the files: the stream of an epoch is
the documents concatenated in ``document_order(epoch)``, and the blend is the greedy rule run step by step. Far blend
positions, which no step-by-step run reaches in a test, are checked by the math: closed forms for two datasets and
for dyadic weights, and the rule itself over a window that starts from the counts found there.
"""

import json
import math
import os
import pickle
import random
import time
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch

from zoo.data.batches import micro_batch
from zoo.data.corpus import embedded_documents, split_documents
from zoo.data.gpt_dataset import (
    BlendedDataset,
    PackedDataset,
    _candidate_counts,
    _sequences_of,
    build_gpt_datasets,
    counts_before,
    parse_blend,
    prepare_embedded_corpus,
    split_document_ids,
)
from zoo.data.indexed import IndexedDataset, IndexedDatasetBuilder


def _write(prefix, docs):
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
        for d in docs:
            b.add_document(d)
    return IndexedDataset(prefix)


def _unique_docs(sizes, start=1):
    """Documents whose tokens are all distinct (consecutive ids), so a multiset check sees every single token."""
    docs, t = [], start
    for n in sizes:
        docs.append(list(range(t, t + n)))
        t += n
    return docs


def _stream(docs, order):
    return [tok for j in order for tok in docs[j]]


def test_epoch_covers_every_token_once_and_windows_overlap_by_one(tmp_path):
    L = 8
    rng = random.Random(0)
    sizes = [rng.randrange(0, 20) for _ in range(30)] + [0, 0]  # empty documents included
    sizes.append(L - (sum(sizes) - 1) % L)  # make tokens - 1 a multiple of L: no tail dropped
    docs = _unique_docs(sizes)
    ds = PackedDataset(_write(tmp_path / "d", docs), L, seed=3)
    total = sum(sizes)
    assert ds.tokens_per_epoch == total and len(ds) == (total - 1) // L
    n = len(ds)
    for epoch in (0, 1):
        order = ds.document_order(epoch).tolist()
        assert sorted(order) == list(range(len(docs)))
        reference = _stream(docs, order)
        positions = [ds.sample_position(i) for i in range(epoch * n, (epoch + 1) * n)]
        assert {e for e, _ in positions} == {epoch}
        assert sorted(k for _, k in positions) == list(range(n))  # a permutation of the windows
        windows = {k: ds[i] for i, (_, k) in zip(range(epoch * n, (epoch + 1) * n), positions)}
        for k in range(n):
            w = windows[k]
            assert w.dtype == torch.int64 and w.shape == (L + 1,)
            assert w.tolist() == reference[k * L:(k + 1) * L + 1]
            if k + 1 < n:
                assert w[-1] == windows[k + 1][0]  # one token of overlap: labels of k = inputs of k+1 shifted
        inputs = [t for k in range(n) for t in windows[k][:-1].tolist()] + [windows[n - 1][-1].item()]
        assert Counter(inputs) == Counter(t for d in docs for t in d)  # every token exactly once


def test_tail_is_dropped_and_samples_are_shuffled(tmp_path):
    docs = _unique_docs([50, 37, 12, 80, 5])
    ds = PackedDataset(_write(tmp_path / "d", docs), 10, seed=0)
    n = len(ds)
    assert n == (184 - 1) // 10
    ks = [ds.sample_position(i)[1] for i in range(n)]
    assert ks != list(range(n))
    stream = _stream(docs, ds.document_order(0).tolist())
    covered = [t for i in range(n) for t in ds[i][:-1].tolist()]
    assert sorted(covered) == sorted(stream[:n * 10])


def test_pure_function_of_index_and_epochs_differ(tmp_path):
    rng = random.Random(1)
    docs = [[rng.randrange(1, 60000) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    indexed = _write(tmp_path / "d", docs)
    a = PackedDataset(indexed, 16, seed=7)
    n = len(a)
    probe = [0, 5, n - 1, n, 3 * n + 2, 10**9, 10**12 + 17]
    got = {i: a[i] for i in probe}
    b = PackedDataset(IndexedDataset(tmp_path / "d"), 16, seed=7)
    for i in reversed(probe):  # another access order, in a fresh object
        assert torch.equal(b[i], got[i])
    assert torch.equal(a[5], got[5])  # back to epoch 0 after far epochs
    assert not np.array_equal(a.document_order(0), a.document_order(1))
    assert not np.array_equal(a.document_order(1), a.document_order(2))
    pickled = pickle.loads(pickle.dumps(a))  # reopens the files by prefix, no copy of the maps
    assert isinstance(pickled.indexed._bin, np.memmap) and torch.equal(pickled[10**9], got[10**9])
    c = PackedDataset(indexed, 16, seed=8)
    assert not all(torch.equal(c[i], got[i]) for i in probe)
    with pytest.raises(IndexError, match="negative"):
        a[-1]


def test_sample_order_is_numpys_permutation(tmp_path):
    """The order resumed runs depend on: window ``permutation(n)[i]`` of the (seed, epoch, 1) stream, as before."""
    ds = PackedDataset(_write(tmp_path / "d", _unique_docs([40, 33, 7, 90])), 5, seed=11)
    n = len(ds)
    for epoch in (0, 3):
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([11, epoch, 1])))
        assert [ds.sample_position(epoch * n + i)[1] for i in range(n)] == rng.permutation(n).tolist()


def test_documents_subset_and_errors(tmp_path):
    docs = _unique_docs([10, 20, 30, 40])
    indexed = _write(tmp_path / "d", docs)
    ds = PackedDataset(indexed, 4, seed=0, documents=[1, 3])
    assert ds.tokens_per_epoch == 60
    allowed = set(docs[1]) | set(docs[3])
    for i in range(3 * len(ds)):
        assert set(ds[i].tolist()) <= allowed
    with pytest.raises(ValueError, match=r"^30 tokens in .*d \(1 documents\) cannot fill one sample of "
                                         r"seq_length\+1 = 31 tokens; lower seq_length or add data$"):
        PackedDataset(indexed, 30, seed=0, documents=[2])
    with pytest.raises(ValueError, match="outside the 4 sequences"):
        PackedDataset(indexed, 4, seed=0, documents=[0, 4])
    with pytest.raises(ValueError, match="seq_length=0"):
        PackedDataset(indexed, 0, seed=0)


def test_micro_batch_reads_packed_samples(tmp_path):
    ds = PackedDataset(_write(tmp_path / "d", _unique_docs([100, 100])), 8, seed=0)
    x, y = micro_batch(ds, step=30, micro=1, micro_batch_size=2, accumulation=2, dp_rank=1, dp=2)
    assert x.shape == y.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])


class _Tagged:
    """Sample s of dataset d is (d, s): shows which dataset and which of its samples a blend took."""

    def __init__(self, d, n=100):
        self.d, self.n = d, n

    def __len__(self):
        return self.n

    def __getitem__(self, s):
        return self.d, s


def _reference_blend(weights, n):
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    counts = np.zeros(len(w), dtype=np.int64)
    out = []
    for i in range(n):
        d = int(np.argmax(w * (i + 1) - counts))
        out.append((d, int(counts[d])))
        counts[d] += 1
    return out


def test_blend_follows_greedy_rule_and_weights():
    weights = [0.5, 0.3, 0.2]
    ref = _reference_blend(weights, 3000)
    blend = BlendedDataset([_Tagged(d) for d in range(3)], [5, 3, 2])
    assert [blend[i] for i in range(3000)] == ref
    small = BlendedDataset([_Tagged(d) for d in range(3)], weights, block_size=7)
    assert [small[i] for i in (2999, 0, 1500, 6, 7, 13, 14)] == [ref[i] for i in (2999, 0, 1500, 6, 7, 13, 14)]
    assert len(blend) == 300
    # Shares converge to the weights; each dataset's own samples are taken in order 0, 1, 2, ...
    n = 20000
    seq = [small.locate(i) for i in range(n)]
    for d, w in enumerate(weights):
        own = [s for dd, s in seq if dd == d]
        assert own == list(range(len(own)))
        assert abs(len(own) - w * n) <= 2


def _counts_by_reference(weights, n):
    """Counts before each of the positions 0..n, by the greedy rule in plain Python (independent of the module)."""
    w = [float(x) for x in np.asarray(weights, dtype=np.float64) / sum(weights)]
    counts, out = [0] * len(w), []
    for i in range(n + 1):
        out.append(list(counts))
        errs = [w[d] * (i + 1) - counts[d] for d in range(len(w))]
        counts[errs.index(max(errs))] += 1
    return out


BLENDS = [[5, 3, 2], [1, 3], [1, 1, 1], [1, 1], [999, 1], [7, 2, 1, 0], [0, 1], [0.4, 0.05, 0.3, 0.25],
          [0.003, 0.5, 0.497], [1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("weights", BLENDS, ids=str)
def test_blend_jump_equals_the_sequential_rule(weights):
    """Any position reached directly (fresh object, a look-back that often fails first) equals the step-by-step run,
    and the true counts are always among the candidates the jump starts from."""
    n = 4000
    ref = _counts_by_reference(weights, n)
    w = BlendedDataset([_Tagged(d) for d in range(len(weights))], weights).weights.tolist()
    probes = list(range(0, 120)) + random.Random(len(weights)).sample(range(n), 80)
    for p in probes:
        assert counts_before(w, p, lookback=2) == ref[p], p
        assert (_candidate_counts(w, p) == ref[p]).all(axis=1).any(), p
    for block_size in (1, 64, 1000):
        for i in random.Random(block_size).sample(range(n), 8):
            blend = BlendedDataset([_Tagged(d) for d in range(len(weights))], weights, block_size=block_size)
            d = int(np.argmax(np.subtract(ref[i + 1], ref[i])))
            assert blend.locate(i) == (d, ref[i][d]), (block_size, i)


def _window_by_rule(weights, first, counts, n):
    """``(dataset, sample)`` of positions ``[first, first + n)`` by the rule, starting from ``counts``."""
    w = np.asarray(weights, dtype=np.float64)
    counts, out = np.array(counts, dtype=np.int64), []
    for i in range(first, first + n):
        d = int(np.argmax(w * (i + 1) - counts))
        out.append((d, int(counts[d])))
        counts[d] += 1
    return out


@pytest.mark.parametrize("weights", [[0.25, 0.75], [0.3, 0.7], [0.5, 0.375, 0.125], [5, 3, 2]], ids=str)
def test_blend_resumes_at_sample_1e9_in_under_a_second(weights):
    far = 10**9 + 12_347
    t = time.perf_counter()
    blend = BlendedDataset([_Tagged(d) for d in range(len(weights))], weights)
    got = [blend.locate(far + j) for j in range(500)]
    elapsed = time.perf_counter() - t
    assert elapsed < 1.0, f"{elapsed:.3f} s"
    w = blend.weights.tolist()
    counts = counts_before(w, far)
    assert sum(counts) == far and got == _window_by_rule(w, far, counts, 500)  # the rule holds from there on
    # The lags stay above -(D-1)/D (the bound the jump relies on), hence below (D-1)^2/D.
    lags = [Fraction(wd) * far - c for wd, c in zip(w, counts)]
    assert all(-Fraction(len(w) - 1, len(w)) - Fraction(1, 10**6) < lag < 1 for lag in lags)
    if len(w) == 2:
        # Two datasets: dataset 0 is taken at position i iff c0 <= a(i + 1) - 1/2 with a = (1 + w0 - w1)/2, so
        # after p positions c0 = floor(a p + 1/2) (induction); far from a tie the float rule agrees.
        a = (1 + Fraction(w[0]) - Fraction(w[1])) / 2
        frac = (a * far + Fraction(1, 2)) % 1
        assert min(frac, 1 - frac) > Fraction(1, 10**6)
        assert counts[0] == math.floor(a * far + Fraction(1, 2))
    elif all(Fraction(wd).denominator == 8 for wd in w):
        # Dyadic weights: the rule is exact in floats, and after a multiple of 8 positions the lags are integers
        # above -1 summing to 0, so all 0: the counts are w * p and the pattern repeats with period 8.
        period_start = far - far % 8
        assert counts_before(w, period_start) == [int(Fraction(wd) * period_start) for wd in w]
        base = _window_by_rule(w, 0, [0] * len(w), 500 + far % 8)[far % 8:]
        assert [d for d, _ in got] == [d for d, _ in base]
        assert [s for _, s in got] == [s + int(Fraction(w[d]) * period_start) for d, s in base]


def test_blend_far_index_and_bad_weights():
    a = BlendedDataset([_Tagged(0), _Tagged(1)], [0.25, 0.75], block_size=1000)
    d, s = a.locate(123_456)
    b = BlendedDataset([_Tagged(0), _Tagged(1)], [0.25, 0.75], block_size=777)
    assert b.locate(123_456) == (d, s)
    assert abs(s - (0.25 if d == 0 else 0.75) * 123_456) <= 2
    assert BlendedDataset([_Tagged(0), _Tagged(1)], [0, 1]).locate(50) == (1, 50)
    for weights, msg in [([-1, 2], "finite and >= 0"), ([0, 0], "all zero"), ([1], "1 blend weights for 2"),
                         ([float("nan"), 1], "finite"), (["x", 1], "not all numbers")]:
        with pytest.raises(ValueError, match=msg):
            BlendedDataset([_Tagged(0), _Tagged(1)], weights)


def test_parse_blend():
    assert parse_blend(["a", "b"]) == ([0.5, 0.5], ["a", "b"])
    assert parse_blend(["data/x"]) == ([1.0], ["data/x"])
    w, p = parse_blend(["0.3", "a", "0.7", "b"])
    assert p == ["a", "b"] and np.allclose(w, [0.3, 0.7])
    w, p = parse_blend("1 a 3 b")
    assert p == ["a", "b"] and np.allclose(w, [0.25, 0.75])
    for bad, msg in [([], "no data path"), (["0.3", "a", "0.7"], "weight/prefix pairs"),
                     (["a", "0.5"], "mixes prefixes"), (["0.5", "a", "b", "0.5"], "not 'weight prefix' pairs"),
                     (["0.5", "a", "0.5", "1"], "not 'weight prefix' pairs"), (["-1", "a", "2", "b"], ">= 0"),
                     (["0", "a", "0", "b"], "all zero")]:
        with pytest.raises(ValueError, match=msg):
            parse_blend(bad)


def test_split_matches_split_documents():
    for n, f, seed in [(79, 0.05, 0), (10, 0.3, 4), (2, 0.5, 1), (1000, 0.01, 9)]:
        train, valid = split_document_ids(n, f, seed)
        ref_train, ref_valid = split_documents(list(range(n)), f, seed)
        assert train.tolist() == ref_train and valid.tolist() == ref_valid
    assert split_document_ids(1, 0.5, 0)[1].size == 0


def test_build_splits_documents_disjoint(tmp_path):
    docs = _unique_docs([30] * 40)
    _write(tmp_path / "a", docs)
    train, valid = build_gpt_datasets([str(tmp_path / "a")], 16, seed=2, valid_fraction=0.1)
    assert isinstance(train, PackedDataset) and isinstance(valid, PackedDataset)
    t, v = set(train.documents.tolist()), set(valid.documents.tolist())
    assert not t & v and t | v == set(range(40)) and len(v) == 4
    # No token of a held-out document appears in training samples (tokens are unique per document).
    valid_tokens = {tok for j in v for tok in docs[j]}
    seen = {tok for i in range(len(train)) for tok in train[i].tolist()}
    assert not seen & valid_tokens
    again, _ = build_gpt_datasets(str(tmp_path / "a"), 16, seed=2, valid_fraction=0.1)
    assert torch.equal(again[11], train[11])
    train0, none = build_gpt_datasets([str(tmp_path / "a")], 16, seed=2, valid_fraction=0.0)
    assert none is None and train0.documents.size == 40


def test_build_blend_and_valid_paths(tmp_path):
    _write(tmp_path / "a", _unique_docs([30] * 20, start=1))
    _write(tmp_path / "b", _unique_docs([30] * 20, start=10_000))
    _write(tmp_path / "v", _unique_docs([30] * 5, start=20_000))
    a, b, v = (str(tmp_path / x) for x in "abv")
    train, valid = build_gpt_datasets(["1", a, "3", b], 8, seed=0)
    assert isinstance(train, BlendedDataset) and np.allclose(train.weights, [0.25, 0.75])
    assert isinstance(valid, BlendedDataset)
    from_b = sum(train[i][0].item() >= 10_000 for i in range(400))
    assert abs(from_b - 300) <= 2
    train, valid = build_gpt_datasets([a, b], 8, seed=0, valid_paths=[v])
    assert isinstance(valid, PackedDataset) and valid.prefix == v
    assert train.datasets[0].documents.size == 20 and all(t >= 20_000 for t in valid[3].tolist())


def test_build_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data path .*missing\.idx is missing; run preprocessing"):
        build_gpt_datasets([str(tmp_path / "missing")], 8, seed=0)
    _write(tmp_path / "empty", [])
    with pytest.raises(ValueError, match=r"data path .*empty holds no documents; preprocess .*launch/preprocess.py"):
        build_gpt_datasets([str(tmp_path / "empty")], 8, seed=0)
    _write(tmp_path / "zero", [[], []])
    with pytest.raises(ValueError, match=r"zero holds 2 documents but 0 tokens"):
        build_gpt_datasets([str(tmp_path / "zero")], 8, seed=0)
    _write(tmp_path / "one", [list(range(100))])
    with pytest.raises(ValueError, match=r"one has 1 document, too few to hold one out .*valid_fraction=0"):
        build_gpt_datasets([str(tmp_path / "one")], 8, seed=0)
    _write(tmp_path / "few", [list(range(5))] * 10)
    with pytest.raises(ValueError, match="lower seq_length or add data"):
        build_gpt_datasets([str(tmp_path / "few")], 8, seed=0)  # the one held-out document has 5 tokens


def test_sequences_of_multi_sequence_documents():
    class Fake:
        doc_idx = np.array([0, 2, 3, 6])

        def __len__(self):
            return 6

    assert _sequences_of(Fake(), np.array([0, 2])).tolist() == [0, 1, 3, 4, 5]
    assert _sequences_of(Fake(), np.array([1])).tolist() == [2]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    t = time.time()
    out = prepare_embedded_corpus(cache, vocab_size=384)
    return cache, out, time.time() - t


def test_prepare_embedded_corpus(embedded):
    from zoo.data.tokenizer import load_tokenizer

    cache, out, first = embedded
    assert first < 30
    docs = embedded_documents()
    ds = IndexedDataset(out["prefix"])
    assert len(ds) == len(docs) and ds.dtype == np.uint16
    chars, tokens = sum(map(len, docs)), int(ds.sizes.sum())
    assert chars / 4 < tokens < chars  # byte-level BPE with 384 tokens: between 1 and 4 characters a token
    tok = load_tokenizer(out["tokenizer"])
    assert len(tok) == 384
    for i in (0, len(docs) // 2, len(docs) - 1):
        assert ds[i][-1] == tok.eos_token_id == 0
        assert tok.decode(ds[i][:-1].tolist()) == docs[i]
    with open(os.path.join(os.path.dirname(out["prefix"]), "done.json")) as f:
        assert json.load(f)["documents"] == len(docs)
    assert sorted(os.listdir(cache)) == [os.path.basename(os.path.dirname(out["prefix"]))]  # no temp folders left


def test_prepare_embedded_corpus_reuses_and_rebuilds(embedded):
    cache, out, _ = embedded
    folder = os.path.dirname(out["prefix"])
    mtime = os.path.getmtime(out["prefix"] + ".bin")
    t = time.time()
    assert prepare_embedded_corpus(cache, vocab_size=384) == out
    assert time.time() - t < 1.0 and os.path.getmtime(out["prefix"] + ".bin") == mtime
    # A stale marker (or an interrupted build without one) is rebuilt in place.
    with open(os.path.join(folder, "done.json"), "w") as f:
        f.write("{}")
    assert prepare_embedded_corpus(cache, vocab_size=384) == out
    with open(os.path.join(folder, "done.json")) as f:
        assert json.load(f)["vocab_size"] == 384
    train, valid = build_gpt_datasets([out["prefix"]], 64, seed=0)
    assert len(train) > 10 * len(valid) > 0
