"""BERT training samples: sentence-pair pretraining (masked LM + next-sentence prediction) and classification.

Pretraining (Devlin et al. 2018, Sec. 3.1 and A.2; the sample layout of Megatron-LM's ``BertDataset``):

- The corpus is a Megatron indexed dataset with **one sequence per sentence**; ``doc_idx`` marks where each document's
  sentences start (Megatron's ``preprocess_data.py --split-sentences`` writes the same thing, so its files work
  here). :class:`SentenceIndexedDatasetBuilder` writes it; :func:`prepare_embedded_bert_corpus` builds one from the
  embedded pydoc corpus with a WordPiece tokenizer trained on it (:func:`train_wordpiece_tokenizer`).
- Each document's sentences are cut into **chunks**: consecutive sentences until ``seq_length - 3`` tokens are
  reached, or with probability 0.1 a random shorter target (Megatron's samples mapping and ``short_seq_prob``);
  chunks of one sentence are dropped (A and B both need one).
- **Sample i** (:class:`BertPairDataset`) is chunk ``perm_e[i mod n]`` of epoch ``e = i // n`` (a seeded chunk order
  per epoch). From a generator seeded by ``(seed, i)``: A = the chunk's first ``k`` sentences (``k`` uniform in
  ``[1, sentences - 1]``); with probability 1/2, B = the rest of the chunk (NSP label 0), else B = consecutive
  sentences from a random position of a random *other* document, about as long as the rest of the chunk (label
  1; the same document when the split has only one). The pair is truncated to ``seq_length`` (longer segment
  first), laid out as ``[CLS] A [SEP] B [SEP]`` and padded (``zoo.data.masking.build_sentence_pair``), then
  corrupted by ``mask_tokens`` with a seed drawn from the same generator. So a sample is a pure function of
  (files, documents, seq_length, seed, i), for any ``i >= 0``: the same in every data-parallel layout and after a
  resume.
- A sample is ``((input_ids, token_type_ids, attention_mask), (mlm_labels, nsp_label))``: ``[s]`` long tensors and a
  0-d label; the training loop stacks them part by part.

:class:`SyntheticBertPairs` gives the same sample structure from random tokens (no files; tests), with padding.

Classification (:func:`read_classification_file`, :class:`ClassificationDataset`): csv or jsonl files with ``text``,
optional ``text_pair`` and ``label`` columns, read with ``datasets``. Labels become ids in the sorted order of the
training file's distinct labels. ``[CLS] text [SEP]`` (or ``[CLS] text [SEP] text_pair [SEP]``) is padded to
``seq_length``; longer examples are truncated (longest segment first) and counted.

Special tokens: the trained WordPiece vocabulary starts with ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (ids 0-4), which is
also the synthetic layout (:data:`DEFAULT_SPECIAL`); any other tokenizer's ids come from :func:`special_tokens_of`.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from zoo.data.cache import cached_build
from zoo.data.indexed import IndexedDataset, IndexedDatasetBuilder
from zoo.data.masking import IGNORE_INDEX, SpecialTokens, build_sentence_pair, mask_tokens

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
DEFAULT_SPECIAL = SpecialTokens(cls=2, sep=3, mask=4, pad=0, extra=(1,))
EMBEDDED_BERT_NAME = "embedded_sentences"


def _rng(seed: int, a: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & (2**64 - 1), int(a), stream])))


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer and sentences
# ---------------------------------------------------------------------------------------------------------------


def train_wordpiece_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike):
    """An uncased WordPiece vocabulary of at most ``vocab_size`` tokens learned from ``texts``, as BERT's: BERT's
    normalizer (lowercase, accents stripped) and pre-tokenizer, specials ``[PAD] [UNK] [CLS] [SEP] [MASK]`` = ids
    0-4. Saved with ``BertTokenizerFast.save_pretrained``, so ``AutoTokenizer.from_pretrained(out_dir)`` loads it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizerFast

    if vocab_size < 64:
        raise ValueError(f"vocab_size={vocab_size} is too small for a WordPiece vocabulary (5 specials plus the "
                         f"characters and their ## forms); pass vocab_size >= 64")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    # limit_alphabet keeps rare characters (they become [UNK]) from crowding out the subwords of a small vocabulary.
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                        limit_alphabet=min(1000, vocab_size // 3), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    hf = BertTokenizerFast(tokenizer_object=tok, do_lower_case=True, unk_token="[UNK]", sep_token="[SEP]",
                           pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    return hf


def special_tokens_of(tokenizer) -> SpecialTokens:
    """The BERT special ids of a HF tokenizer; every other special id (``[UNK]``, ...) is never masked nor drawn."""
    ids = {}
    for name in ("cls", "sep", "mask", "pad"):
        value = getattr(tokenizer, f"{name}_token_id", None)
        if value is None:
            raise ValueError(f"the tokenizer has no {name} token; BERT needs [CLS], [SEP], [MASK] and [PAD] "
                             f"(train one with train_wordpiece_tokenizer)")
        ids[name] = int(value)
    extra = tuple(sorted(set(int(i) for i in tokenizer.all_special_ids) - set(ids.values())))
    return SpecialTokens(**ids, extra=extra)


_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of a document: paragraphs (blank-line separated), whitespace collapsed, split after ``.``, ``!`` or
    ``?`` followed by a capital, digit, quote or bracket. A heuristic (Megatron uses NLTK's punkt), good enough for
    prose; a code block stays one "sentence"."""
    out = []
    for paragraph in _PARAGRAPH.split(text):
        paragraph = " ".join(paragraph.split())
        out.extend(s for s in _SENTENCE_END.split(paragraph) if s)
    return out


class SentenceIndexedDatasetBuilder(IndexedDatasetBuilder):
    """``IndexedDatasetBuilder`` with several sequences (sentences) per document: ``add_sentence`` appends one
    sequence, ``end_document`` closes the current document (an empty one is skipped, as Megatron does). The
    ``.idx`` then records the document boundaries in ``doc_idx``; the files are written as crash-safely as the base
    class's (temporary names, ``.bin`` moved first, the ``.idx`` last)."""

    def __init__(self, prefix, dtype=np.uint16):
        super().__init__(prefix, dtype)
        self._doc_idx = [0]

    def add_sentence(self, token_ids: Sequence[int]) -> None:
        super().add_document(token_ids)

    def add_document(self, token_ids: Sequence[int]) -> None:
        """A whole document as one sentence (keeps the base interface meaningful)."""
        self.add_sentence(token_ids)
        self.end_document()

    def end_document(self) -> None:
        if len(self) > self._doc_idx[-1]:
            self._doc_idx.append(len(self))

    def finalize(self) -> None:
        if not self._closed:
            self.end_document()  # sentences after the last end_document form the last document
        super().finalize()

    def _doc_index(self) -> np.ndarray:
        return np.asarray(self._doc_idx, dtype=np.int64)


def write_sentence_corpus(documents: Iterable[str], tokenizer, prefix: str | os.PathLike) -> int:
    """Split each document into sentences, tokenize them (no specials) and write a sentence-level indexed dataset;
    returns the number of documents written."""
    from zoo.data.indexed import best_dtype

    with SentenceIndexedDatasetBuilder(prefix, dtype=best_dtype(len(tokenizer))) as builder:
        n = 0
        for doc in documents:
            encoded = tokenizer.backend_tokenizer.encode_batch(split_sentences(doc), add_special_tokens=False)
            sentences = [enc.ids for enc in encoded if enc.ids]
            for ids in sentences:
                builder.add_sentence(ids)
            builder.end_document()
            n += bool(sentences)
    return n


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def _tokenizer_digest(folder) -> str:
    """A short hash of a tokenizer folder's files: the cache key of a corpus tokenized with it."""
    import hashlib

    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def _embedded_marker(vocab_size: int, n_docs: int, tokenizer: str | None) -> dict:
    return {"kind": "bert-sentences-1", "vocab_size": int(vocab_size), "python": "{}.{}".format(*sys.version_info[:2]),
            "documents": n_docs, "tokenizer": tokenizer}


def prepare_embedded_bert_corpus(cache_dir: str | os.PathLike, vocab_size: int,
                                 tokenizer_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """WordPiece tokenizer and sentence-level indexed dataset of the embedded pydoc corpus, built once, reused.

    ``cache_dir/bert-embedded-py<X.Y>-v<vocab>/`` holds ``tokenizer/`` and ``embedded_sentences.{bin,idx}``. With
    ``tokenizer_dir`` (e.g. the tokenizer of a model pretraining continues from) the corpus is tokenized with that
    one instead, into ``...-tok<hash of its files>/``, and ``vocab_size`` is not used. Built and reused as
    ``zoo.data.cache.cached_build`` does. Returns ``{"tokenizer", "prefix"}``.
    """
    from zoo.data.corpus import embedded_documents
    from zoo.data.tokenizer import load_tokenizer

    docs = embedded_documents()
    digest = None if tokenizer_dir is None else _tokenizer_digest(tokenizer_dir)
    marker = _embedded_marker(0 if digest else vocab_size, len(docs), digest)
    name = f"tok{digest}" if digest else f"v{int(vocab_size)}"

    def build(folder: str) -> None:
        if tokenizer_dir is None:
            train_wordpiece_tokenizer(docs, vocab_size, os.path.join(folder, "tokenizer"))
        else:
            os.makedirs(os.path.join(folder, "tokenizer"))
            for file in _TOKENIZER_FILES:  # the tokenizer only (the folder may be a whole model folder)
                if os.path.isfile(os.path.join(tokenizer_dir, file)):
                    shutil.copy2(os.path.join(tokenizer_dir, file), os.path.join(folder, "tokenizer", file))
        tok = load_tokenizer(os.path.join(folder, "tokenizer"))
        write_sentence_corpus(docs, tok, os.path.join(folder, EMBEDDED_BERT_NAME))

    final = cached_build(cache_dir, f"bert-embedded-py{marker['python']}-{name}", marker, build)
    return {"tokenizer": os.path.join(final, "tokenizer"), "prefix": os.path.join(final, EMBEDDED_BERT_NAME)}


# ---------------------------------------------------------------------------------------------------------------
# Pretraining samples
# ---------------------------------------------------------------------------------------------------------------


def document_count(indexed: IndexedDataset) -> int:
    return max(len(indexed.doc_idx) - 1, 0)


class BertPairDataset:
    """MLM + NSP samples over the documents ``documents`` (default all) of a sentence-level indexed dataset.

    ``len()`` is the number of chunks (samples per epoch); ``ds[i]`` is defined for every ``i >= 0`` (see the module
    docstring). ``vocab_size`` is the tokenizer's: random replacement tokens are drawn below it.
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, seed: int, *, vocab_size: int,
                 special: SpecialTokens = DEFAULT_SPECIAL, documents: Sequence[int] | None = None,
                 nsp_probability: float = 0.5, short_seq_probability: float = 0.1):
        if seq_length < 5:
            raise ValueError(f"seq_length {seq_length} leaves no room for [CLS] A [SEP] B [SEP]; use >= 5")
        self.indexed, self.seq_length, self.seed = indexed, int(seq_length), int(seed)
        self.vocab_size, self.special, self.nsp_probability = int(vocab_size), special, float(nsp_probability)
        self.prefix = indexed.prefix
        n_docs = document_count(indexed)
        docs = np.arange(n_docs, dtype=np.int64) if documents is None else np.asarray(documents, dtype=np.int64)
        if docs.size and (docs.min() < 0 or docs.max() >= n_docs):
            raise ValueError(f"documents hold ids outside the {n_docs} documents of {self.prefix}")
        self.documents = docs
        doc_idx = np.asarray(indexed.doc_idx, dtype=np.int64)
        self._doc_start, self._doc_end = doc_idx[docs], doc_idx[docs + 1]
        self.chunks = self._chunks(indexed.sizes, self._doc_start, self._doc_end, self.seq_length - 3,
                                   _rng(self.seed, 0, 2), short_seq_probability)
        if len(self.chunks) == 0:
            raise ValueError(f"{self.prefix}: none of its {docs.size} documents has two sentences, which a sentence "
                             f"pair needs; pass a sentence-level corpus (one sequence per sentence, several per "
                             f"document)")
        self._epoch, self._order = None, None

    @staticmethod
    def _chunks(sizes, starts, ends, max_tokens: int, rng: np.random.Generator, short_p: float) -> np.ndarray:
        """``[n, 3]`` rows ``(document position, first sentence, end sentence)``: consecutive sentences of one
        document until a target length (the last sentence of a document is never left alone), two at least. The
        target is ``max_tokens``, or with probability ``short_p`` uniform in ``[2, max_tokens]`` (BERT's and
        Megatron's ``short_seq_prob``: the model also sees short inputs, and batches hold padding)."""
        def target():
            return int(rng.integers(2, max_tokens + 1)) if rng.random() < short_p else max_tokens

        out = []
        for pos, (s0, s1) in enumerate(zip(starts.tolist(), ends.tolist())):
            if s1 - s0 < 2:
                continue
            lengths = sizes[s0:s1].tolist()
            first, tokens, goal = s0, 0, target()
            for s in range(s0, s1):
                tokens += lengths[s - s0]
                remaining = s1 - s - 1
                if (tokens >= goal and s + 1 - first >= 2 and remaining != 1) or remaining == 0:
                    if s + 1 - first >= 2:
                        out.append((pos, first, s + 1))
                    first, tokens, goal = s + 1, 0, target()
        return np.asarray(out, dtype=np.int64).reshape(-1, 3)

    def __len__(self) -> int:
        return len(self.chunks)

    def _tokens(self, first: int, end: int) -> list[int]:
        return [int(t) for s in range(first, end) for t in self.indexed.get(s)]

    def _chunk(self, i: int) -> np.ndarray:
        epoch, pos = divmod(i, len(self.chunks))
        if self._epoch != epoch:
            self._order, self._epoch = _rng(self.seed, epoch, 0).permutation(len(self.chunks)), epoch
        return self.chunks[self._order[pos]]

    def _random_segment(self, rng: np.random.Generator, doc_pos: int, target: int) -> list[int]:
        """Consecutive sentences from a random start in a random other document, up to ``target`` tokens."""
        n = len(self.documents)
        other = doc_pos
        if n > 1:
            other = int(rng.integers(n - 1))
            other += other >= doc_pos  # uniform over the other documents
        s0, s1 = int(self._doc_start[other]), int(self._doc_end[other])
        out = []
        s = int(rng.integers(s0, s1)) if s1 > s0 else s0
        while s < s1 and len(out) < target:
            out.extend(int(t) for t in self.indexed.get(s))
            s += 1
        return out

    def pair(self, i: int) -> dict:
        """Sample ``i`` before masking: ``build_sentence_pair``'s dict (``label`` is the NSP label)."""
        if i < 0:
            raise IndexError(f"sample {i} is negative; samples are addressed by i >= 0")
        doc_pos, first, end = (int(x) for x in self._chunk(i))
        rng = _rng(self.seed, i, 1)
        split = first + int(rng.integers(1, end - first))
        a = self._tokens(first, split)
        is_random = bool(rng.random() < self.nsp_probability)
        if is_random:
            rest = int(self.indexed.sizes[split:end].sum())
            b = self._random_segment(rng, doc_pos, max(1, min(rest, self.seq_length - 3 - len(a))))
        else:
            b = self._tokens(split, end)
        pair = build_sentence_pair(a, b, seq_length=self.seq_length, label=int(is_random), special=self.special)
        pair["mask_seed"] = int(rng.integers(2**62))
        return pair

    def __getitem__(self, i: int):
        pair = self.pair(i)
        ids, labels = mask_tokens(pair["input_ids"], pair["mask_seed"], vocab_size=self.vocab_size,
                                  special=self.special)
        return (ids, pair["token_type_ids"], pair["attention_mask"]), (labels, pair["label"])


class SyntheticBertPairs:
    """Pretraining samples from random tokens, no files: sample ``i`` is a pure function of ``(seed, i)``.

    A is 1 to ``(seq_length - 3) / 2`` Zipf-distributed ordinary tokens; B is a prefix of A repeated (NSP label 0)
    or fresh random tokens (label 1), of a random length, so most samples are padded. Masked-LM and NSP are both
    learnable (B copies A), with the special-token layout of :data:`DEFAULT_SPECIAL`.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0, special: SpecialTokens = DEFAULT_SPECIAL):
        if seq_length < 5:
            raise ValueError(f"seq_length {seq_length} leaves no room for [CLS] A [SEP] B [SEP]; use >= 5")
        self.vocab_size, self.seq_length, self.seed, self.special = vocab_size, seq_length, seed, special
        first = max(special.ids) + 1
        if vocab_size <= first:
            raise ValueError(f"vocab_size {vocab_size} leaves no ordinary token after the special ids {special.ids}")
        self.ordinary = np.arange(first, vocab_size)
        p = 1.0 / np.arange(1, self.ordinary.size + 1)
        self.probs = p / p.sum()

    def __len__(self) -> int:
        return 2**31

    def pair(self, i: int) -> dict:
        rng = _rng(self.seed, i, 3)
        max_tokens = self.seq_length - 3
        a = rng.choice(self.ordinary, size=int(rng.integers(1, max(1, max_tokens // 2) + 1)), p=self.probs)
        is_random = bool(rng.random() < 0.5)
        n_b = int(rng.integers(1, max_tokens - a.size + 1))
        b = rng.choice(self.ordinary, size=n_b, p=self.probs) if is_random else np.resize(a, n_b)
        pair = build_sentence_pair(a.tolist(), b.tolist(), seq_length=self.seq_length, label=int(is_random),
                                   special=self.special)
        pair["mask_seed"] = int(rng.integers(2**62))
        return pair

    def __getitem__(self, i: int):
        pair = self.pair(i)
        ids, labels = mask_tokens(pair["input_ids"], pair["mask_seed"], vocab_size=self.vocab_size,
                                  special=self.special)
        return (ids, pair["token_type_ids"], pair["attention_mask"]), (labels, pair["label"])


def open_sentence_corpus(prefix: str) -> IndexedDataset:
    """A sentence-level indexed dataset, with one-line errors for files that cannot serve BERT pretraining."""
    try:
        ds = IndexedDataset(prefix)
    except ValueError as e:
        raise ValueError(f"data path {prefix}: {e}") from None
    if document_count(ds) == 0 or int(ds.sizes.sum(dtype=np.int64)) == 0:
        raise ValueError(f"data path {prefix} holds no tokens; preprocess a non-empty corpus into it")
    if len(ds) == document_count(ds):
        raise ValueError(f"data path {prefix} holds one sequence per document; BERT's sentence pairs need one "
                         f"sequence per sentence (Megatron's preprocess_data.py --split-sentences, or "
                         f"zoo.data.bert_dataset.write_sentence_corpus)")
    return ds


def build_bert_datasets(paths: Sequence[str], seq_length: int, seed: int, *, vocab_size: int,
                        special: SpecialTokens, valid_fraction: float = 0.05,
                        valid_paths: Sequence[str] | None = None):
    """``(train, valid)`` pair datasets from sentence-level data paths (Megatron blends, see ``parse_blend``).

    Without ``valid_paths`` each dataset's documents are split by ``split_document_ids(valid_fraction, seed)``
    (valid is None for 0); the validation samples use ``seed + 1``.
    """
    from zoo.data.gpt_dataset import BlendedDataset, parse_blend, split_document_ids

    def make(ds, s, documents=None):
        return BertPairDataset(ds, seq_length, s, vocab_size=vocab_size, special=special, documents=documents)

    def blend(parts, weights):
        return parts[0] if len(parts) == 1 else BlendedDataset(parts, weights)

    weights, prefixes = parse_blend(list(paths))
    opened = [open_sentence_corpus(p) for p in prefixes]
    if valid_paths is not None:
        v_weights, v_prefixes = parse_blend(list(valid_paths))
        return (blend([make(ds, seed) for ds in opened], weights),
                blend([make(open_sentence_corpus(p), seed + 1) for p in v_prefixes], v_weights))
    train, valid = [], []
    for ds in opened:
        if valid_fraction == 0:
            train.append(make(ds, seed))
            continue
        train_ids, valid_ids = split_document_ids(document_count(ds), valid_fraction, seed)
        if valid_ids.size == 0:
            raise ValueError(f"data path {ds.prefix} has one document, too few to hold one out for validation; "
                             f"add documents, pass valid_paths, or set valid_fraction=0")
        train.append(make(ds, seed, train_ids))
        try:
            valid.append(make(ds, seed + 1, valid_ids))
        except ValueError as e:
            raise ValueError(f"validation split (valid_fraction={valid_fraction}): {e}; raise valid_fraction or "
                             f"pass valid_paths") from None
    return blend(train, weights), (blend(valid, weights) if valid else None)


# ---------------------------------------------------------------------------------------------------------------
# Classification
# ---------------------------------------------------------------------------------------------------------------


class ClassificationDataError(ValueError):
    """A classification file that cannot be used; the message is one line naming the file and the fix."""


FORMATS = {".csv": "csv", ".jsonl": "json", ".json": "json"}


@dataclass(frozen=True)
class ClassificationTable:
    path: str
    texts: list
    pairs: list | None  # text_pair column, or None when the file has none
    labels: list

    def __len__(self) -> int:
        return len(self.texts)


def read_classification_file(path: str | os.PathLike) -> ClassificationTable:
    """The ``text``, optional ``text_pair`` and ``label`` columns of a local csv or jsonl file (via ``datasets``)."""
    path = Path(path)
    if not path.is_file():
        raise ClassificationDataError(f"classification file {path} does not exist")
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ClassificationDataError(f"classification file {path}: unknown format {path.suffix!r}; use .csv or "
                                      f".jsonl with columns text, label (and optionally text_pair)")
    stat = path.stat()
    return _read_table(str(path.resolve()), kind, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _read_table(path: str, kind: str, mtime_ns: int, size: int) -> ClassificationTable:
    del mtime_ns, size  # part of the cache key only: an edited file is read again
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="zoo-datasets-") as cache:  # nothing left in ~/.cache
        try:
            table = datasets.load_dataset(kind, data_files=path, split="train", cache_dir=cache, keep_in_memory=True)
        except Exception as e:  # datasets raises many kinds for unreadable files
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ClassificationDataError(f"classification file {path} cannot be read as {kind}: {first}") from None
    columns = list(table.column_names)
    for need in ("text", "label"):
        if need not in columns:
            raise ClassificationDataError(f"classification file {path} has no {need!r} column (columns: {columns}); "
                                          f"each row needs text and label (text_pair optional)")
    if len(table) == 0:
        raise ClassificationDataError(f"classification file {path} has no rows")
    texts, labels = list(table["text"]), list(table["label"])
    pairs = list(table["text_pair"]) if "text_pair" in columns else None
    for row, (t, y) in enumerate(zip(texts, labels), start=1):
        if not isinstance(t, str):
            raise ClassificationDataError(f"classification file {path}, row {row}: text is {t!r}, not a string")
        if y is None or (isinstance(y, float) and y != y):
            raise ClassificationDataError(f"classification file {path}, row {row}: the label is missing")
    if pairs is not None:
        pairs = [p if isinstance(p, str) else None for p in pairs]
    return ClassificationTable(path, texts, pairs, labels)


def label_names(table: ClassificationTable) -> list:
    """The distinct labels of a training table in sorted order (by value; by text when types are mixed)."""
    distinct = set(table.labels)
    try:
        return sorted(distinct)
    except TypeError:
        return sorted(distinct, key=str)


def check_labels(valid: ClassificationTable, names: Sequence) -> None:
    unseen = sorted({y for y in valid.labels if y not in set(names)}, key=str)
    if unseen:
        raise ClassificationDataError(f"validation file {valid.path} has label(s) {unseen[:5]} that the training "
                                      f"file does not have (its labels: {list(names)[:10]}); the classifier only "
                                      f"knows the training file's labels")


def encode_classification(table: ClassificationTable, tokenizer, seq_length: int, names: Sequence | None,
                          special: SpecialTokens) -> tuple[dict[str, torch.Tensor], int]:
    """``({input_ids, token_type_ids, attention_mask: [N, s], labels: [N]}, truncated)``: each example as
    ``[CLS] text [SEP]`` or ``[CLS] text [SEP] text_pair [SEP]``, padded to ``seq_length``; ``truncated`` counts
    the examples that did not fit (cut longest segment first). Labels are indices into ``names`` (-100 for all
    when ``names`` is None: prediction only)."""
    enc = tokenizer.backend_tokenizer.encode_batch(table.texts, add_special_tokens=False)
    pair_enc = None
    if table.pairs is not None:
        pair_enc = tokenizer.backend_tokenizer.encode_batch([p or "" for p in table.pairs], add_special_tokens=False)
    rows, truncated = {"input_ids": [], "token_type_ids": [], "attention_mask": []}, 0
    for k, e in enumerate(enc):
        a = e.ids
        b = pair_enc[k].ids if pair_enc is not None and table.pairs[k] is not None else None
        if b is None:
            truncated += len(a) + 2 > seq_length
            ids = [special.cls, *a[:seq_length - 2], special.sep]
            pad = seq_length - len(ids)
            row = {"input_ids": ids + [special.pad] * pad, "token_type_ids": [0] * seq_length,
                   "attention_mask": [1] * len(ids) + [0] * pad}
        else:
            truncated += len(a) + len(b) + 3 > seq_length
            row = {k2: v.tolist() for k2, v in build_sentence_pair(a, b, seq_length=seq_length,
                                                                  special=special).items() if k2 != "label"}
        for key in rows:
            rows[key].append(row[key])
    out = {k: torch.tensor(v, dtype=torch.long) for k, v in rows.items()}
    ids_of = {y: k for k, y in enumerate(names or ())}
    out["labels"] = torch.tensor([ids_of[y] if names is not None else IGNORE_INDEX for y in table.labels],
                                 dtype=torch.long)
    return out, truncated


class ClassificationDataset:
    """Encoded examples as samples ``((input_ids, token_type_ids, attention_mask), label)``.

    ``shuffle``: sample ``i`` is example ``perm_e[i mod N]`` of epoch ``e = i // N`` (a seeded order per epoch), for
    any ``i >= 0``. Without it (validation): example ``i`` for ``i < N`` and beyond that a padding sample with label
    -100, which the loss and the metrics skip, so an evaluation of ``ceil(N / G)`` global batches sees every
    example exactly once.
    """

    def __init__(self, encoded: dict[str, torch.Tensor], seed: int, shuffle: bool = True):
        self.encoded, self.seed, self.shuffle = encoded, int(seed), shuffle
        self.n = int(encoded["labels"].numel())
        self._epoch, self._order = None, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        e = self.encoded
        if self.shuffle:
            epoch, pos = divmod(int(i), self.n)
            if self._epoch != epoch:
                self._order, self._epoch = _rng(self.seed, epoch, 0).permutation(self.n), epoch
            k = int(self._order[pos])
        elif i < self.n:
            k = int(i)
        else:
            s = e["input_ids"].shape[1]
            zeros = torch.zeros(s, dtype=torch.long)
            return (zeros, zeros, zeros.clone()), torch.tensor(IGNORE_INDEX)
        return (e["input_ids"][k], e["token_type_ids"][k], e["attention_mask"][k]), e["labels"][k]
