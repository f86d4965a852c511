"""Which converter reads an HF folder, and which exports or verifies a zoo folder: the convert layer's tables.

- ``ARCHITECTURES``: HF class name (``"LlamaForCausalLM"``, ``"UNet2DModel"``) -> :class:`Architecture`, declared by
  the files of ``zoo/convert/hf/`` (one per architecture: its key table, config mapping both ways, refusals);
- ``FAMILIES``: zoo family name -> the family converter (its streamed import, export and verify), declared by
  ``zoo/convert/gpt.py``, ``bert.py``, ``unet.py``.

Adding an HF architecture whose blocks zoo has is one file in ``zoo/convert/hf/`` and one line below
(docs/adding-a-model.md). Nothing here names a family: the entries say which family they belong to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zoo.models.registry import Registry


def _no_options(shapes: dict) -> dict:
    return {}


@dataclass(frozen=True)
class Architecture:
    """One HF class as zoo reads and writes it.

    ``groups(cfg, **options)`` is the key table in conversion groups (``{}`` filled in; ``tables.blocks``),
    ``to_zoo(hf config object)`` the zoo config computing what the HF model computes (or a one-line refusal naming
    the field), ``to_hf(cfg, dtype, special ids)`` the HF config object for a zoo config (None: import only).
    ``exports(cfg)`` says whether a zoo config of ``family`` exports as this class (``check_export`` may then refuse
    it in one line; ``export_needs`` says in words what the class needs, for the refusal when none fits).
    ``read_options(checkpoint shapes)`` gives the options of ``groups`` a checkpoint's key names imply (a GPT-2's
    prefix, an MoE's expert layout), ``check_checkpoint(groups, cfg, options, shapes, where)`` an extra check.
    ``extra``: what the family converter needs besides (e.g. the BERT head of the class)."""

    name: str
    family: str
    config_class: Callable[[], type]
    to_zoo: Callable[[Any], Any]
    groups: Callable[..., list]
    to_hf: Callable | None = None
    model_type: str | None = None
    library: str = "transformers"
    exports: Callable[[Any], bool] | None = None
    export_needs: str = ""
    check_export: Callable[[Any], None] | None = None
    read_options: Callable[[dict], dict] = _no_options
    check_checkpoint: Callable | None = None
    extra: dict = field(default_factory=dict)

    def rows(self, cfg, **options) -> list:
        """Every row of :attr:`groups`, in conversion order."""
        return [r for group in self.groups(cfg, **options) for r in group]


ARCHITECTURES = Registry("HF architecture", (
    "zoo.convert.hf.gpt2",
    "zoo.convert.hf.llama",
    "zoo.convert.hf.mistral",
    "zoo.convert.hf.qwen2",
    "zoo.convert.hf.qwen3",
    "zoo.convert.hf.mixtral",
    "zoo.convert.hf.qwen2_moe",
    "zoo.convert.hf.qwen3_moe",
    "zoo.convert.hf.olmoe",
    "zoo.convert.hf.gemma2",
    "zoo.convert.hf.olmo2",
    "zoo.convert.hf.granite",
    "zoo.convert.hf.gpt_neox",
    "zoo.convert.hf.gemma3",
    "zoo.convert.hf.gemma4",
    "zoo.convert.hf.phi3",
    "zoo.convert.hf.smollm3",
    "zoo.convert.hf.bert",
    "zoo.convert.hf.unet2d",
), "ARCHITECTURES")

FAMILIES = Registry("convertible family", (
    "zoo.convert.gpt",
    "zoo.convert.bert",
    "zoo.convert.unet",
), "FAMILIES")


def convertible() -> list[str]:
    """The families zoo-to-hf exports and verify compares (a family may be listed without a converter)."""
    return [name for name, converter in FAMILIES.items() if converter is not None]


def names(library: str = "transformers") -> list[str]:
    """The registered class names of ``library`` ("transformers" or "diffusers"), in registration order."""
    return [name for name, a in ARCHITECTURES.items() if a.library == library]


def model_types() -> dict[str, str]:
    """transformers ``model_type`` -> the class a config.json without ``architectures`` reads as."""
    return {a.model_type: name for name, a in ARCHITECTURES.items() if a.model_type}


def of_family(family: str) -> list[Architecture]:
    """The architectures importing into ``family``, in registration order."""
    return [a for _, a in ARCHITECTURES.items() if a.family == family]


def architecture_of_folder(folder) -> Architecture:
    """The registered architecture an HF folder (transformers, sentence-transformers, or a diffusers model or
    pipeline folder) names; a folder that names none zoo reads is refused in one line naming what is supported."""
    from zoo.convert import hub
    from zoo.convert.errors import ConvertError

    folder = Path(folder)
    diffusers = names("diffusers")
    found = hub.diffusers_model(folder, diffusers[0] if diffusers else "")
    if found is not None:
        name, where = found
        if name in diffusers:
            return ARCHITECTURES[name]
        supported = (f"supported diffusers models: {', '.join(diffusers)} (a model folder, or a pipeline folder with "
                     f"it in unet/)")
        if where.name == "model_index.json":
            raise ConvertError(f"{where}: diffusers pipeline {name} has no unet/ model; {supported}")
        raise ConvertError(f"{where}: diffusers model class {name} is not supported; {supported}")
    meta = hub.read_hf_meta(hub.transformers_folder(folder))  # refuses a folder without a readable HF config
    name = hub.class_name(meta, model_types()) or "unknown"
    if name not in names("transformers"):
        raise ConvertError(f"{folder / 'config.json'}: architecture {name} is not supported; supported: "
                           f"{', '.join(names('transformers'))}")
    return ARCHITECTURES[name]


def hf_architecture(folder) -> Architecture | None:
    """:func:`architecture_of_folder`, or None where the folder names no architecture zoo reads."""
    from zoo.convert.errors import ConvertError

    try:
        return architecture_of_folder(folder)
    except ConvertError:
        return None


def hf_family(folder) -> str | None:
    """The zoo family an HF / diffusers folder imports into; None when it is not one zoo reads."""
    arch = hf_architecture(folder)
    return None if arch is None else arch.family
