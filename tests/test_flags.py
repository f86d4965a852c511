"""Every entry point refuses a flag it does not know in one line (zoo/flags.py), and takes the launchers'
``--local_rank``.

Each command's ``main`` runs in this process: the refusal comes while the command line is parsed, before anything
is read, so a case costs milliseconds. finetune and generate hand the command line to the family of the folder they
are given (zoo/dispatch.py): a case per family, each with a folder that says only its family."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from zoo.flags import Parser, refusal, without_launcher_flags

ROOT = Path(__file__).resolve().parents[1]


def accelerate_loop_main(argv):
    spec = importlib.util.spec_from_file_location("accelerate_loop", ROOT / "launch/accelerate_loop.py")
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    return loop.main(argv)


# (case, main, argv before the unknown flag, what the line names besides the flag, whether --set hints apply)
FAMILIES = {"gpt": "launch/finetune.py", "bert": "zoo.finetune.bert", "unet-segmentation": "zoo.finetune.unet"}
ENTRY_POINTS = [
    ("train", "zoo.training.train:main", [], "launch/train.py", True),
    *((f"finetune-{f}", "zoo.dispatch:finetune_main", ["--init", f"{{tmp}}/{f}"], prog, True)
      for f, prog in FAMILIES.items()),
    ("accelerate_loop", accelerate_loop_main, [], "launch/accelerate_loop.py", True),
    *((f"convert-{c}", "zoo.convert.cli:main", [c], f"launch/convert.py {c}", False)
      for c in ("hf-to-zoo", "zoo-to-hf", "verify")),
    ("generate-gpt", "zoo.dispatch:generate_main", ["--ckpt", "{tmp}/gpt"], "launch/generate.py", False),
    ("generate-unet", "zoo.dispatch:generate_main", ["--ckpt", "{tmp}/unet-diffusion"], "zoo.generate.unet", False),
    ("plan", "zoo.plan.cli:main", [], "launch/plan.py", False),
    ("preprocess", "zoo.data.preprocess:main", [], "preprocess.py", False),
    ("benchmark", "zoo.bench.gpt:main", [], "launch/benchmark.py", False),
    ("benchmark_long_context", "zoo.bench.long_context:main", [], "launch/benchmark_long_context.py", True),
    ("benchmark_unet", "zoo.bench.unet:main", [], "launch/benchmark_unet.py", False),
    ("check_parallel", "zoo.parallel.check:main", [], "launch/check_parallel.py", False),
]


def run(main, argv) -> tuple:
    """``(exit status, stdout, stderr)`` of ``main(argv)`` (a ``module:function`` or a function)."""
    if isinstance(main, str):
        module, name = main.split(":")
        main = getattr(importlib.import_module(module), name)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One folder per family whose config.json says only that (all dispatch reads)."""
    tmp = tmp_path_factory.mktemp("families")
    for family in (*FAMILIES, "unet-diffusion"):
        (tmp / family).mkdir()
        (tmp / family / "config.json").write_text(json.dumps({"zoo_format": 1, "family": family}))
    # the families' modules imported before stderr is captured (an import may log a line of its own)
    for module in ("zoo.finetune.gpt", "zoo.finetune.bert", "zoo.finetune.unet", "zoo.generate.gpt",
                   "zoo.generate.unet", "zoo.training.train", "zoo.training.families.gpt"):
        importlib.import_module(module)
    return tmp


@pytest.mark.parametrize("flag", [["--lr", "1e-2"], ["--lora-rank", "8"]], ids=["lr", "lora-rank"])
@pytest.mark.parametrize("case,main,argv,prog,run_config", ENTRY_POINTS, ids=[e[0] for e in ENTRY_POINTS])
def test_an_unknown_flag_is_refused_in_one_line(folders, monkeypatch, flag, case, main, argv, prog, run_config):
    monkeypatch.delenv("RANK", raising=False)
    if flag[0] == "--lr" and case in ("benchmark", "benchmark_unet"):
        pytest.skip("the benchmarks' optimizer takes --lr")
    code, out, err = run(main, [a.format(tmp=folders) for a in argv] + flag)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, out, err)
    assert lines[0].startswith("error: ") and flag[0] in lines[0] and prog in lines[0], lines
    if flag[0] == "--lr" and run_config:
        assert "--set training.lr=1e-2" in lines[0], lines


def test_train_names_every_megatron_flag_at_once(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    code, _, err = run("zoo.training.train:main", ["--steps", "3", "--lr", "1e-2", "--micro-batch-size", "4",
                                                  "--seq-length", "64", "--train-iters", "50"])
    assert code == 2
    assert err.strip() == ("error: launch/train.py: unknown flags --lr (use --set training.lr=1e-2), "
                           "--micro-batch-size (use --set training.micro_batch_size=4), --seq-length "
                           "(use --set training.seq_length=64), --train-iters (use --steps 50); "
                           "see launch/train.py --help")


def test_a_near_miss_names_the_flag_meant(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    code, _, err = run("zoo.training.train:main", ["--tpp", "2", "--sequence-parallel", "--hidden-size", "64"])
    assert code == 2
    assert ("--tpp (did you mean --tp?), --sequence-parallel (use --set parallel.sequence_parallel=true), "
            "--hidden-size (use --set model.hidden_size=64)") in err


def test_only_rank_0_says_it(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    code, _, err = run("zoo.training.train:main", ["--lr", "1e-2"])
    assert code == 2 and err == ""


@pytest.mark.parametrize("launcher", [["--local_rank=0"], ["--local-rank", "0"], ["--local_rank", "3"],
                                      ["--local-rank=1"]])
def test_the_launchers_local_rank_is_taken(launcher):
    from zoo.convert.cli import build_parser
    from zoo.training.train import parse_args

    assert parse_args([*launcher, "--steps", "3"]).steps == 3
    assert parse_args(["--steps", "3", *launcher]).steps == 3
    args = build_parser().parse_args([*launcher, "verify", "--hf", "a", "--zoo", "b"])
    assert (args.command, args.hf) == ("verify", "a")


def test_without_launcher_flags():
    assert without_launcher_flags(["--local_rank=0", "--a", "1", "--local-rank", "2", "--b"]) == ["--a", "1", "--b"]
    assert without_launcher_flags(["--local_rank", "--a"]) == ["--local_rank", "--a"]  # no rank: not the launcher's


def test_refusal_line():
    hints = {"--lr": "--set training.lr={value}", "--bf16": "--set training.precision=bf16"}
    assert refusal("p", ["--lr=3"], ["--steps"], hints) == ("error: p: unknown flag --lr (use --set training.lr=3); "
                                                            "see p --help")
    assert refusal("p", ["--lr"], [], hints) == "error: p: unknown flag --lr (use --set training.lr=...); see p --help"
    assert refusal("p", ["--bf16", "--stepss", "3"], ["--steps"], hints) == (
        "error: p: unknown flags --bf16 (use --set training.precision=bf16), --stepss (did you mean --steps?); "
        "see p --help")
    assert refusal("p", ["extra"], [], {}) == "error: p: unexpected argument extra; see p --help"


def test_a_missing_required_flag_comes_after_an_unknown_one(capsys):
    p = Parser(prog="p")
    p.add_argument("--data", required=True)
    with pytest.raises(SystemExit):
        p.parse_args(["--lora-rank", "8"])
    assert "unknown flag --lora-rank" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args([])
    assert "required: --data" in capsys.readouterr().err
    assert p.parse_args(["--data", "x"]).data == "x"


def test_a_console_script_names_itself(monkeypatch):
    """Run as ``zoo-train`` (pyproject's console script), the usage and the refusal say zoo-train, not the
    launch/ file's name."""
    monkeypatch.setattr("sys.argv", ["/venv/bin/zoo-train"])
    code, _, err = run("zoo.training.train:main", ["--lr", "1e-2"])
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("error: zoo-train: unknown flag --lr") and "see zoo-train --help" in line
