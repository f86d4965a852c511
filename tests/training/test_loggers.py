"""``training.loggers``: a W&B run (offline, no network) holds what metrics.jsonl and TensorBoard hold.

The W&B side is read back from the run's own transaction log (``run-<id>.wandb``: LevelDB's log format of
``wandb_internal_pb2.Record`` protobufs, decoded here with wandb's own message classes), the TensorBoard side with
TensorBoard's own event reader; both are compared with metrics.jsonl, which the loop writes itself.
"""

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

pytest.importorskip("wandb")

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32768  # LevelDB log blocks
HEADER = b":W&B\xe1\xbe\x00"  # wandb's file header: ident, magic 0xBEE1, version 0
FULL, LAST = 1, 4  # record chunk types that end a record


def wandb_records(path: Path):
    """Every ``Record`` of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:len(HEADER)] == HEADER, f"{path} is not a wandb transaction log"
    pos, parts = len(HEADER), b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def items(entries) -> dict:
    return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}


def read_wandb_run(out: Path, timeout_s: float = 60.0) -> dict:
    """The run's history, summary and identity from its offline transaction log. ``run.finish()`` can return
    before W&B's service process has written the last records (it writes them before the process exits), so this
    waits for the log's exit record, up to ``timeout_s``."""
    import time

    (path,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    run = {"history": {}, "summary": {}, "dir": path.parent}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(project=record.run.project, name=record.run.display_name, tags=list(record.run.tags),
                       id=record.run.run_id)
        elif kind == "history":
            row = items(record.history.item)
            run["history"].setdefault(row["_step"], {}).update(row)
        elif kind == "summary":
            run["summary"].update(items(record.summary.update))
    return run


def read_tensorboard(out: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def offline_wandb_run(out):
    """A 4-step run with validation at 0, 2, 4 and both loggers, W&B offline (this worker's environment only)."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.config import load, validate
    from zoo.training.trainer import Trainer

    before = os.environ.get("WANDB_MODE")
    os.environ["WANDB_MODE"] = "offline"
    try:
        cfg = load(ROOT / "configs/gpt/tiny.yaml",
                   ["training.steps=4", "training.micro_batch_size=2", "training.global_batch_size=2",
                    "training.seq_length=32", "data.source=synthetic", "training.save=false",
                    "training.eval_interval=2", "training.eval_iters=1", "training.loggers=[tensorboard,wandb]",
                    "training.wandb_project=zoo-tests", "training.wandb_name=tiny-offline",
                    "training.wandb_tags=[tiny,offline]", f"out={out}"])
        model_cfg = validate(cfg, dist.get_world_size())
        grid = initialize_model_parallel(1, 1)
        with Trainer(cfg, model_cfg, grid, log=lambda s: None) as trainer:
            return trainer.fit().losses
    finally:
        os.environ.pop("WANDB_MODE") if before is None else os.environ.update(WANDB_MODE=before)


def test_wandb_offline_run_holds_the_metrics(dist_run, tmp_path):
    losses = dist_run(1, offline_wandb_run, str(tmp_path))[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "val_loss" in r]
    assert [r["loss"] for r in train] == losses and [r["step"] for r in valid] == [0, 2, 4]

    run = read_wandb_run(tmp_path)
    assert (run["project"], run["name"], run["tags"]) == ("zoo-tests", "tiny-offline", ["tiny", "offline"])
    assert (tmp_path / "wandb" / "zoo-run-id").read_text() == run["id"]
    assert run["summary"]["train/loss"] == train[-1]["loss"]
    assert run["summary"]["val/val_loss"] == valid[-1]["val_loss"]

    # The same scalars as TensorBoard, both equal to metrics.jsonl's, at the same steps.
    tb = read_tensorboard(tmp_path)
    from_metrics = {(f"{prefix}/{k}", r["step"]): v for prefix, rs in (("train", train), ("val", valid))
                    for r in rs for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    from_wandb = {(k, step): v for step, row in run["history"].items() for k, v in row.items()
                  if k.startswith(("train/", "val/")) and not k.startswith("val/predictions")}
    assert set(tb) == set(from_metrics) == set(from_wandb)
    for key, value in from_metrics.items():
        assert from_wandb[key] == value, key
        assert tb[key] == pytest.approx(value, rel=1e-6), key  # TensorBoard stores float32

    # The loss curve the run drew, as a W&B image: the very PNG in OUT.
    image = run["history"][4]
    assert image["loss_curve/_type"] == "image-file"
    png = (tmp_path / "loss.png").read_bytes()
    assert (run["dir"] / "files" / image["loss_curve/path"]).read_bytes() == png
    assert image["loss_curve/sha256"] == hashlib.sha256(png).hexdigest()


def test_unknown_logger_and_missing_wandb_are_one_line_errors(monkeypatch):
    import importlib.util

    from zoo.training.config import ConfigError, load, validate

    with pytest.raises(ConfigError, match=r"unknown logger\(s\) \['mlflow'\]; known: \['tensorboard', 'wandb'\]"):
        validate(load(None, ["training.loggers=[tensorboard,mlflow]", "data.source=synthetic"]), 1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="wandb package is not installed; pip install wandb"):
        validate(load(None, ["training.loggers=wandb", "data.source=synthetic"]), 1)
