"""What every canary of tests/compat/ says when a library no longer does what a piece of zoo.compat relies on."""

from __future__ import annotations

import inspect
from importlib import metadata

import pytest


def version(library: str) -> str:
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def expect(condition, library: str, piece: str, what: str) -> None:
    """Fail, naming the library's version, the zoo.compat piece and what changed, unless ``condition``."""
    if not condition:
        pytest.fail(f"{library} {version(library)}: {what}; zoo.compat.{piece} relies on it (checked on the versions "
                    f"its docstring names): adapt the piece to this release", pytrace=False)


def source(obj) -> str:
    """The source of a library function or class (empty when it has none, e.g. a C function)."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)
