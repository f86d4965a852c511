"""Checkpoints: exact resume after SIGKILL, resume in another layout, crash-safe saves, refused bad --load.

Reference runs go through the gloo pools (same code path as launch/train.py, without process start-up); the
interrupted runs are real processes killed with SIGKILL.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.mains import run_main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/gpt/tiny.yaml"
COMMON = ["training.micro_batch_size=2", "training.global_batch_size=4", "training.seq_length=32",
          "training.lr=3e-3", "training.warmup_steps=2", "data.source=synthetic", "training.eval_interval=0",
          "training.log_interval=1"]


def run_case(overrides, out, resume_step=None, universal=False):
    """Trainer.fit() in this worker; with resume_step, first load that checkpoint of ``out``'s first run folder."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.checkpoint import find_checkpoint
    from zoo.training.config import load, validate
    from zoo.training.trainer import Trainer

    cfg = load(CONFIG, COMMON + list(overrides) + [f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.cp,
                                     ep_spans_tp=cfg.parallel.ep_spans_tp)
    resume = find_checkpoint(out, resume_step) if resume_step is not None else None
    with Trainer(cfg, model_cfg, grid, log=lambda s: None, resume=resume, universal=universal) as trainer:
        return trainer.fit().losses


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc, args, script=ROOT / "launch/train.py"):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), str(script), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


def losses_of(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


RANK1_DIES_AFTER_STEP_4 = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import zoo.training.checkpoint as ckpt
    real = ckpt.save_checkpoint
    def save_then_die(engine, root, step, *args, **kwargs):
        path = real(engine, root, step, *args, **kwargs)
        if step == 4 and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # the first attempt's rank 1 dies; torchrun restarts the group
        return path
    ckpt.save_checkpoint = save_then_die
    from zoo.training.train import main
    sys.exit(main(sys.argv[1:]))
""")


def test_sigkill_of_a_rank_under_torchrun_restarts_and_resumes_exactly(dist_run, tmp_path):
    """The tiny MoE at ep=2 (DeepSpeed's files and zoo's expert files) under ``torchrun --max-restarts 1``: rank 1
    is killed with SIGKILL after the step-4 checkpoint; torchrun restarts both ranks, which resume from the newest
    intact checkpoint by themselves (no flag) and finish: steps 5-8 as if never killed, exit status 0."""
    sets = ["parallel.ep=2", "model.preset=tiny-moe"]
    expected = dist_run(2, run_case, sets + ["training.steps=8", "training.save=false"],
                        str(tmp_path / "reference"))[0]
    out = tmp_path / "run"
    script = tmp_path / "train_then_die.py"
    script.write_text(RANK1_DIES_AFTER_STEP_4.format(root=str(ROOT)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           "--master_port", str(_free_port()), str(script), "--config", str(CONFIG), "--ep", "2", "--steps", "8",
           "--save-interval", "4", "--no-sample", "--out", str(out), "--set", "model.preset=tiny-moe", *COMMON]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "resumed from" in log and "step_00000004 at step 4" in log, log[-3000:]
    got = losses_of(out)
    assert sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(5, 9)] == expected[4:], "resumed losses must equal the uninterrupted run's"


def _train_workers(pid: int) -> list[int]:
    """The launch/train.py processes started by the launcher process ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"launch/train.py" in cmdline:
            found.append(int(entry))
    return found


def test_sigterm_to_one_rank_saves_that_step_and_exits_0(dist_run, tmp_path):
    """A tp=2 run whose rank (one of the two) gets SIGTERM mid-run, as Slurm sends before a time limit: both ranks
    finish the step, save it, and the run exits 0; resumed from that checkpoint, the next losses are the
    uninterrupted run's (a constant learning rate after warm-up, so the runs' lengths do not matter)."""
    constant = ["training.min_lr=3e-3"]
    out = tmp_path / "run"
    proc = torchrun(2, ["--config", str(CONFIG), "--tp", "2", "--steps", "400", "--no-sample", "--out", str(out),
                        "--set", *COMMON, *constant])
    deadline = time.time() + 240
    while not ((out / "metrics.jsonl").is_file() and len(losses_of(out)) >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:] if proc.poll() else "slow"
        time.sleep(0.1)
    workers = _train_workers(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGTERM)
    log = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, log[-3000:]
    saved = [int(m) for m in re.findall(r"SIGTERM received: checkpoint of step (\d+) saved", log)]
    assert len(saved) == 1 and 3 <= saved[0] < 400, log[-3000:]
    step = saved[0]
    assert (out / "checkpoints" / "latest").read_text() == f"step_{step:08d}"
    reference = dist_run(2, run_case, ["parallel.tp=2", f"training.steps={step + 2}", "training.save=false",
                                       *constant], str(tmp_path / "reference"))[0]
    assert [losses_of(out)[s] for s in range(1, step + 1)] == reference[:step]
    resumed = dist_run(2, run_case, ["parallel.tp=2", f"training.steps={step + 2}", "training.save=false",
                                     *constant], str(out), step)[0]
    assert resumed == reference[step:]


def test_tp2_checkpoint_resumes_at_tp1_pp2(dist_run, tmp_path):
    """Saved at tp=2 (ZeRO-1), resumed at tp=1 x pp=2 through DeepSpeed's universal checkpoint; the MoE models
    (experts and router whole on every TP rank; dense and MoE blocks mixed, with a gated shared expert), OLMo 2's,
    NeoX's and Gemma 2's (sandwich norms) blocks too."""
    for model, extra in [("gpt2", []), ("llama", ["model.preset=tiny-llama"]),
                         ("moe-shared", ["model.preset=tiny-moe-shared"]),
                         # OLMo 2's block (output norms only, q/k norm over the projection); NeoX's with MLP biases
                         # but none on the attention
                         ("olmo2", ["model.preset=tiny-llama", "model.norm_placement=post", "model.qk_norm=full"]),
                         ("neox", ["model.preset=tiny-llama", "model.use_parallel_residual=true",
                                   "model.normalization=layernorm", "model.activation=gelu_exact",
                                   "model.mlp_bias=true"]),
                         ("sandwich", ["model.preset=tiny-llama", "model.norm_placement=sandwich"])]:
        out = str(tmp_path / model)
        base = extra + ["parallel.zero_stage=1", "training.steps=4"]
        uninterrupted = dist_run(2, run_case, base + ["parallel.tp=2", "training.save_interval=3"], out)[0]
        resumed = dist_run(2, run_case, base + ["parallel.pp=2", "training.save=false"], out, 3, True)[0]
        assert len(resumed) == 1
        torch.testing.assert_close(resumed[0], uninterrupted[3], rtol=1e-5, atol=0, msg=f"{model}: next loss")
        assert (Path(out) / "checkpoints" / "step_00000003_universal" / "zoo.json").is_file()


def test_expert_parallel_checkpoints_resume_in_place_and_at_another_ep(dist_run, tmp_path):
    """ep 2 (dp 2): without ZeRO resumed in place, the remaining losses repeat exactly (zoo's expert files carry the
    EP rank 1 experts' weights and Adam states, which DeepSpeed's own files lack); with ZeRO-1 resumed at ep 1 x pp 2,
    and a tp 2 (ep 1) checkpoint resumed at ep 2, through the universal checkpoint: the next loss within 1e-5."""
    moe = ["model.preset=tiny-moe-shared", "training.steps=4"]  # dense and sparse blocks, a gated shared expert
    out = str(tmp_path / "ep2-zero0")
    full = dist_run(2, run_case, moe + ["parallel.ep=2", "parallel.zero_stage=0", "training.save_interval=3"], out)[0]
    assert sorted(p.name for p in (Path(out) / "checkpoints" / "step_00000003").glob("zoo_experts_*")) == \
        ["zoo_experts_pp00.safetensors"]
    resumed = dist_run(2, run_case, moe + ["parallel.ep=2", "parallel.zero_stage=0", "training.save=false"], out, 3)[0]
    assert resumed == full[3:], "resumed at ep 2 in place: the next loss must be the uninterrupted run's"
    for saved, loaded, name in [("parallel.ep=2", "parallel.pp=2", "ep2-to-ep1-pp2"),
                                ("parallel.tp=2", "parallel.ep=2", "tp2-to-ep2")]:
        out = str(tmp_path / name)
        full = dist_run(2, run_case, moe + ["parallel.zero_stage=1", saved, "training.save_interval=3"], out)[0]
        resumed = dist_run(2, run_case, moe + ["parallel.zero_stage=1", loaded, "training.save=false"], out, 3,
                           True)[0]
        torch.testing.assert_close(resumed[0], full[3], rtol=1e-5, atol=0, msg=f"{name}: next loss")


def test_checkpoints_of_ep_spanning_tp_resume_in_place_and_unfolded(dist_run, tmp_path):
    """tp 2 x ep 2 with the EP group spanning TP (each TP rank its own experts), ZeRO-1: resumed in place, the
    remaining losses repeat exactly; resumed at tp 2 with the experts replicated over TP (ep 1), and a tp 2 (ep 1)
    checkpoint resumed folded, through the universal checkpoint: the next loss within 1e-5."""
    moe = ["model.preset=tiny-moe-shared", "training.steps=4", "parallel.zero_stage=1", "parallel.tp=2"]
    folded = ["parallel.ep=2", "parallel.ep_spans_tp=true"]
    out = str(tmp_path / "folded")
    full = dist_run(2, run_case, moe + folded + ["training.save_interval=3"], out)[0]
    resumed = dist_run(2, run_case, moe + folded + ["training.save=false"], out, 3)[0]
    assert resumed == full[3:], "resumed folded in place: the next loss must be the uninterrupted run's"
    unfolded = dist_run(2, run_case, moe + ["training.save=false"], out, 3, True)[0]
    torch.testing.assert_close(unfolded[0], full[3], rtol=1e-5, atol=0, msg="folded -> tp2 ep1: next loss")
    out = str(tmp_path / "tp2")
    full = dist_run(2, run_case, moe + ["training.save_interval=3"], out)[0]
    refolded = dist_run(2, run_case, moe + folded + ["training.save=false"], out, 3, True)[0]
    torch.testing.assert_close(refolded[0], full[3], rtol=1e-5, atol=0, msg="tp2 ep1 -> folded: next loss")


def _to_universal(out):
    from zoo.training.checkpoint import find_checkpoint, to_universal

    return to_universal(find_checkpoint(out, 3))


def test_expert_parallel_checkpoints_resume_at_another_ep_on_four_ranks(dist_run, tmp_path):
    """4 ranks, saved at ZeRO-1 and resumed at ZeRO-2 through the universal checkpoint, the experts cut by the new
    EP rank and partitioned over the new expert-data-parallel ranks: ep 2 x pp 2 -> ep 4 (the second stage's
    experts come from its own expert file), and tp 2 (ep 1) -> ep 2 x dp 4 (experts over 2 EDP ranks) through
    launch/train.py's main with --load, and -> ep 2 x cp 2; the next loss within 1e-5 of the uninterrupted run's.
    ep 2 x cp 2 resumes in place exactly."""
    moe = ["model.preset=tiny-moe-shared", "training.steps=4", "training.micro_batch_size=1"]
    out = str(tmp_path / "ep2-pp2")
    full = dist_run(4, run_case, moe + ["parallel.ep=2", "parallel.pp=2", "training.save_interval=3"], out)[0]
    resumed = dist_run(4, run_case, moe + ["parallel.ep=4", "parallel.zero_stage=2", "training.save=false"], out, 3,
                       True)[0]
    torch.testing.assert_close(resumed[0], full[3], rtol=1e-5, atol=0, msg="ep2 x pp2 -> ep4: next loss")
    universal = Path(out) / "checkpoints" / "step_00000003_universal"
    shutil.rmtree(universal / "zero" / "4.mlp.experts.down_proj")  # as an earlier zoo's conversion left it
    dist_run(1, _to_universal, out)
    assert (universal / "zero" / "4.mlp.experts.down_proj" / "fp32.pt").is_file(), "a conversion without them is redone"
    out, into = tmp_path / "tp2", tmp_path / "tp2-to-ep2"
    full = dist_run(4, run_case, moe + ["parallel.tp=2", "training.save_interval=3"], str(out))[0]
    results = dist_run(4, run_main, "zoo.training.train:main", [
        "--config", CONFIG, "--ep", "2", "--zero", "2", "--load", out, "--load-step", "3", "--steps", "4",
        "--no-sample", "--out", into, "--set", *COMMON, *moe, "training.save=false"])
    code, stdout, stderr = results[0]
    assert code == 0, stdout[-2000:] + stderr[-2000:]
    assert "universal checkpoint" in stdout, stdout[-2000:]
    torch.testing.assert_close(losses_of(into)[4], full[3], rtol=1e-5, atol=0, msg="tp2 -> ep2 x dp4: next loss")
    # The same tp 2 checkpoint into ep 2 x cp 2 (ring); and ep 2 x cp 2 at ZeRO-2 (the experts' partitions over
    # an EDP group of the 2 CP ranks) resumed in place, exactly.
    resumed = dist_run(4, run_case, moe + ["parallel.ep=2", "parallel.cp=2", "parallel.cp_algorithm=ring",
                                           "training.save=false"], str(out), 3, True)[0]
    torch.testing.assert_close(resumed[0], full[3], rtol=1e-5, atol=0, msg="tp2 -> ep2 x cp2: next loss")
    out = str(tmp_path / "ep2-cp2")
    context = moe + ["parallel.ep=2", "parallel.cp=2", "parallel.zero_stage=2"]
    full = dist_run(4, run_case, context + ["training.save_interval=3"], out)[0]
    assert dist_run(4, run_case, context + ["training.save=false"], out, 3)[0] == full[3:], "ep2 x cp2 in place"


def test_damaged_checkpoints_are_refused_and_auto_resume_takes_the_newest_intact(dist_run, tmp_path):
    """Checkpoints at steps 2, 4, 6 with a manifest each; one file of step 6 truncated, one byte of step 4 flipped:
    --load refuses each in one line naming the file, auto-resume passes over both to step 2 and says so, and the
    run resumed from there repeats the uninterrupted losses."""
    from zoo.training import checkpoint as ckpt
    from zoo.training.train import main

    out = tmp_path / "run"
    full = dist_run(1, run_case, ["training.steps=6", "training.save_interval=2"], str(out))[0]
    root = out / "checkpoints"
    manifest = json.loads((root / "step_00000006" / "manifest.json").read_text())["files"]
    assert "zoo.json" in manifest and any(name.endswith("model_states.pt") for name in manifest)
    biggest = max(manifest, key=lambda name: manifest[name]["bytes"])
    with open(root / "step_00000006" / biggest, "r+b") as f:
        f.truncate(manifest[biggest]["bytes"] // 2)
    path = root / "step_00000004" / biggest
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    with pytest.raises(ckpt.ResumeError, match=rf"step_00000006 is damaged: file {biggest} has \d+ bytes, the manifest "
                                               rf"says \d+ \(truncated\?\); load another step"):
        ckpt.find_checkpoint(out)
    with pytest.raises(ckpt.ResumeError, match=rf"step_00000004 is damaged: file {biggest} does not match its hash"):
        ckpt.find_checkpoint(out, 4)
    warnings = []
    found = ckpt.find_intact(out, warn=warnings.append)
    assert found.tag == "step_00000002" and len(warnings) == 1
    assert "step_00000006 (file" in warnings[0] and "step_00000004 (file" in warnings[0], warnings
    resumed = dist_run(1, run_case, ["training.steps=6", "training.save=false"], str(out), 2)[0]
    assert resumed == full[2:]

    # The command line: one error line before anything starts, nothing written.
    args = ["--config", str(CONFIG), "--steps", "6", "--out", str(tmp_path / "other"), "--load", str(out),
            "--load-step", "4", "--set", *COMMON]
    assert main(args) == 2 and not (tmp_path / "other").exists()
    (root / "step_00000002" / "manifest.json").unlink()
    with pytest.raises(ckpt.ResumeError, match=r"has no manifest.json, so its files cannot be checked .* add "
                                               r"--allow-no-manifest to load it anyway$"):
        ckpt.find_checkpoint(out, 2)
    assert ckpt.find_checkpoint(out, 2, allow_no_manifest=True).step == 2


def test_keep_last_prunes_behind_a_checked_newer_checkpoint(dist_run, tmp_path):
    """training.keep_last 2: after steps 2, 4, 6 the newest two remain; a save whose files do not match its
    manifest (here: the manifest check made to fail) prunes nothing."""
    out = tmp_path / "run"
    dist_run(1, run_case, ["training.steps=6", "training.save_interval=2", "training.keep_last=2"], str(out))
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000006"]
    dist_run(1, keep_last_case_damaged, str(out))
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == \
        ["step_00000004", "step_00000006", "step_00000008"]


def keep_last_case_damaged(out):
    """Resume to step 8 with the manifest check failing in this worker: the step-8 save must not prune."""
    from zoo.training import checkpoint as ckpt

    real = ckpt.damage
    ckpt.damage = lambda folder, hashes=True: "file x is missing" if not hashes else real(folder, hashes)
    try:
        return run_case(["training.steps=8", "training.save_interval=2", "training.keep_last=2"], out, 6)
    finally:
        ckpt.damage = real


KILL_DURING_SAVE = textwrap.dedent("""
    import os, signal, sys
    import zoo.training.checkpoint as ckpt
    real = ckpt._write_atomic
    def write_then_die(path, text):
        if "step_00000004.partial" in str(path):  # DeepSpeed has written the step-4 files; zoo has not renamed them
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, text)
    ckpt._write_atomic = write_then_die
    from zoo.training.train import main
    sys.exit(main(sys.argv[1:]))
""")


def test_kill_while_saving_keeps_previous_checkpoint(dist_run, tmp_path):
    out = tmp_path / "run"
    args = ["--config", str(CONFIG), "--steps", "6", "--save-interval", "2", "--no-sample", "--out", str(out),
            "--set", *COMMON]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, *args], capture_output=True, text=True,
                            env=env, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert (out / "checkpoints" / "step_00000004.partial").is_dir()  # the interrupted save
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    # launch/train.py again (its main in the 1-rank pool, tests/mains.py): it resumes by itself
    [(code, stdout, stderr)] = dist_run(1, run_main, "zoo.training.train:main", args)
    assert code == 0, stdout[-2000:] + stderr[-2000:]
    assert "resumed from" in stdout and "step_00000002 at step 2" in stdout
    expected = dist_run(1, run_case, ["training.steps=6", "training.save=false"], str(tmp_path / "reference"))[0]
    got = losses_of(out)
    assert [got[s] for s in range(1, 7)] == expected
    assert not (out / "checkpoints" / "step_00000004.partial").exists()  # cleaned by the next save of step 4


def _main_error(capsys, argv):
    from zoo.training.train import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_load_arguments(capsys, tmp_path, dist_run):
    base = ["--config", str(CONFIG), "--set", *COMMON]
    assert "does not exist" in _main_error(capsys, base + ["--load", str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    assert "no checkpoint there" in _main_error(capsys, base + ["--load", str(tmp_path / "empty")])
    assert "--load-step needs --load" in _main_error(capsys, base + ["--load-step", "3"])
    out = tmp_path / "run"
    dist_run(1, run_case, ["training.steps=2"], str(out))
    msg = _main_error(capsys, base + ["--load", str(out), "--set", "model.hidden_size=128"])
    assert "different model" in msg and "hidden_size 64 vs 128" in msg
    assert "step 5 is missing" in _main_error(capsys, base + ["--load", str(out), "--load-step", "5"])
    msg = _main_error(capsys, base + ["--load", str(out), "--pp", "2"])  # world of 1: the layout error comes first
    assert "not divisible" in msg
    msg = _main_error(capsys, base + ["--load", str(out), "--set", "training.global_batch_size=8"])
    assert "global batch 4 x 32" in msg
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.endswith(".py"))
    assert kept == ["latest", "step_00000002"]  # nothing was touched by the refused runs (DeepSpeed adds its scripts)


def test_a_failing_save_leaves_the_previous_checkpoints_and_says_so(dist_run, tmp_path):
    """A run resumed from its step-2 checkpoint under a file size limit smaller than its checkpoint files (as a full
    disk fails a write): its step-4 save fails, the run stops with one line (exit status 5), no partial folder is
    left, latest still names step 2, which loads."""
    import resource

    from zoo.training.checkpoint import find_checkpoint

    out = tmp_path / "run"
    args = [sys.executable, str(ROOT / "launch/train.py"), "--config", str(CONFIG), "--no-sample", "--out", str(out),
            "--set", *COMMON]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    dist_run(1, run_case, ["training.steps=2"], str(out))  # the step-2 checkpoint, written without a limit
    biggest = max(p.stat().st_size for p in (out / "checkpoints" / "step_00000002").rglob("*.pt"))

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (biggest // 2, biggest // 2))

    second = subprocess.run(args + ["training.steps=4"], capture_output=True, text=True, env=env, timeout=300,
                            preexec_fn=limit_file_size)
    assert second.returncode == 5, second.stdout[-2000:] + second.stderr[-3000:]
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the checkpoint of step 4 could not be written (" in errors[0] and \
        "is the disk full, a file size limit set" in errors[0] and "the previous checkpoints are intact (newest: " \
        f"{out / 'checkpoints' / 'step_00000002'})" in errors[0], second.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_00000002"]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    assert find_checkpoint(out).step == 2


def main_with_a_failing_export(argv):
    """launch/train.py's main while the model export cannot write (as a full disk fails it)."""
    import errno

    from zoo.convert import io

    real_add = io.ShardedWriter.add

    def add(self, name, tensor):
        if self.folder.name == ".model.tmp":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add(self, name, tensor)

    io.ShardedWriter.add = add
    try:
        return run_main("zoo.training.train:main", argv)
    finally:
        io.ShardedWriter.add = real_add


def test_a_failing_export_says_so_and_the_same_command_exports(dist_run, tmp_path):
    """The export after the last step cannot be written: one line (exit status 5), no model folder or staging
    folder left, the checkpoints intact; the same command again resumes at the last step and exports."""
    out = tmp_path / "run"
    argv = ["--config", CONFIG, "--no-sample", "--out", out, "--set", *COMMON, "training.steps=2"]
    (code, _, err), = dist_run(1, main_with_a_failing_export, argv)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 5 and len(errors) == 1, err[-3000:]
    assert "model could not be written (OSError: [Errno 28] No space left on device)" in errors[0], errors
    assert f"the checkpoints in {out / 'checkpoints'} are intact" in errors[0], errors
    assert not (out / "model").exists() and not (out / ".model.tmp").exists()
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    (code, log, err), = dist_run(1, run_main, "zoo.training.train:main", argv)
    assert code == 0, err[-3000:]
    assert (out / "model" / "config.json").is_file() and "resumed from" in log
