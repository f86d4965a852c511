"""BERT samples: the WordPiece tokenizer, sentence-level indexed files, sentence pairs (layout, NSP labels and
balance, determinism, padding), the synthetic pairs, the embedded corpus cache and the classification files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from zoo.data.bert_dataset import (
    DEFAULT_SPECIAL,
    BertPairDataset,
    ClassificationDataError,
    ClassificationDataset,
    SentenceIndexedDatasetBuilder,
    SyntheticBertPairs,
    build_bert_datasets,
    check_labels,
    encode_classification,
    label_names,
    open_sentence_corpus,
    prepare_embedded_bert_corpus,
    read_classification_file,
    special_tokens_of,
    split_sentences,
    train_wordpiece_tokenizer,
)
from zoo.data.indexed import IndexedDataset, IndexedDatasetBuilder
from zoo.data.masking import IGNORE_INDEX

SP = DEFAULT_SPECIAL
SEQ = 24


def toy_corpus(tmp_path, n_docs=6, seed=0):
    """Documents of 3-8 sentences; sentence j of document d holds tokens 1000 + 100*d + 10*j + k (clear of the
    special ids), so any token tells its document and sentence. Returns the prefix and the documents as lists of
    sentences."""
    rng = np.random.default_rng(seed)
    docs = []
    prefix = tmp_path / "toy"
    with SentenceIndexedDatasetBuilder(prefix) as b:
        for d in range(n_docs):
            sentences = [[1000 + 100 * d + 10 * j + k for k in range(int(rng.integers(2, 7)))]
                         for j in range(int(rng.integers(3, 9)))]
            for s in sentences:
                b.add_sentence(s)
            b.end_document()
            docs.append(sentences)
    return str(prefix), docs


def doc_and_sentence(token: int) -> tuple[int, int]:
    return (token - 1000) // 100, (token % 100) // 10


def unmasked(sample) -> torch.Tensor:
    """The token ids before masking: the labels where a token was chosen, the input elsewhere."""
    (ids, _, _), (labels, _) = sample
    return torch.where(labels != IGNORE_INDEX, labels, ids)


def test_wordpiece_tokenizer_specials_and_pairs(tmp_path):
    from zoo.data.tokenizer import load_tokenizer

    texts = ["The cat sat on the mat.", "A dog barked at the cat!", "Sentences are split here."] * 20
    train_wordpiece_tokenizer(texts, 200, tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")  # AutoTokenizer, offline
    ids = [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id]
    assert ids == [0, 1, 2, 3, 4]
    assert special_tokens_of(tok) == SP
    enc = tok("The cat", "sat")
    assert enc["input_ids"][0] == 2 and enc["input_ids"].count(3) == 2
    assert enc["token_type_ids"] == [0, 0, 0, 0, 1, 1]
    assert tok.decode(tok("the CAT sat")["input_ids"], skip_special_tokens=True) == "the cat sat"  # uncased
    assert len(tok) <= 200
    with pytest.raises(ValueError, match="too small"):
        train_wordpiece_tokenizer(texts, 10, tmp_path / "tiny")


def test_split_sentences():
    text = "First sentence here. Second one! Is it third? yes it is.\n\nNew paragraph\nwraps lines. 2 items."
    assert split_sentences(text) == ["First sentence here.", "Second one!", "Is it third? yes it is.",
                                     "New paragraph wraps lines.", "2 items."]
    assert split_sentences("  \n\n ") == []


def test_sentence_builder_writes_document_boundaries(tmp_path):
    prefix, docs = toy_corpus(tmp_path)
    ds = IndexedDataset(prefix)
    assert len(ds) == sum(len(d) for d in docs)
    assert np.diff(np.asarray(ds.doc_idx)).tolist() == [len(d) for d in docs]
    assert ds[0].tolist() == docs[0][0] and ds[len(docs[0])].tolist() == docs[1][0]
    # One sequence per document is refused for pairs, with the way out.
    with IndexedDatasetBuilder(tmp_path / "flat") as b:
        b.add_document([5, 6, 7])
        b.add_document([8, 9])
    with pytest.raises(ValueError, match="one sequence per sentence"):
        open_sentence_corpus(str(tmp_path / "flat"))


def test_pairs_layout_labels_and_nsp(tmp_path):
    prefix, docs = toy_corpus(tmp_path)
    ds = BertPairDataset(IndexedDataset(prefix), SEQ, seed=7, vocab_size=2000, special=SP)
    n, random_count, padded = 400, 0, 0
    for i in range(n):
        pair = ds.pair(i)
        ids, types, mask = pair["input_ids"], pair["token_type_ids"], pair["attention_mask"]
        assert ids.shape == types.shape == mask.shape == (SEQ,)
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any()
        padded += length < SEQ
        assert (ids[length:] == SP.pad).all() and (types[length:] == 0).all()
        seps = (ids == SP.sep).nonzero().flatten().tolist()
        assert ids[0] == SP.cls and len(seps) == 2 and seps[1] == length - 1
        a, b = ids[1:seps[0]].tolist(), ids[seps[0] + 1:seps[1]].tolist()
        assert a and b
        assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:length] == 1).all()
        (da, _sa), (db, sb) = doc_and_sentence(a[0]), doc_and_sentence(b[0])
        assert all(doc_and_sentence(t)[0] == da for t in a)
        if pair["label"] == 0:  # B continues A: same document, from the sentence after A's last
            assert db == da and b[0] == docs[db][sb][0] and sb > doc_and_sentence(a[-1])[1]
            if length < SEQ:  # nothing truncated: A ends with a whole sentence and B starts with the next
                assert sb == doc_and_sentence(a[-1])[1] + 1 and a[-1] == docs[da][sb - 1][-1]
        else:  # B comes from another document
            random_count += 1
            assert db != da
    assert 0.4 < random_count / n < 0.6, random_count
    assert padded > 0  # documents' last chunks and BERT's short targets leave padding


def test_samples_are_deterministic_masked_and_epoch_seeded(tmp_path):
    prefix, _ = toy_corpus(tmp_path)
    make = lambda seed=7: BertPairDataset(IndexedDataset(prefix), SEQ, seed=seed, vocab_size=2000,  # noqa: E731
                                          special=SP)
    a, b = make(), make()
    for i in (0, 5, len(a) + 3, 10**9):  # any i >= 0, in any order
        for x, y in zip(a[i], b[i]):
            for u, v in zip(x, y):
                assert torch.equal(u, v)
    (ids, _, mask), (labels, nsp) = a[3]
    chosen = labels != IGNORE_INDEX
    assert chosen.any() and not chosen[~mask.bool()].any()  # never padding
    assert not torch.isin(labels[chosen], torch.tensor(SP.ids)).any()  # never specials
    assert nsp.dim() == 0
    # Epochs visit the chunks in different orders, and another seed gives other samples.
    n = len(a)
    first = [unmasked(a[i]).tolist() for i in range(n)]
    second = [unmasked(a[n + i]).tolist() for i in range(n)]
    assert first != second
    assert [unmasked(make(8)[i]).tolist() for i in range(n)] != first
    with pytest.raises(IndexError):
        a.pair(-1)


def test_datasets_split_documents_and_blend(tmp_path):
    prefix, docs = toy_corpus(tmp_path, n_docs=10)
    train, valid = build_bert_datasets([prefix], SEQ, 3, vocab_size=2000, special=SP, valid_fraction=0.2)
    train_docs = {doc_and_sentence(int(unmasked(train[i])[1]))[0] for i in range(200)}
    valid_docs = {doc_and_sentence(int(unmasked(valid[i])[1]))[0] for i in range(50)}
    assert train_docs and valid_docs and not train_docs & valid_docs  # A never crosses the split
    train, valid = build_bert_datasets([prefix], SEQ, 3, vocab_size=2000, special=SP, valid_fraction=0)
    assert valid is None and len(train) > 0
    blend, _ = build_bert_datasets(["0.5", prefix, "0.5", prefix], SEQ, 3, vocab_size=2000, special=SP,
                                   valid_fraction=0)
    assert unmasked(blend[0]).shape == (SEQ,)


def test_synthetic_pairs_have_padding_and_learnable_nsp():
    ds = SyntheticBertPairs(512, 32, seed=1)
    labels, padded = [], 0
    for i in range(200):
        pair = ds.pair(i)
        ids, mask = pair["input_ids"], pair["attention_mask"]
        padded += bool((mask == 0).any())
        seps = (ids == SP.sep).nonzero().flatten().tolist()
        a, b = ids[1:seps[0]].tolist(), ids[seps[0] + 1:seps[1]].tolist()
        if pair["label"] == 0:
            assert b == (a * 32)[:len(b)]  # B repeats A
        labels.append(int(pair["label"]))
        assert min(a + b) > max(SP.ids)
    assert padded > 150 and 0.35 < np.mean(labels) < 0.65
    (ids, types, mask), (mlm, nsp) = ds[5]
    assert torch.equal(ds[5][0][0], ids) and (mlm != IGNORE_INDEX).any()


def test_embedded_corpus_is_built_once(tmp_path):
    from zoo.data.tokenizer import load_tokenizer

    first = prepare_embedded_bert_corpus(tmp_path, 512)
    marker = tmp_path / "bert-embedded-py{}.{}-v512".format(*__import__("sys").version_info[:2]) / "done.json"
    stamp = marker.stat().st_mtime_ns
    assert prepare_embedded_bert_corpus(tmp_path, 512) == first and marker.stat().st_mtime_ns == stamp
    tok = load_tokenizer(first["tokenizer"])
    assert len(tok) == 512 and special_tokens_of(tok) == SP
    ds = open_sentence_corpus(first["prefix"])
    assert len(ds) > 5 * (len(ds.doc_idx) - 1)  # several sentences per document
    # An interrupted build (no done.json) is rebuilt, not reused.
    marker.unlink()
    assert prepare_embedded_bert_corpus(tmp_path, 512) == first and marker.is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    train, valid = build_bert_datasets([first["prefix"]], 64, 1, vocab_size=len(tok), special=SP)
    text = tok.decode(unmasked(train[0]).tolist())
    assert text.startswith("[CLS]") and text.count("[SEP]") == 2
    # A given tokenizer (continued pretraining): the corpus is tokenized with it, cached under its hash.
    other = tmp_path / "other-tok"
    train_wordpiece_tokenizer(["the cat sat on the mat"] * 5, 100, other)
    (other / "model.safetensors").write_bytes(b"not a tokenizer file")  # a model folder: only tokenizer files go
    mine = prepare_embedded_bert_corpus(tmp_path, 512, other)
    assert mine["prefix"] != first["prefix"] and not (Path(mine["tokenizer"]) / "model.safetensors").exists()
    assert load_tokenizer(mine["tokenizer"]).get_vocab() == load_tokenizer(other).get_vocab()
    assert int(np.max(IndexedDataset(mine["prefix"])._bin)) < 100


# ---------------------------------------------------------------------------------------------------------------
# Classification files
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory):
    from zoo.data.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("wp")
    train_wordpiece_tokenizer(["good movie", "bad film", "a long text about nothing at all"] * 10, 100, folder)
    return load_tokenizer(folder)


def test_classification_files_and_encoding(tmp_path, wordpiece):
    csv = tmp_path / "train.csv"
    csv.write_text('text,label\ngood movie,pos\n"bad, film",neg\ngood film,pos\n')
    table = read_classification_file(csv)
    assert table.pairs is None and label_names(table) == ["neg", "pos"]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in [{"text": "good", "text_pair": "movie", "label": 1},
                                                            {"text": "a long text about nothing at all", "label": 0}]))
    pairs = read_classification_file(jsonl)
    assert label_names(pairs) == [0, 1] and pairs.pairs == ["movie", None]
    enc, truncated = encode_classification(pairs, wordpiece, 6, [0, 1], SP)
    assert truncated == 1 and enc["labels"].tolist() == [1, 0]
    assert enc["input_ids"][0].tolist()[:5] == [SP.cls, *wordpiece("good")["input_ids"][1:-1], SP.sep,
                                                *wordpiece("movie")["input_ids"][1:-1], SP.sep][:5]
    assert enc["token_type_ids"][0].tolist() == [0, 0, 0, 1, 1, 0]
    assert enc["attention_mask"][0].tolist() == [1] * 5 + [0]
    assert enc["input_ids"][1, -1] == SP.sep and enc["attention_mask"][1].all()  # truncated, [SEP] kept
    # Validation padding: label -100 past the end; shuffled training order per epoch.
    valid = ClassificationDataset(enc, 0, shuffle=False)
    assert valid[1][1] == 0 and valid[2][1] == IGNORE_INDEX
    train = ClassificationDataset(enc, 0)
    assert sorted(int(train[i][1]) for i in range(2)) == [0, 1]


def test_classification_bad_files(tmp_path):
    missing = tmp_path / "nolabel.csv"
    missing.write_text("text,target\nx,1\n")
    with pytest.raises(ClassificationDataError, match="no 'label' column"):
        read_classification_file(missing)
    with pytest.raises(ClassificationDataError, match="does not exist"):
        read_classification_file(tmp_path / "nope.csv")
    with pytest.raises(ClassificationDataError, match="unknown format"):
        read_classification_file(missing.rename(tmp_path / "data.txt"))
    good = tmp_path / "t.csv"
    good.write_text("text,label\na,x\nb,y\n")
    other = tmp_path / "v.csv"
    other.write_text("text,label\na,x\nb,z\n")
    with pytest.raises(ClassificationDataError, match=r"label\(s\) \['z'\]"):
        check_labels(read_classification_file(other), label_names(read_classification_file(good)))
