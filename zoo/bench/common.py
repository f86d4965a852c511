"""What the benchmarks share: the dtypes their ``--dtype`` flags name, the cores this process may run on, and
writing a report file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS has one): the default thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def write_report(path, text: str) -> None:
    """``text`` into the file ``path``, its folder made first (``--json runs/new/bench.json``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
