"""Where a run's scalars go besides ``OUT/metrics.jsonl``: the loggers ``training.loggers`` names.

- ``tensorboard``: event files in ``OUT/tb``, scalars ``train/<key>`` and ``val/<key>`` (skipped without the
  ``tensorboard`` package: metrics.jsonl has everything).
- ``wandb``: a Weights & Biases run with the same scalars under the same names at the same steps, plus the
  pictures the run draws (the loss curve at the end, a U-Net's prediction grid after each evaluation, and what
  launch/train.py draws from the exported model at the end: the diffusion samples, the segmentation grid). Project, run
  name and tags come from ``training.wandb_project``, ``wandb_name``, ``wandb_tags``; the run config is the W&B
  config. ``WANDB_MODE=offline`` writes the run under ``OUT/wandb`` with no network (``wandb sync`` uploads it
  later). The run id is kept in ``OUT/wandb/zoo-run-id``, so a resumed run continues the same W&B run.

Only global rank 0 opens loggers (``MetricsWriter`` in zoo.training.trainer). A logger that cannot start (no network,
no W&B login) costs a warning, not the run: metrics.jsonl and the other loggers still get every number.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

LOGGERS = ("tensorboard", "wandb")
WANDB_ID_FILE = "zoo-run-id"


def check_loggers(training) -> None:
    """``training.loggers`` and the W&B fields, before any process group: a ValueError naming the fix."""
    names = training.loggers
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"training.loggers must be a list of names from {list(LOGGERS)}, got {names!r}")
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"training.loggers: unknown logger(s) {unknown}; known: {list(LOGGERS)} "
                         f"(e.g. --set training.loggers=[tensorboard,wandb])")
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ValueError("training.loggers names wandb but the wandb package is not installed; pip install wandb "
                         "(or pip install 'zoo[wandb]'; requirements.txt pins it) or drop wandb from training.loggers")
    tags = training.wandb_tags
    if tags is not None and not all(isinstance(t, (str, int, float)) for t in tags):
        raise ValueError(f"training.wandb_tags must be a list of words, got {tags!r}")


def numbers(record: dict) -> dict:
    """The scalars of a metrics record (``step`` apart): what TensorBoard and W&B both get."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and v is not None}


class TensorBoardLogger:
    def __init__(self, out: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # ImportError: no tensorboard, no logger

        self.writer = SummaryWriter(str(out / "tb"), purge_step=None if resume_step is None else resume_step + 1)

    def scalars(self, record: dict, prefix: str) -> None:
        for key, value in numbers(record).items():
            self.writer.add_scalar(f"{prefix}/{key}", value, record["step"])

    def image(self, key: str, path: Path, step: int) -> None:
        """TensorBoard gets scalars only; the PNGs stay in OUT."""

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, out: Path, cfg, resume_step: int | None):
        import wandb

        tr = cfg.training
        id_file = out / "wandb" / WANDB_ID_FILE
        # A fresh run (no resume) starts a new W&B run even in an old OUT; a resumed one continues its own.
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else None
        (out / "wandb").mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=tr.wandb_project or "zoo", name=tr.wandb_name or Path(cfg.out).name,
                              tags=[str(t) for t in tr.wandb_tags or []], config=cfg.to_dict(), dir=str(out),
                              id=run_id, resume="allow" if run_id else None)
        id_file.write_text(self.run.id)

    def scalars(self, record: dict, prefix: str) -> None:
        self.run.log({f"{prefix}/{k}": v for k, v in numbers(record).items()}, step=record["step"])

    def image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self.wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_loggers(cfg, out: Path, resume_step: int | None) -> list:
    """The loggers ``cfg.training.loggers`` names that can start here (global rank 0 calls this)."""
    opened = []
    for name in cfg.training.loggers:
        try:
            opened.append(TensorBoardLogger(out, resume_step) if name == "tensorboard" else
                          WandbLogger(out, cfg, resume_step))
        except ImportError:
            if name != "tensorboard":
                raise
        except Exception as e:  # W&B raises its own errors (no login, no network): the run goes on without it
            print(f"warning: {name} could not start ({' '.join(str(e).split())}); this run goes on without it "
                  f"(WANDB_MODE=offline needs no login or network)", file=sys.stderr, flush=True)
    return opened
