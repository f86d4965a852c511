"""A folder built once and reused: the embedded corpora's tokenizer and indexed dataset (gpt_dataset, bert_dataset).

The folder is built in a temporary folder beside its final place and moved there with ``os.replace``; its marker
``done.json`` (what the build depends on: vocabulary, Python version, document count, ...) is written last, so an
interrupted build is never taken for a finished one, and a marker that differs means "build again". Several
processes building at once all end with the same finished folder.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

from zoo.data import files

MARKER = "done.json"


def cached_build(cache_dir: str | os.PathLike, name: str, marker: dict, build: Callable[[str], None]) -> str:
    """``cache_dir/name``, made by ``build(folder)`` unless it already holds a finished build with this ``marker``.

    ``build`` writes everything into the (temporary) folder it is given; returns the final folder's path."""
    cache_dir = os.fspath(cache_dir)
    final = os.path.join(cache_dir, name)

    def finished() -> bool:
        try:
            with open(os.path.join(final, MARKER), encoding="utf-8") as f:
                return json.load(f) == marker
        except (OSError, ValueError):
            return False

    if finished():
        return final
    os.makedirs(cache_dir, exist_ok=True)
    tmp = files.mkdtemp(dir=cache_dir, prefix=f".{name}-build-")
    try:
        build(tmp)
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f)
        if finished():  # another process finished meanwhile
            return final
        if os.path.exists(final):  # a stale or interrupted earlier build
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not finished():  # another process finished first: use its result, else a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
