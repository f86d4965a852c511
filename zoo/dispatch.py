"""One command per task for every family: ``launch/generate.py`` and ``launch/finetune.py`` look at the model
folder they are given (``--ckpt`` / ``--init``) and hand the command line to that family's implementation."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def family_of(path: str | None) -> str | None:
    """The model family of a zoo folder (or a run folder holding ``model/``) or of a HuggingFace folder; None when
    it cannot be told (the default implementation then reports the problem)."""
    if path is None:
        return None
    folder = Path(path)
    if (folder / "model" / "config.json").is_file() and not (folder / "config.json").is_file():
        folder = folder / "model"
    try:
        meta = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if "zoo_format" in meta:
        return meta.get("family")
    from zoo.convert.registry import hf_family

    return hf_family(folder)


def generate_main(argv: list[str] | None = None) -> int:
    """launch/generate.py: the command of the ``--ckpt`` folder's family (``zoo.generate.COMMANDS``)."""
    from zoo.generate import command_of

    argv = list(sys.argv[1:] if argv is None else argv)
    return command_of(family_of(_flag(argv, "--ckpt")))(argv)


def finetune_main(argv: list[str] | None = None) -> int:
    """launch/finetune.py: the command of the ``--init`` folder's family (``zoo.finetune.COMMANDS``)."""
    from zoo.finetune import command_of

    argv = list(sys.argv[1:] if argv is None else argv)
    return command_of(family_of(_flag(argv, "--init")))(argv)
