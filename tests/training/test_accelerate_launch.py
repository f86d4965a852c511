"""``accelerate launch`` runs launch/train.py as torchrun does; its flags that zoo would not honour are refused.

The launch is real (2 processes through accelerate's launcher); its losses are held against the single-process run
of the same config, which every layout's pool run equals (tests/training/test_gpt_layouts.py).
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.training.test_gpt_layouts import COMMON, layout_run

ROOT = Path(__file__).resolve().parents[2]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_launch_tp2_equals_the_single_process_run(dist_run, tmp_path):
    expected = layout_run(dist_run, "gpt2", "single", ["training.steps=5"])[0][0]  # the README's --steps 5
    out = tmp_path / "run"
    # --multi_gpu: on a machine without several GPUs accelerate's launcher starts N processes only with it.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), str(ROOT / "launch/train.py"), "--config",
           str(ROOT / "configs/gpt/tiny.yaml"), "--tp", "2", "--steps", "5",
           "--out", str(out), "--set", *COMMON]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tp=2 pp=1 dp=1" in proc.stdout
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


ACCELERATE_ENV = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_MIXED_PRECISION": "no"}


@pytest.mark.parametrize("env,message", [
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
     "accelerate launch --zero_stage 2, but the run config has parallel.zero_stage 1 and zoo makes the DeepSpeed "
     "config from the run config: pass --zero 2"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json"},
     "accelerate launch --deepspeed_config_file ds.json: zoo makes the DeepSpeed config from the run config"),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"},
     "accelerate launch --mixed_precision bf16, but the run config trains in fp32; pass --set training.precision=bf16"),
])
def test_accelerate_flags_zoo_would_not_honour_are_refused(monkeypatch, tmp_path, capsys, env, message):
    from zoo.training.train import main

    for key, value in {**ACCELERATE_ENV, **env, "WORLD_SIZE": "2", "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert main(["--out", str(tmp_path), "--set", "data.source=synthetic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {err[0].removeprefix('error: ')}"] and message in err[0]
    assert not any(tmp_path.iterdir()), "nothing written"


def test_one_process_from_accelerate_says_how_to_start_n(monkeypatch, tmp_path, capsys):
    """``accelerate launch --num_processes 2`` without --multi_gpu on a CPU machine: one process, and a warning."""
    from zoo.training.train import main

    for key, value in {**ACCELERATE_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--tp", "2", "--out", str(tmp_path), "--set", "data.source=synthetic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("warning: accelerate launch started one process") and "--multi_gpu" in err[0]
    assert err[1].startswith("error: world size 1 is not divisible by tp*pp = 2")
