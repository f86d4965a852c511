"""The version check of zoo.compat: one warning line naming the tested range when DeepSpeed or torch is outside it."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import zoo.compat

ROOT = Path(__file__).resolve().parents[2]


def check(monkeypatch, versions: dict, rank: str = "0") -> tuple[str | None, str]:
    monkeypatch.setattr(zoo.compat, "installed_versions", lambda: versions)
    monkeypatch.setenv("RANK", rank)
    out = io.StringIO()
    return zoo.compat.check_versions(stream=out, force=True), out.getvalue()


def test_a_deepspeed_outside_the_range_prints_one_line_naming_it(monkeypatch):
    line, printed = check(monkeypatch, {"deepspeed": "0.20.1", "torch": "2.13.0+cpu"})
    assert printed == line + "\n" and printed.count("\n") == 1
    assert line.startswith("zoo: deepspeed 0.20.1 is outside the tested range 0.19.x (>=0.19.8,<0.20); ")
    assert "torch" not in line


def test_both_outside_still_one_line(monkeypatch):
    _, printed = check(monkeypatch, {"deepspeed": "0.18.3", "torch": "2.14.0"})
    assert printed.count("\n") == 1
    assert "deepspeed 0.18.3 is outside the tested range 0.19.x (>=0.19.8,<0.20)" in printed
    assert "torch 2.14.0 is outside the tested range 2.13.x (>=2.13.0,<2.14)" in printed


@pytest.mark.parametrize("versions", [{"deepspeed": "0.19.8", "torch": "2.13.0+cpu"},
                                      {"deepspeed": "0.19.12", "torch": "2.13.1+cu128"},
                                      {"deepspeed": None, "torch": "2.13.0"}])
def test_inside_the_range_nothing(monkeypatch, versions):
    assert check(monkeypatch, versions) == (None, "")


def test_only_global_rank_0_prints(monkeypatch):
    line, printed = check(monkeypatch, {"deepspeed": "0.20.1", "torch": "2.13.0"}, rank="1")
    assert line and printed == ""


def test_once_per_process(monkeypatch):
    check(monkeypatch, {"deepspeed": "0.20.1", "torch": "2.13.0"})
    out = io.StringIO()
    assert zoo.compat.check_versions(stream=out) is None and out.getvalue() == ""


def test_the_line_comes_where_zoo_first_imports_deepspeed():
    """A fresh process: ``import zoo`` stays cheap (no check, no DeepSpeed); the first zoo package that imports
    DeepSpeed (zoo.parallel, below zoo.models and everything else) prints the line, once."""
    code = ("import importlib.metadata as m, sys\n"
            "real = m.version\n"
            "m.version = lambda name: '0.20.1' if name == 'deepspeed' else real(name)\n"
            "import zoo\n"
            "assert 'zoo.compat' not in sys.modules and 'deepspeed' not in sys.modules\n"
            "import zoo.parallel, zoo.models.gpt\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("zoo:")]
    assert len(lines) == 1 and "deepspeed 0.20.1 is outside the tested range 0.19.x (>=0.19.8,<0.20)" in lines[0], \
        done.stderr
