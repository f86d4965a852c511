"""Temporary files and folders beside their final place, with the modes any other tool's files get.

Datasets and caches are written under a unique temporary name and renamed into place, so a crash never leaves a
half-written one under the final name. ``tempfile.mkstemp`` / ``mkdtemp`` would make those names 0600 / 0700
whatever the umask (right for secrets), and the rename keeps the mode: a dataset prepared on a cluster's shared file
system would stay unreadable by the user's group and by jobs running under other accounts. These two create the
same kind of unique name with 0o666 / 0o777 less the umask, as ``open()`` and ``os.mkdir`` do.
"""

from __future__ import annotations

import os
import secrets

_ATTEMPTS = 100


def _unique_names(dir: str | os.PathLike, prefix: str, suffix: str):
    for _ in range(_ATTEMPTS):
        yield os.path.join(os.fspath(dir), f"{prefix}{secrets.token_hex(6)}{suffix}")
    raise FileExistsError(f"no unused temporary name {prefix}*{suffix} in {dir} after {_ATTEMPTS} tries")


def mkstemp(suffix: str = "", prefix: str = "tmp", *, dir: str | os.PathLike) -> tuple[int, str]:
    """``(descriptor open for reading and writing, path)`` of a new file in ``dir``, as ``tempfile.mkstemp``,
    mode 0o666 & ~umask."""
    for path in _unique_names(dir, prefix, suffix):
        try:  # O_EXCL: never an existing file, nor a symlink planted under the name
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), path
        except FileExistsError:
            continue


def mkdtemp(suffix: str = "", prefix: str = "tmp", *, dir: str | os.PathLike) -> str:
    """Path of a new, empty folder in ``dir``, as ``tempfile.mkdtemp``, mode 0o777 & ~umask."""
    for path in _unique_names(dir, prefix, suffix):
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
