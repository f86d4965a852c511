"""The weight average (``training.ema_decay``, zoo.training.ema) against its definition, across layouts and resumes.

The reference is the recurrence itself, read from the run's own files: after step n the average a_n equals
d_n a_(n-1) + (1 - d_n) w_n, where w_n are the weights DeepSpeed checkpointed at step n and
d_n = min(decay, (1 + n) / (10 + n)) (written out here, not imported). The exported model is the last average, and
a run resumed in another layout (tp 2, through the universal checkpoint) exports the same average as the run that
was not interrupted.
"""

import shutil
from pathlib import Path

import pytest
import torch

from tests.training.test_checkpoint import COMMON, CONFIG, ROOT

DECAY = 0.8
STEPS = 4
EMA = [f"training.steps={STEPS}", f"training.ema_decay={DECAY}", "training.save_interval=1"]


def ema_case(overrides, out, resume_step=None, universal=False, config=CONFIG):
    """train_and_save in this worker (the export at the end is the average); with resume_step, that checkpoint of
    ``out`` first."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.checkpoint import find_checkpoint
    from zoo.training.config import load, validate
    from zoo.training.run import say, train_and_save
    from zoo.training.trainer import Trainer, build_data

    cfg = load(config, COMMON + EMA + list(overrides) + [f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep)
    resume = find_checkpoint(out, resume_step) if resume_step is not None else None
    with Trainer(cfg, model_cfg, grid, build_data(cfg, model_cfg, grid), log=say, resume=resume, universal=universal,
                 progress=True) as trainer:
        return train_and_save(trainer).losses


def folder_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def assert_same_model(got_folder: Path, want_folder: Path) -> None:
    """The same tensors within 1e-5 (the runs differ in summation order only; see the pp2 test)."""
    want, got = folder_tensors(want_folder), folder_tensors(got_folder)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def checkpointed_weights(tag_folder: Path) -> dict:
    """The module weights DeepSpeed saved (this project's own run: its pickle is ours to read)."""
    state = torch.load(tag_folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    return {k: v.float() for k, v in state.items()}


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, dist_run):
    out = tmp_path_factory.mktemp("ema-single")
    losses = dist_run(1, ema_case, [], str(out))[0]
    return out, losses


def test_average_follows_its_recurrence_and_is_exported(single_run):
    out, _ = single_run
    ckpts = out / "checkpoints"
    averages = {n: folder_tensors(ckpts / f"step_{n:08d}" / "ema") for n in range(1, STEPS + 1)}
    assert averages[1], "the checkpoint holds the average as a model folder"
    for n in range(2, STEPS + 1):
        d = min(DECAY, (1 + n) / (10 + n))
        weights = checkpointed_weights(ckpts / f"step_{n:08d}")
        for name, avg in averages[n].items():
            expected = d * averages[n - 1][name] + (1 - d) * weights[name]
            torch.testing.assert_close(avg, expected, rtol=1e-6, atol=1e-7, msg=f"{name} at step {n}")
    exported = folder_tensors(out / "model")
    last = checkpointed_weights(ckpts / f"step_{STEPS:08d}")
    assert exported.keys() == averages[STEPS].keys()
    for name, value in exported.items():
        torch.testing.assert_close(value, averages[STEPS][name], rtol=0, atol=0)
    moved = max((exported[n] - last[n]).abs().max().item() for n in exported)
    assert moved > 1e-4, "the export is the average, not the last weights"


def test_resumed_at_tp2_exports_the_same_average(single_run, dist_run, tmp_path):
    """Saved at step 2 by one process (ZeRO-1), resumed at tp=2: the universal checkpoint carries the weights and
    optimizer, the average folder is read as tp slices; steps 3-4 and the export equal the uninterrupted run's."""
    out, losses = single_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    (resumed / "checkpoints" / "latest").write_text("step_00000002")
    tp2 = dist_run(2, ema_case, ["parallel.tp=2"], str(resumed), resume_step=2, universal=True)
    torch.testing.assert_close(torch.tensor(tp2[0]), torch.tensor(losses[2:]), rtol=1e-5, atol=0)
    assert_same_model(resumed / "model", out / "model")


def test_bad_ema_settings_are_refused_before_training():
    from zoo.training.config import ConfigError, load, validate

    for overrides, words in ((["training.ema_decay=1.0"], "[0, 1)"), (["training.ema_decay=-0.5"], "[0, 1)")):
        cfg = load(CONFIG, COMMON + overrides)
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(")", r"\)")):
            validate(cfg, 1)


def test_zero3_averages_partitions_and_exports_and_resumes_the_single_process_average(single_run, dist_run,
                                                                                      tmp_path):
    """At dp=2 with ZeRO-3 each rank averages its own flat partition of every parameter; the checkpoints' average
    folders and the export (gathered over the partition group) equal the single process's, and a run resumed from
    the step-2 checkpoint (each rank cutting its partition from the folder) exports the same again."""
    out, losses = single_run
    zero3 = tmp_path / "zero3"
    ranks = dist_run.retire(2, ema_case, ["parallel.zero_stage=3"], str(zero3))  # ZeRO-3 engines keep threads
    torch.testing.assert_close(torch.tensor(ranks[0]), torch.tensor(losses), rtol=1e-5, atol=0)
    assert_same_model(zero3 / "model", out / "model")
    for step in (1, 2):
        tag = f"step_{step:08d}"
        assert_same_model(zero3 / "checkpoints" / tag / "ema", out / "checkpoints" / tag / "ema")
    resumed = tmp_path / "resumed"
    shutil.copytree(zero3 / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    (resumed / "checkpoints" / "latest").write_text("step_00000002")
    again = dist_run.retire(2, ema_case, ["parallel.zero_stage=3"], str(resumed), resume_step=2)
    torch.testing.assert_close(torch.tensor(again[0]), torch.tensor(losses[2:]), rtol=1e-5, atol=0)
    assert_same_model(resumed / "model", out / "model")


def test_pp2_keeps_the_single_process_average(single_run, dist_run, tmp_path):
    """At pp=2 each stage averages its own layers (the tied embedding on both ends alike); the exported average
    equals the single process's. (Weights, not losses: Adam's first steps are about lr x sign(gradient), so a
    parameter whose gradient is near 0 moves by other amounts when the summation order differs; 1e-5 is a few
    thousandths of one step, while the average and the last weights differ by more than 1e-4.)"""
    out, losses = single_run
    pp2 = tmp_path / "pp2"
    ranks = dist_run(2, ema_case, ["parallel.pp=2"], str(pp2))
    torch.testing.assert_close(torch.tensor(ranks[0]), torch.tensor(losses), rtol=1e-5, atol=0)
    assert_same_model(pp2 / "model", out / "model")


MOE = ROOT / "configs/gpt/tiny-moe.yaml"


def test_expert_parallel_average_equals_one_process(dist_run, tmp_path):
    """A mixture-of-experts model at ep=2: each rank averages its own experts (the export gathers them over the
    expert-parallel group), and the exported average equals the one-process run's."""
    one, ep2 = tmp_path / "one", tmp_path / "ep2"
    expected = dist_run(1, ema_case, ["training.save_interval=0"], str(one), config=MOE)[0]
    ranks = dist_run(2, ema_case, ["training.save_interval=0", "parallel.ep=2"], str(ep2), config=MOE)
    torch.testing.assert_close(torch.tensor(ranks[0]), torch.tensor(expected), rtol=1e-5, atol=0)
    assert any(".experts." in name for name in folder_tensors(one / "model"))
    assert_same_model(ep2 / "model", one / "model")


def failing_average_save_case(out):
    """pp=2 with the average; rank 1 (the second stage's writer) cannot write its part of step 3's average."""
    import errno
    import os

    from zoo.convert import io
    from zoo.training.checkpoint import SaveError

    real_add = io.ShardedWriter.add

    def add(self, name, tensor):
        if os.environ["RANK"] == "1" and "step_00000003.partial" in str(self.folder):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add(self, name, tensor)

    io.ShardedWriter.add = add
    try:
        ema_case(["parallel.pp=2"], out)
    except SaveError as e:
        return str(e)
    finally:
        io.ShardedWriter.add = real_add
    return None


def test_a_failing_write_of_the_average_stops_every_rank_at_once(dist_run, tmp_path):
    """Every rank stops with the same one-line SaveError (not a hang until the collective timeout); the partial
    checkpoint is gone and the previous ones are intact. (The stopped engine is not torn down in the worker, as
    a stopped process lets go of it by exiting: the pool is retired after.)"""
    said = dist_run.retire(2, failing_average_save_case, str(tmp_path))
    assert all(s is not None and "step 3" in s and "No space left on device" in s for s in said), said
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_00000001",
                                                                                    "step_00000002"]
    from zoo.training.checkpoint import find_checkpoint

    assert find_checkpoint(tmp_path).tag == "step_00000002"  # its manifest checks out
