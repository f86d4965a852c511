"""Tests for the embedded pydoc corpus and its held-out split (zoo/data/corpus.py)."""

from zoo.data.corpus import embedded_documents, split_documents


def test_embedded_documents_nonempty_and_deterministic():
    docs = embedded_documents()
    assert len(docs) > 10
    assert all(isinstance(d, str) and d.strip() for d in docs)
    assert sum(map(len, docs)) > 100_000
    assert embedded_documents() == docs


def test_split_is_disjoint_covering_and_seeded():
    docs = [f"doc {i}" for i in range(100)]
    train, valid = split_documents(docs, valid_fraction=0.05, seed=0)
    assert len(valid) == 5 and len(train) == 95
    assert set(train).isdisjoint(valid)
    assert sorted(train + valid) == sorted(docs)
    assert split_documents(docs, 0.05, seed=0) == (train, valid)
    assert split_documents(docs, 0.05, seed=1) != (train, valid)


def test_split_keeps_one_each_side():
    train, valid = split_documents(["a", "b"], valid_fraction=0.0)
    assert len(train) == len(valid) == 1 and sorted(train + valid) == ["a", "b"]
    for frac in (0.0, 0.5, 1.0):
        train, valid = split_documents(["a", "b", "c"], valid_fraction=frac)
        assert train and valid and sorted(train + valid) == ["a", "b", "c"]
    assert split_documents(["only"]) == (["only"], [])


def test_split_of_embedded_corpus():
    docs = embedded_documents()
    train, valid = split_documents(docs)
    assert train and valid and len(train) + len(valid) == len(docs)


def test_known_words_counts_corpus_words_and_skips_a_cut_last_word():
    from zoo.data.corpus import corpus_words, known_words

    vocabulary = frozenset({"the", "cat", "on"})
    # "sat" is unknown; "ma" is where the text stops, so it is not judged; digits and symbols split words
    assert known_words(["the cat sat on the ma"], vocabulary) == (4, 5)
    assert known_words(["cat9on__the.", "x"], vocabulary) == (3, 3)
    words = corpus_words()
    assert {"assert", "return", "the", "Python"} <= words and "zzyzx" not in words
    assert known_words(["The value of an expression is returned. "]) == (7, 7)
