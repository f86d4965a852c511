"""A command's ``main`` run in a pool worker as torchrun would run it, without the launcher's process start-up.

torchrun costs a test ~7-10 s before the first step (its own torch import, then each worker's imports); the pool's
workers already hold the world of the test's size (RANK, WORLD_SIZE, MASTER_ADDR/PORT set, the gloo world group up),
which is what ``init_distributed`` finds under torchrun. The command tears the world down as it exits; the pool makes
it again before the next task (tests/conftest.py). Tests of the launchers themselves (restarts, signals, a killed
rank, accelerate and deepspeed launch) still start real processes.
"""

from __future__ import annotations

import contextlib
import importlib
import io


def run_main(target: str, argv: list) -> tuple:
    """``(exit status, stdout, stderr)`` of ``module:function`` called with ``argv``, its output captured."""
    module, name = target.split(":")
    main = getattr(importlib.import_module(module), name)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's refusals
            code = e.code
    return code, out.getvalue(), err.getvalue()
