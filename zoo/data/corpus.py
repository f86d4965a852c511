"""The embedded default corpus: the help texts that ship with every Python install.

``pydoc_data.topics.topics`` maps a help topic (``"assert"``, ``"formatstrings"``, ...) to its text, about half a
megabyte of English prose with code in it. It is in the standard library, so a tokenizer or a small model can be
trained with no download and no network, and every machine sees the same bytes for a given Python version.
Splitting by document (not by line) keeps the held-out set free of text that also sits in the training set.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Iterable, Sequence

WORD = re.compile(r"[A-Za-z]+")  # a word: a maximal run of ASCII letters


def embedded_documents() -> list[str]:
    """One document per pydoc topic, in sorted-key order (dict order is not a contract); empty ones dropped."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics) if topics[key].strip()]


def split_documents(docs: Sequence[str], valid_fraction: float = 0.05, seed: int = 0) -> tuple[list[str], list[str]]:
    """A seeded held-out split by document: ``(train, valid)``, each keeping the input order.

    With two documents or more, each side gets at least one, so a tiny corpus still yields a validation loss.
    The choice depends only on ``(len(docs), valid_fraction, seed)``: a private ``random.Random`` keeps it
    independent of the global random state.
    """
    if not 0.0 <= valid_fraction <= 1.0:
        raise ValueError(f"valid_fraction={valid_fraction} is outside [0, 1]; pass a fraction such as 0.05")
    n = len(docs)
    if n < 2:
        return list(docs), []
    n_valid = min(max(1, round(n * valid_fraction)), n - 1)
    chosen = set(random.Random(seed).sample(range(n), n_valid))
    train = [d for i, d in enumerate(docs) if i not in chosen]
    valid = [d for i, d in enumerate(docs) if i in chosen]
    return train, valid


@functools.lru_cache(maxsize=1)
def corpus_words() -> frozenset[str]:
    """Every word (maximal run of ASCII letters, case kept) of the embedded corpus, all documents."""
    return frozenset(w for doc in embedded_documents() for w in WORD.findall(doc))


def known_words(texts: Iterable[str], vocabulary: frozenset[str] | None = None) -> tuple[int, int]:
    """``(known, total)``: of the words in ``texts``, how many occur in ``vocabulary`` (default: the embedded
    corpus's, case-sensitive). A word a text ends inside (a sample cut at its token budget) is not counted."""
    vocabulary = corpus_words() if vocabulary is None else vocabulary
    known = total = 0
    for text in texts:
        words = [(m.group(), m.end()) for m in WORD.finditer(text)]
        if words and words[-1][1] == len(text):
            words.pop()
        total += len(words)
        known += sum(w in vocabulary for w, _ in words)
    return known, total
