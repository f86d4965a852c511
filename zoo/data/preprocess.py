"""Text -> Megatron indexed dataset (``OUT.bin``/``OUT.idx``), in the spirit of Megatron-LM's ``preprocess_data.py``.

    python launch/preprocess.py --input docs.jsonl --output-prefix data/docs --tokenizer tok/ [--workers 4]
    python launch/preprocess.py --input a.parquet --input b.txt --output-prefix data/ab \\
        --train-tokenizer --vocab-size 32000 --tokenizer-out tok/
    python launch/preprocess.py --input embedded --output-prefix data/pydoc --tokenizer tok/
    python launch/preprocess.py --hf-dataset json --hf-data-files x.jsonl --output-prefix data/x --tokenizer tok/
    python launch/preprocess.py --hf-dataset HUB/NAME --hf-config C --hf-split train --output-prefix ... --tokenizer ...

Documents come from the inputs one at a time, so an input of any size streams through in bounded memory:

* ``jsonl`` (``.jsonl``, ``.ndjson``; also ``.json`` files that do not start with ``[``): one JSON object per line,
  the text under ``--json-key`` (default ``text``); read line by line.
* ``json``: one JSON array of such objects; parsed incrementally, one element at a time.
* ``parquet``: the ``--json-key`` column, read in record batches (pyarrow), never the whole table.
* ``text`` (any other extension): one document per paragraph, i.e. per run of non-blank lines; blank lines separate
  documents and are not part of them (the last newline of a paragraph is dropped, inner newlines are kept). With
  ``--text-document file`` each file is one document instead.
* ``--input embedded``: the pydoc corpus that ships with Python (``zoo.data.corpus.embedded_documents``).
* ``--hf-dataset NAME``: any ``datasets.load_dataset`` source in streaming mode (a hub dataset, or a packaged
  loader such as ``json``/``parquet``/``text`` on ``--hf-data-files``), the text under ``--json-key``.

``.gz`` inputs are decompressed on the fly (jsonl, json, text). Records whose text is null or empty give no
document. Each document is tokenized and, with ``--append-eod`` (the default here), followed by the tokenizer's EOS
id, so packed samples see document boundaries. The dtype is ``best_dtype(len(tokenizer))`` (uint16 below 65500
tokens). ``--train-tokenizer`` first trains a byte-level BPE on the same inputs (a separate streaming pass).

``--workers N`` tokenizes in N processes: the main process reads the inputs and cuts them into batches (the same
batches for any N), the workers encode them, and the main process writes the results in input order, with at most
``2 N`` batches in flight, so the ``.bin``/``.idx`` are byte-identical to one worker's and memory stays bounded.

Bad input is reported as one ``error: ...`` line on stderr with exit code 2, and the checks that can be made up
front (inputs exist and hold a first document with the key, the tokenizer loads) run before any output is created.
A failure later (a bad record deep in a file) removes the partial output: the ``.bin``/``.idx`` and the trained
tokenizer are written under temporary names and moved into place only at the end.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import io
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from zoo.flags import Parser

EMBEDDED = "embedded"
FORMATS = ("auto", "jsonl", "json", "text", "parquet")
_BATCH_DOCS, _BATCH_CHARS = 512, 1 << 20  # documents per tokenizer call, bounded by size
_READ_CHARS = 1 << 20


class InputError(Exception):
    """A problem with the command line or the inputs; reported as ``error: <message>`` with exit code 2."""


# ---------------------------------------------------------------------------------------------------- readers


def _open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _record_text(record, key: str, where: str) -> str | None:
    if not isinstance(record, dict):
        raise InputError(f"{where} is a {type(record).__name__}, not an object with a {key!r} field")
    if key not in record:
        keys = ", ".join(map(str, record)) or "none"
        raise InputError(f"{where} has no key {key!r} (keys: {keys}); pass --json-key with one of them")
    text = record[key]
    if text is not None and not isinstance(text, str):
        raise InputError(f"{where}: {key!r} holds a {type(text).__name__}, not a string")
    return text


def _iter_jsonl(path: str, key: str) -> Iterator[str | None]:
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path} line {line_no} is not JSON ({e.msg}); pass --format to read it "
                                 f"differently") from None
            yield _record_text(record, key, f"{path} line {line_no}")


def _iter_json(path: str, key: str) -> Iterator[str | None]:
    """Elements of one JSON array, decoded one at a time from a growing buffer (never the whole file)."""
    decoder = json.JSONDecoder()
    with _open_text(path) as f:
        buf, pos, eof = "", 0, False

        def skip_ws() -> bool:  # advance to the next non-blank character; False at the end of the file
            nonlocal buf, pos, eof
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf):
                    return True
                if eof:
                    return False
                buf, pos = f.read(_READ_CHARS), 0
                eof = not buf

        if not skip_ws() or buf[pos] != "[":
            raise InputError(f"{path} is not a JSON array of records; for one object per line use --format jsonl")
        pos += 1
        n = 0
        while True:
            if not skip_ws():
                raise InputError(f"{path} ends inside its JSON array; the file is truncated")
            if buf[pos] == "]":
                return
            if n:
                if buf[pos] != ",":
                    raise InputError(f"{path}: expected ',' or ']' after element {n} of the JSON array")
                pos += 1
                if not skip_ws():
                    raise InputError(f"{path} ends inside its JSON array; the file is truncated")
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as e:
                    if eof:
                        raise InputError(f"{path}: element {n + 1} of the JSON array is not valid JSON "
                                         f"({e.msg})") from None
                    # Read at least as much again as is buffered, so a long element costs linear time overall.
                    chunk = f.read(max(_READ_CHARS, len(buf) - pos))
                    buf, pos, eof = buf[pos:] + chunk, 0, not chunk
            pos = end
            n += 1
            yield _record_text(record, key, f"{path} element {n}")
            if pos > _READ_CHARS:
                buf, pos = buf[pos:], 0


def _iter_text(path: str, per_file: bool) -> Iterator[str]:
    with _open_text(path) as f:
        if per_file:
            yield f.read()
            return
        lines: list[str] = []
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).removesuffix("\n")
                lines = []
        if lines:
            yield "".join(lines).removesuffix("\n")


def _iter_parquet(path: str, key: str) -> Iterator[str | None]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise InputError(f"{path} is not a readable parquet file ({str(e).splitlines()[0]})") from None
    names = pf.schema_arrow.names
    if key not in names:
        raise InputError(f"{path} has no column {key!r} (columns: {', '.join(names) or 'none'}); pass --json-key "
                         f"with one of them")
    for batch in pf.iter_batches(batch_size=1024, columns=[key]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise InputError(f"{path}: column {key!r} holds {type(text).__name__} values, not strings")
            yield text


def _iter_hf(name: str, config: str | None, split: str, data_files: list[str] | None, key: str) -> Iterator[str | None]:
    import datasets

    kwargs = {"split": split, "streaming": True}
    if data_files:
        kwargs["data_files"] = data_files
    try:
        ds = datasets.load_dataset(name, config, **kwargs)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"cannot load dataset {name!r} (config {config}, split {split}): {first}") from None
    for n, record in enumerate(ds, 1):
        yield _record_text(record, key, f"dataset {name} record {n}")


def _iter_embedded() -> Iterator[str]:
    from zoo.data.corpus import embedded_documents

    yield from embedded_documents()


def _detect_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    base = path[:-3] if path.endswith(".gz") else path
    ext = os.path.splitext(base)[1].lower()
    if ext in (".jsonl", ".ndjson"):
        return "jsonl"
    if ext == ".parquet":
        return "parquet"
    if ext == ".json":
        with _open_text(path) as f:
            head = f.read(4096).lstrip()
        return "json" if head.startswith("[") else "jsonl"
    return "text"


class Source:
    """One input; ``documents()`` opens it afresh (the tokenizer pass and the writing pass each read it once)."""

    def __init__(self, label: str, open_docs: Callable[[], Iterator[str | None]]):
        self.label, self._open_docs = label, open_docs

    def documents(self) -> Iterator[str]:
        try:
            for text in self._open_docs():
                if text:  # null and empty texts give no document
                    yield text
        except UnicodeDecodeError as e:
            raise InputError(f"{self.label} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except (OSError, EOFError) as e:  # e.g. a corrupt or truncated .gz
            raise InputError(f"cannot read {self.label}: {e}") from None


def _sources(args: argparse.Namespace) -> list[Source]:
    key = args.json_key
    if args.hf_dataset:
        return [Source(f"dataset {args.hf_dataset}",
                       lambda: _iter_hf(args.hf_dataset, args.hf_config, args.hf_split, args.hf_data_files, key))]
    out = []
    for path in args.input:
        if path == EMBEDDED:
            out.append(Source("the embedded pydoc corpus", _iter_embedded))
            continue
        if not os.path.exists(path):
            raise InputError(f"input {path} does not exist")
        if not os.path.isfile(path):
            raise InputError(f"input {path} is not a file; pass files (e.g. a shell glob dir/*.jsonl)")
        try:
            fmt = _detect_format(path, args.format)
        except (OSError, UnicodeDecodeError, EOFError) as e:
            raise InputError(f"cannot read input {path}: {e}") from None
        opener = {"jsonl": lambda p=path: _iter_jsonl(p, key), "json": lambda p=path: _iter_json(p, key),
                  "parquet": lambda p=path: _iter_parquet(p, key),
                  "text": lambda p=path: _iter_text(p, args.text_document == "file")}[fmt]
        out.append(Source(f"input {path} ({fmt})", opener))
    return out


def _check_sources(sources: Sequence[Source]) -> None:
    """Read the first document of every input: existence, format, key and emptiness fail here, before any output."""
    for src in sources:
        docs = src.documents()
        try:
            next(docs)
        except StopIteration:
            raise InputError(f"{src.label} holds no documents; check the file, --format and --json-key") from None
        finally:
            docs.close()


def _all_documents(sources: Sequence[Source]) -> Iterator[str]:
    for src in sources:
        yield from src.documents()


# ---------------------------------------------------------------------------------------------------- CLI


class _Parser(Parser):
    def error(self, message: str):  # one line and exit code 2, like every other bad input
        raise InputError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="preprocess.py", description="Tokenize text into a Megatron indexed dataset (OUT.bin/OUT.idx).",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("input (one of --input or --hf-dataset)")
    src.add_argument("--input", action="extend", nargs="+", default=[], metavar="PATH",
                     help=f"input file(s), repeatable; '{EMBEDDED}' for the pydoc corpus shipped with Python")
    src.add_argument("--format", choices=FORMATS, default="auto",
                     help="input format; auto: by extension (.jsonl/.ndjson, .json, .parquet, else text)")
    src.add_argument("--json-key", default="text", help="field (or parquet/dataset column) holding the text")
    src.add_argument("--text-document", choices=("paragraph", "file"), default="paragraph",
                     help="text inputs: one document per blank-line-separated paragraph, or per file")
    src.add_argument("--hf-dataset", metavar="NAME", help="a datasets.load_dataset source, read in streaming mode")
    src.add_argument("--hf-config", metavar="C", help="its configuration name")
    src.add_argument("--hf-split", default="train", metavar="SPLIT", help="its split")
    src.add_argument("--hf-data-files", nargs="+", metavar="FILE", help="data_files for packaged loaders (json, ...)")
    out = p.add_argument_group("output")
    out.add_argument("--output-prefix", required=True, metavar="OUT", help="writes OUT.bin and OUT.idx")
    out.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                     help="end each document with the tokenizer's EOS id")
    tok = p.add_argument_group("tokenizer (one of --tokenizer or --train-tokenizer)")
    tok.add_argument("--tokenizer", metavar="DIR", help="a HuggingFace tokenizer folder (save_pretrained)")
    tok.add_argument("--train-tokenizer", action="store_true",
                     help="train a byte-level BPE on the inputs first (needs --vocab-size and --tokenizer-out)")
    tok.add_argument("--vocab-size", type=int, metavar="N", help="vocabulary size of the trained tokenizer")
    tok.add_argument("--tokenizer-out", metavar="DIR", help="where the trained tokenizer is saved")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="tokenize in N processes (output in input order, the same bytes as one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _validate(args: argparse.Namespace) -> None:
    if bool(args.input) == bool(args.hf_dataset):
        raise InputError("pass either --input PATH ... or --hf-dataset NAME (exactly one of them)")
    if (args.hf_config or args.hf_data_files) and not args.hf_dataset:
        raise InputError("--hf-config/--hf-data-files need --hf-dataset")
    if bool(args.tokenizer) == bool(args.train_tokenizer):
        raise InputError("pass either --tokenizer DIR or --train-tokenizer --vocab-size N --tokenizer-out DIR")
    if args.train_tokenizer:
        if args.vocab_size is None or not args.tokenizer_out:
            raise InputError("--train-tokenizer needs --vocab-size N and --tokenizer-out DIR")
        if args.vocab_size < 257:
            raise InputError(f"--vocab-size {args.vocab_size} is below 257 (256 bytes + the EOS token)")
        out = args.tokenizer_out
        if os.path.exists(out) and not (os.path.isdir(out) and (not os.listdir(out) or
                                                                 os.path.isfile(os.path.join(out, "tokenizer.json")))):
            raise InputError(f"--tokenizer-out {out} exists and is not an empty or tokenizer folder; pick another")
    elif args.vocab_size is not None or args.tokenizer_out:
        raise InputError("--vocab-size/--tokenizer-out only apply with --train-tokenizer")
    if args.workers < 1:
        raise InputError(f"--workers {args.workers} must be >= 1 (1 tokenizes in this process)")
    if os.path.isdir(args.output_prefix) or args.output_prefix.endswith(os.sep):
        raise InputError(f"--output-prefix {args.output_prefix} is a folder; give a file prefix such as "
                         f"{os.path.join(args.output_prefix, 'data')}")


def _makedirs(folder: str) -> list[str]:
    """Create ``folder`` and its missing parents; return those created (deepest last) so a failure can undo them."""
    created, f = [], os.path.abspath(folder)
    while f and not os.path.exists(f):
        created.append(f)
        f = os.path.dirname(f)
    os.makedirs(folder, exist_ok=True)
    return created[::-1]


def _encoder(tokenizer) -> Callable[[list[str]], list[list[int]]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # fast tokenizers: batch-encode in Rust, no max-length warnings
        return lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]


def _batches(texts: Iterator[str]) -> Iterator[list[str]]:
    """Documents grouped for one tokenizer call: ``_BATCH_DOCS`` of them, or fewer once ``_BATCH_CHARS`` are reached."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encode_batch(encode: Callable, texts: list[str], eod: int | None, dtype: str):
    """``(tokens, sizes)``: the batch's token ids back to back (with ``eod`` after each document when given) in the
    output dtype, and the tokens per document, ready for ``IndexedDatasetBuilder.add_documents``."""
    import numpy as np

    seqs = encode(texts)
    tail = [] if eod is None else [eod]
    sizes = np.fromiter((len(ids) + len(tail) for ids in seqs), dtype=np.int64, count=len(seqs))
    flat = itertools.chain.from_iterable(itertools.chain(ids, tail) for ids in seqs)
    tokens = np.fromiter(flat, dtype=np.int64, count=int(sizes.sum()))
    info = np.iinfo(dtype)
    if tokens.size and (tokens.min() < info.min or tokens.max() > info.max):  # the builder's check, before narrowing
        raise InputError(f"token ids [{tokens.min()}, {tokens.max()}] do not fit {dtype}; the tokenizer's size "
                         f"disagrees with its ids")
    return tokens.astype(dtype), sizes


_WORKER: dict = {}


def _tokenizer_spec(tokenizer, folder: str) -> tuple[str, str]:
    """What a worker process needs to rebuild the tokenizer: a fast tokenizer's own JSON (exactly its state, and
    no transformers import in the worker), else the folder to load."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return ("json", backend.to_str()) if backend is not None else ("folder", folder)


def _init_worker(spec: tuple[str, str], eod: int | None, dtype: str) -> None:
    # The workers are the parallelism: one thread each, or N workers x all cores oversubscribe the machine.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    kind, payload = spec
    if kind == "json":
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(payload)
        encode = lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]  # noqa: E731
    else:
        from zoo.data.tokenizer import load_tokenizer

        encode = _encoder(load_tokenizer(payload))
    _WORKER.update(encode=encode, eod=eod, dtype=dtype)


def _encode_in_worker(texts: list[str]):
    return _encode_batch(_WORKER["encode"], texts, _WORKER["eod"], _WORKER["dtype"])


def _encoded(batches: Iterator[list[str]], tokenizer, folder: str, eod: int | None, dtype: str, workers: int):
    """``_encode_batch`` of each batch, in order: here, or in ``workers`` spawned processes with at most
    ``2 * workers`` batches in flight (``Pool.imap`` or ``Executor.map`` would read the whole input ahead)."""
    if workers == 1:
        encode = _encoder(tokenizer)
        for texts in batches:
            yield _encode_batch(encode, texts, eod, dtype)
        return
    # spawn, not fork: the parent may already run tokenizer threads (BPE training), which a fork would not carry.
    # An executor, not multiprocessing.Pool: on an error (a bad record deep in the input) Pool.terminate kills
    # workers that may hold its result queue's lock and then waits on that lock forever (seen in CI); the executor
    # cancels the queued batches and lets the running ones finish.
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                             initargs=(_tokenizer_spec(tokenizer, folder), eod, dtype)) as pool:
        pending: collections.deque = collections.deque()
        try:
            for texts in batches:
                pending.append(pool.submit(_encode_in_worker, texts))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def run(args: argparse.Namespace) -> str:
    """Do the work described by parsed ``args``; return the summary line. Raises ``InputError`` for bad input."""
    _validate(args)
    start = time.time()
    sources = _sources(args)

    # Imported after the cheap checks, so that a mistyped path fails at once (transformers takes seconds).
    import numpy as np

    from zoo.data import files
    from zoo.data.indexed import IndexedDatasetBuilder, best_dtype, data_file, index_file
    from zoo.data.tokenizer import load_tokenizer, train_bpe_tokenizer
    from zoo.progress import progress_bar

    tokenizer = None
    if args.tokenizer:
        try:
            tokenizer = load_tokenizer(args.tokenizer)
        except ValueError as e:
            raise InputError(str(e)) from None
    _check_sources(sources)

    created: list[str] = []
    tmp_tok = None
    try:
        created += _makedirs(os.path.dirname(os.path.abspath(args.output_prefix)))
        if args.train_tokenizer:
            created += _makedirs(os.path.dirname(os.path.abspath(args.tokenizer_out)))
            tmp_tok = files.mkdtemp(dir=os.path.dirname(os.path.abspath(args.tokenizer_out)),
                                    prefix=os.path.basename(os.path.abspath(args.tokenizer_out)) + ".tmp-")
            if not args.quiet:
                print(f"training a {args.vocab_size}-token byte-level BPE on the inputs ...", file=sys.stderr)
            train_bpe_tokenizer(_all_documents(sources), args.vocab_size, tmp_tok)
            tokenizer = load_tokenizer(tmp_tok)
        eod = tokenizer.eos_token_id
        if args.append_eod and eod is None:
            raise InputError("the tokenizer has no EOS token to append; pass --no-append-eod or another tokenizer")
        dtype = np.dtype(best_dtype(len(tokenizer)))
        n_docs = n_tokens = 0
        bar = progress_bar(unit=" docs", disable=args.quiet, mininterval=0.5,  # plain lines in a log file
                           desc=f"{args.workers} workers" if args.workers > 1 else "")
        with bar, IndexedDatasetBuilder(args.output_prefix, dtype=dtype) as builder:
            encoded = _encoded(_batches(_all_documents(sources)), tokenizer, args.tokenizer or tmp_tok,
                               eod if args.append_eod else None, dtype.name, args.workers)
            with contextlib.closing(encoded):  # a failure here stops the workers at once
                for tokens, sizes in encoded:
                    builder.add_documents(tokens, sizes)
                    n_docs += sizes.size
                    n_tokens += tokens.size
                    bar.update(sizes.size)
                    bar.set_postfix_str(f"{n_tokens:,} tokens, {n_tokens / max(time.time() - start, 1e-9):,.0f} "
                                        f"tok/s", refresh=False)
        if args.train_tokenizer:
            out = args.tokenizer_out
            if os.path.isdir(out):  # checked in _validate: empty, or a tokenizer folder being rewritten
                shutil.rmtree(out)
            os.replace(tmp_tok, out)
            tmp_tok = None
    except BaseException:
        if tmp_tok is not None:
            shutil.rmtree(tmp_tok, ignore_errors=True)
        for folder in reversed(created):
            try:
                os.rmdir(folder)
            except OSError:
                pass
        raise
    what = f"{len(sources)} input" + ("s" if len(sources) != 1 else "")
    tok_note = f"; tokenizer saved to {args.tokenizer_out}" if args.train_tokenizer else ""
    elapsed = time.time() - start
    return (f"wrote {data_file(args.output_prefix)} and {index_file(args.output_prefix)}: {n_docs:,} documents, "
            f"{n_tokens:,} tokens ({dtype.name}) from {what} in {elapsed:.1f}s ({n_tokens / max(elapsed, 1e-9):,.0f} "
            f"tokens/s, {args.workers} worker{'s' if args.workers > 1 else ''}){tok_note}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (0, or 2 for bad input with one ``error:`` line on stderr)."""
    try:
        args = build_parser().parse_args(argv)
        print(run(args))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
