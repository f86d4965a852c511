"""The one door to the internals of DeepSpeed, torch and accelerate.

Where zoo needs something those libraries do not offer publicly (a private name, a class attribute to swap, a
module global to clear), the access lives here and nowhere else: :mod:`zoo.compat.deepspeed`,
:mod:`zoo.compat.torch`, :mod:`zoo.compat.accelerate`. Each piece is a small function or context manager whose
docstring says what public API is missing, the versions it was checked against and the upstream issue where one is
known; each has a canary test in ``tests/compat/`` that fails, naming the library version and what changed, when
the library moves what the piece relies on.

This package is the lowest layer: it imports no other zoo package. Importing it is cheap (no DeepSpeed, no torch:
the submodules import them), and it checks once per process that the installed DeepSpeed and torch are those zoo
was tested with (:func:`check_versions`); ``zoo.parallel`` imports it first, before any DeepSpeed import of zoo's.
"""

from __future__ import annotations

import os
import re
import sys

# The versions the suite ran with (requirements.txt) and the range a piece here is expected to hold in: the same
# minor release. Every piece was checked against deepspeed 0.19.8, torch 2.13.0 and accelerate 1.15.0.
TESTED = {
    "deepspeed": ((0, 19, 8), (0, 20)),
    "torch": ((2, 13, 0), (2, 14)),
}


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``: the leading numeric release; pre-release and local parts dropped."""
    found = re.match(r"\d+(\.\d+)*", version.strip())
    return tuple(int(part) for part in found.group(0).split(".")) if found else ()


def tested_range(name: str) -> str:
    """``"0.19.x (>=0.19.8,<0.20)"``."""
    low, high = TESTED[name]
    return (f"{'.'.join(map(str, low[:2]))}.x (>={'.'.join(map(str, low))},<{'.'.join(map(str, high))})")


def installed_versions() -> dict[str, str | None]:
    """The installed version of each library in :data:`TESTED` (None when it is not installed), read from the
    package metadata: nothing is imported."""
    from importlib import metadata

    found = {}
    for name in TESTED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def version_warning(versions: dict[str, str | None]) -> str | None:
    """The one warning line for the libraries whose installed version is outside their tested range, else None."""
    outside = []
    for name, version in versions.items():
        if version is None or name not in TESTED:
            continue
        low, high = TESTED[name]
        if not low <= version_tuple(version) < high:
            outside.append(f"{name} {version} is outside the tested range {tested_range(name)}")
    if not outside:
        return None
    return (f"zoo: {'; '.join(outside)}; zoo relies on some of {'its' if len(outside) == 1 else 'their'} internals "
            f"(zoo/compat), which may have changed: pytest tests/compat checks them")


_CHECKED = False


def check_versions(stream=None, force: bool = False) -> str | None:
    """Print, once per process and from global rank 0 only, one line naming the tested range of each library
    installed outside it (nothing when all are inside); returns that line. ``force``: check again."""
    global _CHECKED
    if _CHECKED and not force:
        return None
    _CHECKED = True
    line = version_warning(installed_versions())
    if line and os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr if stream is None else stream, flush=True)
    return line


check_versions()
