"""Bad data given to launch/train.py: one `error:` line before any process group, and the user's files untouched."""

from pathlib import Path

import numpy as np

from zoo.data.indexed import IndexedDatasetBuilder

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--config", str(ROOT / "configs/gpt/tiny.yaml"), "--steps", "1", "--no-sample"]


def error_line(capsys, argv):
    from zoo.training.train import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_missing_and_empty_and_corrupt_data(capsys, tmp_path):
    out = ["--out", str(tmp_path / "run")]
    msg = error_line(capsys, BASE + out + ["--set", "data.source=indexed"])
    assert "needs data.paths" in msg
    msg = error_line(capsys, BASE + out + ["--set", "data.source=indexed", f"data.paths={tmp_path / 'nope'}"])
    assert "nope.idx is missing" in msg or "nope.bin is missing" in msg
    with IndexedDatasetBuilder(tmp_path / "empty", np.uint16):
        pass  # no documents
    msg = error_line(capsys, BASE + out + ["--set", "data.source=indexed", f"data.paths={tmp_path / 'empty'}"])
    assert "holds no tokens" in msg
    with IndexedDatasetBuilder(tmp_path / "good", np.uint16) as b:
        b.add_document([1, 2, 3, 4])
    (tmp_path / "good.idx").write_bytes(b"not an index at all, just some bytes")
    before = snapshot(tmp_path)
    msg = error_line(capsys, BASE + out + ["--set", "data.source=indexed", f"data.paths={tmp_path / 'good'}"])
    assert "good.idx" in msg and "not a Megatron indexed dataset" in msg
    assert snapshot(tmp_path) == before  # nothing written, nothing removed
    assert not (tmp_path / "run").exists()  # no process group, no output folder
    msg = error_line(capsys, BASE + out + ["--set", "data.source=indexed",
                                           f"data.paths=[0.5, {tmp_path / 'empty'}, x]"])
    assert msg.startswith("error: data:")


def test_tokenizer_that_does_not_fit_the_model(capsys, tmp_path):
    from zoo.data.tokenizer import train_bpe_tokenizer

    texts = [f"document number {i}: " + " ".join(f"word{j * i}" for j in range(60)) for i in range(60)]
    train_bpe_tokenizer(texts, 600, tmp_path / "tok")
    msg = error_line(capsys, BASE + ["--out", str(tmp_path / "run"), "--set", f"data.tokenizer={tmp_path / 'tok'}"])
    assert "has 600 tokens but the model's vocab_size is 512" in msg and "model.vocab_size=600" in msg
    msg = error_line(capsys, BASE + ["--set", f"data.tokenizer={tmp_path / 'missing'}"])
    assert "does not exist" in msg
    msg = error_line(capsys, BASE + ["--set", "data.source=embedded", "data.tokenizer_vocab_size=1000"])
    assert "exceeds the model's vocab_size 512" in msg
