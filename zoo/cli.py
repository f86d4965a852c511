"""The commands: each function here is one console script of pyproject.toml (``zoo-train`` -> :func:`train`) and what
the matching ``launch/*.py`` runs, so both start the same way.

Each turns off the libraries' progress bars in a log file before anything imports them, then imports and runs its
command's ``main``; an optional dependency that is missing ends the command with one line naming the extra.
"""

from __future__ import annotations

import os
import sys

from zoo.package import MissingExtra
from zoo.progress import no_bars_in_logs


def _run(main) -> int:
    try:
        return main()
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


def train() -> int:
    """zoo-train, launch/train.py."""
    no_bars_in_logs()  # in a log file no \r-drawn bars: before any library imports tqdm
    from zoo.training.train import main

    return _run(main)


def finetune() -> int:
    """zoo-finetune, launch/finetune.py."""
    no_bars_in_logs()
    from zoo.dispatch import finetune_main

    return _run(finetune_main)


def convert() -> int:
    """zoo-convert, launch/convert.py."""
    no_bars_in_logs()
    from zoo.convert.cli import main

    return _run(main)


def generate() -> int:
    """zoo-generate, launch/generate.py."""
    no_bars_in_logs()
    from zoo.dispatch import generate_main

    return _run(generate_main)


def plan() -> int:
    """zoo-plan, launch/plan.py."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # arithmetic only: no device is touched, so none is looked for
    no_bars_in_logs()
    from zoo.plan.cli import main

    return _run(main)


def preprocess() -> int:
    """zoo-preprocess, launch/preprocess.py."""
    no_bars_in_logs()
    from zoo.data.preprocess import main

    return _run(main)


def benchmark() -> int:
    """zoo-benchmark, launch/benchmark.py."""
    no_bars_in_logs()
    from zoo.bench.gpt import main

    return _run(main)
