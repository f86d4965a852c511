"""What the fine-tuning commands share beyond ``zoo.training.run``: the flags they all take and their run config
from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path

from zoo.training.config import RunConfig
from zoo.training.run import RunParser
from zoo.training.train import config_from_args as train_config_from_args

OUTPUTS = "output folder: config.yaml, metrics.jsonl, loss.png, checkpoints/, model/, hf/"


def add_finetune_flags(p: RunParser, default_config: Path, *, evaluation: str, sample: str,
                       outputs: str = OUTPUTS) -> None:
    """``--config`` (default ``default_config``), launch/train.py's run flags, ``--out`` and ``--no-sample``; the
    help texts name what this command evaluates, shows at the end and writes."""
    p.add_argument("--config", default=str(default_config),
                   help=f"run config YAML (default: {default_config.relative_to(default_config.parents[2])})")
    p.add_run_flags(eval_help=evaluation)
    p.add_argument("--out", help=outputs)
    p.add_argument("--no-sample", action="store_true", help=sample)


def run_config(args, source: str, paths: list, *, valid_paths: list | None = None,
               valid_fraction: float | None = None) -> RunConfig:
    """launch/train.py's run config of ``args`` (``--config``, the run flags, ``--set``), with ``--init``, ``--out``
    and the data (``data.source``, its paths, the validation split) from the command's own flags.

    Paths are set as given, not through --set's YAML parsing (a path may hold ':' or look like a number)."""
    cfg = train_config_from_args(argparse.Namespace(**{**vars(args), "init": None, "out": None}))
    if args.init is not None:
        cfg.training.init_from = args.init
    if args.out is not None:
        cfg.out = args.out
    cfg.data.source = source
    cfg.data.paths = list(paths)
    if valid_paths is not None:
        cfg.data.valid_paths = list(valid_paths)
    if valid_fraction is not None:
        cfg.data.valid_fraction = valid_fraction
    return cfg
