"""Tests for the preprocessing CLI (zoo/data/preprocess.py, launch/preprocess.py).

Each format is checked by a round trip: the documents written to the input are compared with the decoded sequences
of the ``.bin`` (EOS stripped). Bad inputs must give exit code 2, exactly one ``error:`` line on stderr, and leave
no file behind.
"""

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zoo.data.corpus import embedded_documents
from zoo.data.indexed import IndexedDataset
from zoo.data.preprocess import main
from zoo.data.tokenizer import load_tokenizer, train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Second document,\nwith an inner newline and trailing spaces   ",
    "Unicode: naïve café, 東京, emoji 🎉 and tabs\there.",
    "x",
    "def f(x):\n    return x + 1",
]
# Paragraph-mode text documents cannot hold blank lines.
PARAGRAPHS = [d for d in DOCS if "\n\n" not in d]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(DOCS * 3 + embedded_documents()[:5], 320, out)
    return str(out)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def _decoded(prefix, tok, eod=True):
    ds = IndexedDataset(prefix)
    out = []
    for seq in ds:
        ids = seq.tolist()
        if eod:
            assert ids[-1] == tok.eos_token_id
            ids = ids[:-1]
        out.append(tok.decode(ids))
    return out


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _jsonl(path, docs, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, key: d}) + "\n")
    return path


def test_jsonl_round_trip_and_summary(tmp_path, tok_dir, tok, capsys):
    src = _jsonl(tmp_path / "in.jsonl", DOCS)
    rc, out, err = _run(capsys, "--input", src, "--output-prefix", tmp_path / "out" / "docs", "--tokenizer", tok_dir)
    assert rc == 0, err
    assert _decoded(tmp_path / "out" / "docs", tok) == DOCS
    tokens = int(IndexedDataset(tmp_path / "out" / "docs").sizes.sum())
    assert out.count("\n") == 1 and f"{len(DOCS)} documents, {tokens} tokens (uint16) from 1 input" in out
    assert "docs" in err  # the progress bar
    assert sorted(os.listdir(tmp_path / "out")) == ["docs.bin", "docs.idx"]


def test_two_workers_write_the_same_bytes_as_one(tmp_path, tok_dir, capsys, monkeypatch):
    import zoo.data.preprocess as pp

    monkeypatch.setattr(pp, "_BATCH_DOCS", 3)  # many small batches, so the workers' results interleave
    src = _jsonl(tmp_path / "in.jsonl", DOCS * 4 + embedded_documents()[:20])
    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        rc, out, err = _run(capsys, "--input", src, "--output-prefix", prefix, "--tokenizer", tok_dir,
                            "--workers", workers)
        assert rc == 0, err
        assert f"{workers} worker" in out
        outputs[workers] = [(prefix.parent / (prefix.name + ext)).read_bytes() for ext in (".bin", ".idx")]
    assert "2 workers" in err  # the progress line
    assert outputs[2] == outputs[1]
    # A bad record deep in the input stops the workers and leaves nothing behind, as with one worker.
    bad = tmp_path / "late.jsonl"
    bad.write_text(src.read_text(encoding="utf-8") + "{broken\n", encoding="utf-8")
    rc, _, err = _run(capsys, "--input", bad, "--output-prefix", tmp_path / "deep" / "x", "--tokenizer", tok_dir,
                      "--workers", 2, "--quiet")
    assert rc == 2 and err.startswith("error: ") and "is not JSON" in err
    assert not (tmp_path / "deep").exists()


def test_json_array_text_parquet_gz_and_several_inputs(tmp_path, tok_dir, tok, capsys, monkeypatch):
    import zoo.data.preprocess as pp

    monkeypatch.setattr(pp, "_READ_CHARS", 16)  # the incremental JSON reader refills its buffer many times
    (tmp_path / "a.json").write_text(json.dumps([{"text": d, "n": [1, {"x": "]"}]} for d in DOCS], indent=2),
                                     encoding="utf-8")
    (tmp_path / "b.txt").write_text("\n\n" + "\n\n\n".join(PARAGRAPHS) + "\n \n", encoding="utf-8")
    pq.write_table(pa.table({"text": DOCS, "other": list(range(len(DOCS)))}), tmp_path / "c.parquet",
                   row_group_size=2)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": d}) + "\n\n" for d in DOCS))
    for name, expected in [("a.json", DOCS), ("b.txt", PARAGRAPHS), ("c.parquet", DOCS), ("d.jsonl.gz", DOCS)]:
        rc, _, err = _run(capsys, "--input", tmp_path / name, "--output-prefix", tmp_path / name.split(".")[0],
                          "--tokenizer", tok_dir, "--quiet")
        assert rc == 0, err
        assert _decoded(tmp_path / name.split(".")[0], tok) == expected, name
    rc, out, err = _run(capsys, "--input", tmp_path / "c.parquet", tmp_path / "b.txt", "--input", tmp_path / "a.json",
                        "--output-prefix", tmp_path / "all", "--tokenizer", tok_dir, "--no-append-eod", "--quiet")
    assert rc == 0, err
    assert "from 3 inputs" in out
    assert _decoded(tmp_path / "all", tok, eod=False) == DOCS + PARAGRAPHS + DOCS


def test_text_per_file_and_format_override(tmp_path, tok_dir, tok, capsys):
    (tmp_path / "a.txt").write_text("one\n\ntwo\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("three", encoding="utf-8")
    rc, _, err = _run(capsys, "--input", tmp_path / "a.txt", tmp_path / "b.txt", "--text-document", "file",
                      "--output-prefix", tmp_path / "f", "--tokenizer", tok_dir, "--quiet")
    assert rc == 0, err
    assert _decoded(tmp_path / "f", tok) == ["one\n\ntwo\n", "three"]
    _jsonl(tmp_path / "records.dat", DOCS, key="body")
    rc, _, err = _run(capsys, "--input", tmp_path / "records.dat", "--format", "jsonl", "--json-key", "body",
                      "--output-prefix", tmp_path / "r", "--tokenizer", tok_dir, "--quiet")
    assert rc == 0, err
    assert _decoded(tmp_path / "r", tok) == DOCS


def test_hf_dataset_source_on_local_jsonl(tmp_path, tok_dir, tok, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    src = _jsonl(tmp_path / "in.jsonl", DOCS)
    rc, out, err = _run(capsys, "--hf-dataset", "json", "--hf-data-files", src, "--hf-split", "train",
                        "--output-prefix", tmp_path / "hf", "--tokenizer", tok_dir, "--quiet")
    assert rc == 0, err
    assert _decoded(tmp_path / "hf", tok) == DOCS


def test_train_tokenizer_and_embedded_input(tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl", DOCS)
    rc, out, err = _run(capsys, "--input", src, "embedded", "--output-prefix", tmp_path / "data" / "x",
                        "--train-tokenizer", "--vocab-size", 300, "--tokenizer-out", tmp_path / "newtok", "--quiet")
    assert rc == 0, err
    assert "tokenizer saved to" in out
    new = load_tokenizer(tmp_path / "newtok")
    assert len(new) == 300
    emb = embedded_documents()
    decoded = _decoded(tmp_path / "data" / "x", new)
    assert len(decoded) == len(DOCS) + len(emb)
    assert decoded[:len(DOCS)] == DOCS and decoded[len(DOCS)] == emb[0] and decoded[-1] == emb[-1]
    assert IndexedDataset(tmp_path / "data" / "x").dtype == np.uint16
    assert sorted(os.listdir(tmp_path)) == ["data", "in.jsonl", "newtok"]  # no temporary folders left


def _error_cases(tmp_path, tok_dir):
    good = _jsonl(tmp_path / "good.jsonl", DOCS)
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    (tmp_path / "blank.txt").write_text("\n  \n\n", encoding="utf-8")
    _jsonl(tmp_path / "body.jsonl", DOCS, key="body")
    pq.write_table(pa.table({"content": DOCS}), tmp_path / "p.parquet")
    out = ["--output-prefix", tmp_path / "out" / "x"]
    tk = ["--tokenizer", tok_dir]
    return [
        (["--input", tmp_path / "nope.jsonl", *out, *tk], "input .*nope.jsonl does not exist"),
        (["--input", tmp_path / "empty.jsonl", *out, *tk], "empty.jsonl \\(jsonl\\) holds no documents"),
        (["--input", good, tmp_path / "blank.txt", *out, *tk], "blank.txt \\(text\\) holds no documents"),
        (["--input", tmp_path / "body.jsonl", *out, *tk], "line 1 has no key 'text' \\(keys: id, body\\)"),
        (["--input", tmp_path / "p.parquet", *out, *tk], "no column 'text' \\(columns: content\\)"),
        (["--input", good, *out, "--tokenizer", tmp_path / "notok"], "tokenizer folder .*notok does not exist"),
        (["--input", good, *out], "pass either --tokenizer DIR or --train-tokenizer"),
        (["--input", good, *out, "--train-tokenizer", "--vocab-size", 300], "needs --vocab-size N and --tokenizer-out"),
        (["--input", good, *out, "--train-tokenizer", "--vocab-size", 100, "--tokenizer-out", tmp_path / "t2"],
         "below 257"),
        ([*out, *tk], "either --input PATH ... or --hf-dataset NAME"),
        (["--input", good, "--format", "xml", *out, *tk], "invalid choice: 'xml'"),
        (["--input", good, *tk], "required: --output-prefix"),
        (["--input", good, *out, *tk, "--workers", 0], "--workers 0 must be >= 1"),
        (["--input", tmp_path / "body.jsonl", *out, "--train-tokenizer", "--vocab-size", 300, "--tokenizer-out",
          tmp_path / "t3"], "line 1 has no key 'text'"),
        (["--hf-dataset", "json", "--hf-data-files", tmp_path / "nope.jsonl", *out, *tk], "cannot load dataset 'json'"),
    ]


def test_bad_inputs_fail_with_one_error_line_and_no_files(tmp_path, tok_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cases = _error_cases(tmp_path, tok_dir)
    before = sorted(os.listdir(tmp_path))
    for argv, pattern in cases:
        rc, out, err = _run(capsys, *argv)
        assert rc == 2, (argv, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert re.search(pattern, lines[0]), (pattern, lines[0])
        assert out == ""
        assert sorted(os.listdir(tmp_path)) == before, argv  # no output folder, file or temporary left


def test_bad_record_late_in_input_leaves_nothing(tmp_path, tok_dir, capsys):
    src = tmp_path / "late.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS) + "{broken\n", encoding="utf-8")
    rc, _, err = _run(capsys, "--input", src, "--output-prefix", tmp_path / "deep" / "x", "--tokenizer", tok_dir,
                      "--quiet")
    assert rc == 2 and err.startswith("error: ") and "line 6 is not JSON" in err
    assert sorted(os.listdir(tmp_path)) == ["late.jsonl"]


def test_launcher_script(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "preprocess.py"), "--input", str(tmp_path / "no"),
                           "--output-prefix", str(tmp_path / "x"), "--tokenizer", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: input ") and proc.stdout == ""
