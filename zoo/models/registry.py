"""The registry: one table per layer, keyed by the same family names.

A *family* (GPT decoder, BERT encoder, BERT classifier, segmentation U-Net, diffusion U-Net) is one registered unit.
Every layer that needs to know about families keeps one :class:`Registry`, filled by its own modules, each module
declaring the entries it provides in a module-level dict (``FAMILIES``, ``ARCHITECTURES``, ...):

- models (here): family name -> config class, declared by the model files (``zoo.models.gpt.FAMILIES``);
- convert: HF architecture (class name) -> adapter, family name -> exporter and verifier (``zoo.convert.registry``);
- training: family name -> :class:`zoo.training.families.Family` (batches, loss, metrics, data);
- generate: family name -> the ``Pretrained*`` class ``load_model`` returns;
- finetune: family name -> the fine-tune command of that family.

A layer lists the modules it reads (one line per module, the only place a new family or HF architecture is
registered) and imports them all on first lookup, so modules must import heavy or optional dependencies lazily.
``tests/test_registry.py`` checks that every family named here has an entry in every other layer's table, so a
family cannot be half-registered, and that no other file names a family by a bare string.

Layering: this module imports nothing of zoo at module level, so every layer (models and up) can use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any


class Registry:
    """``name -> entry``, merged from the dict ``attr`` of each module in ``modules`` (imported on first use).

    Two modules declaring the same name is a programming error, reported when the table is first read."""

    def __init__(self, what: str, modules: tuple[str, ...], attr: str):
        self.what, self.modules, self.attr = what, tuple(modules), attr
        self._table: dict[str, Any] | None = None
        self._owner: dict[str, str] = {}

    def _load(self) -> dict[str, Any]:
        if self._table is None:
            table: dict[str, Any] = {}
            owner: dict[str, str] = {}
            for name in self.modules:
                for key, entry in getattr(importlib.import_module(name), self.attr).items():
                    if key in table:
                        raise RuntimeError(f"{self.what} {key!r} is registered twice: in {owner[key]} and {name}")
                    table[key], owner[key] = entry, name
            self._table, self._owner = table, owner
        return self._table

    def __getitem__(self, key: str):
        table = self._load()
        if key not in table:
            raise KeyError(f"{self.what} {key!r} is not known; known: {', '.join(sorted(table))}")
        return table[key]

    def get(self, key: str, default=None):
        return self._load().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._load()

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def module_of(self, key: str) -> str:
        """The module that registered ``key`` (e.g. ``"zoo.convert.hf.llama"``)."""
        self[key]
        return self._owner[key]

    def names(self) -> list[str]:
        return sorted(self._load())

    def items(self):
        return self._load().items()


# The model files: each declares ``FAMILIES = {family name: config class}``.
FAMILIES = Registry("model family", ("zoo.models.gpt", "zoo.models.bert", "zoo.models.unet"), "FAMILIES")


def family_names() -> list[str]:
    """Every registered family name, sorted."""
    return FAMILIES.names()


def config_class(family: str) -> type:
    """The config dataclass of ``family`` (a ``KeyError`` naming the known families otherwise)."""
    return FAMILIES[family]
