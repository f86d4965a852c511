"""What zoo finds as an installed package: its default config files and its optional dependencies (extras).

The default configs live in the checkout's top-level ``configs/``; ``pip install .`` copies them into the package as
``zoo/configs`` (pyproject.toml maps the folder), so a console script run from any folder finds the same files.
Optional dependencies are imported through :func:`require`, which turns a missing one into one line naming the
extra that brings it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
EXTRAS = {"diffusers": "diffusion", "wandb": "wandb"}  # importable module -> the extra of pyproject.toml that brings it


def config_file(relative: str) -> Path:
    """The shipped config ``relative`` to ``configs/`` (e.g. ``"gpt/main.yaml"``): the installed package's copy, else
    the checkout's. Only zoo's own defaults come through here; a ``--config`` the user gives stays relative to the
    working directory.

    The installed copy is tried first: ``zoo/configs`` exists only there, while the folder beside an installed
    ``zoo/`` is site-packages, where another distribution may have put a ``configs`` of its own."""
    installed, checkout = PACKAGE / "configs" / relative, PACKAGE.parent / "configs" / relative
    return installed if installed.is_file() else checkout


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message is the one line that says which extra brings it."""


def require(module: str):
    """``import module``, or :class:`MissingExtra` naming the pip command that installs it."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != top:  # the package is there but one of its own imports failed: that error says more
            raise
        raise MissingExtra(f"{top} is not installed: pip install 'zoo[{EXTRAS[top]}]' (or pip install -r "
                           f"requirements.txt, which pins it)") from None
