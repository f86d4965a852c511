"""Faults a long run meets: non-finite steps (skipped on every rank, a run of them stops the run)."""

import math

import pytest
import torch

from tests.training.test_checkpoint import COMMON, CONFIG

CONSTANT_LR = ["training.min_lr=3e-3"]  # COMMON's lr after warm-up: a run's length does not change its steps


class Poisoned:
    """The loss function of a run, with NaN losses on one rank in chosen optimizer steps (1-based)."""

    def __init__(self, loss_fn, rank: int, steps, gas: int):
        self.loss_fn, self.rank, self.steps, self.gas, self.calls = loss_fn, rank, set(steps), gas, 0

    def __call__(self, logits, labels):
        import torch.distributed as dist

        loss = self.loss_fn(logits, labels)
        self.calls += 1
        if dist.get_rank() == self.rank and (self.calls - 1) // self.gas + 1 in self.steps:
            loss = loss * float("nan")
        return loss

    def __getattr__(self, name):  # the statistics the loop reads from the loss function
        return getattr(self.loss_fn, name)


def nan_case(overrides, out, nan_steps):
    """Trainer.fit() with NaN losses on rank 1 in ``nan_steps``; returns (losses, skipped records, weights, Adam's
    exp_avg sums, engine.skipped_steps) of this rank."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    import zoo.training.trainer as T
    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.config import load, validate

    cfg = load(CONFIG, COMMON + CONSTANT_LR + list(overrides) + ["training.save=false", f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)
    real = T.build_engine

    def build(*args, **kwargs):
        engine, loss_fn = real(*args, **kwargs)
        return engine, Poisoned(loss_fn, 1, nan_steps, cfg.gradient_accumulation_steps)

    T.build_engine = build
    try:
        trainer = T.Trainer(cfg, model_cfg, grid, log=lambda s: None)
        result = trainer.fit()
    finally:
        T.build_engine = real
    with trainer:
        engine = trainer.engine
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        from deepspeed.utils import safe_get_full_optimizer_state

        from zoo.training.moe import link_optimizer_states

        link_optimizer_states(engine)
        moments = []
        for p in engine.module.parameters():
            state = safe_get_full_optimizer_state(p, "exp_avg")
            moments.append(float((state if state is not None else engine.optimizer.state[p]["exp_avg"]).sum()))
        skipped = engine.skipped_steps
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()] \
        if dist.get_rank() == 0 else []
    return result.losses, [r["step"] for r in records if r.get("skipped")], weights, moments, skipped


@pytest.mark.parametrize("zero", [0, 1])
def test_nan_on_one_rank_skips_the_step_on_both(dist_run, tmp_path, zero):
    """tp=2: rank 1's loss is NaN in step 4 (its gradients, through TP's backward, NaN on both ranks). Without
    ZeRO zoo's guard, with ZeRO-1 DeepSpeed's own check, skip it on both ranks: weights and Adam state after step 4
    are those after step 3, bit for bit; the step is counted and the run goes on with finite losses."""
    layout = ["parallel.tp=2", f"parallel.zero_stage={zero}"]
    before = dist_run(2, nan_case, layout + ["training.steps=3"], str(tmp_path / "three"), [])
    after = dist_run(2, nan_case, layout + ["training.steps=4"], str(tmp_path / "four"), [4])
    for rank in range(2):
        assert after[rank][0][:3] == before[rank][0]
        assert after[rank][4] == 1 and before[rank][4] == 0, "engine.skipped_steps"
        for name, w in before[rank][2].items():
            assert torch.equal(after[rank][2][name], w), f"rank {rank}: {name} changed in the skipped step"
        assert after[rank][3] == before[rank][3], f"rank {rank}: Adam's moments changed in the skipped step"
    assert after[0][1] == [4], "metrics.jsonl marks step 4 skipped"
    assert math.isnan(after[1][0][3])
    going_on = dist_run(2, nan_case, layout + ["training.steps=6"], str(tmp_path / "six"), [4])
    assert all(math.isfinite(loss) for loss in going_on[0][0][4:]) and going_on[0][1] == [4]


def test_nan_steps_in_a_row_stop_the_run_in_one_line(dist_run, tmp_path):
    with pytest.raises(AssertionError, match=r"DivergedError: step 5: loss or gradients not finite in 3 steps in a "
                                             r"row \(training.max_skipped_steps 3\); the weights are those before "
                                             r"them, no checkpoint saved; try a lower training.lr"):
        dist_run(2, nan_case, ["parallel.tp=2", "training.steps=8"], str(tmp_path / "run"), [3, 4, 5])


def test_a_killed_rank_makes_the_other_exit_with_a_message(tmp_path):
    """Two processes started by hand (no launcher to tear the group down): rank 1 is killed with SIGKILL mid-run;
    rank 0 leaves within the collective timeout with one line naming rank 1 (exit status 4), not a hang or a
    traceback."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from tests.training.test_checkpoint import ROOT, losses_of

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    args = [sys.executable, str(ROOT / "launch/train.py"), "--config", str(CONFIG), "--steps", "2000", "--no-sample",
            "--out", str(out), "--set", *COMMON, "training.save=false", "training.collective_timeout_minutes=0.5"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    try:
        deadline = time.time() + 120
        while not ((out / "metrics.jsonl").is_file() and len(losses_of(out)) >= 2):
            assert all(p.poll() is None for p in procs) and time.time() < deadline, "the run did not start"
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.time()
        _, err = procs[0].communicate(timeout=60)
        waited = time.time() - killed
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 4, err[-3000:]
    assert waited < 30, waited  # the timeout (30 s) bounds it; a closed connection is seen at once, then a roll call
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: a collective of step ") and \
        "; rank 1 did not answer within 5 s: dead or hung" in lines[0] and \
        "training.collective_timeout_minutes 0.5 bounds the wait" in lines[0], err[-3000:]
