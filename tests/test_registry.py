"""One place per model: every family of ``zoo.models.registry`` is complete in every layer's table, and no file outside
a family's own names it by a bare string (docs/adding-a-model.md).

The tables are the layers' own (each filled by its modules); the name check reads the source with ``ast``, so
comments and docstrings may name families freely.
"""

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

from zoo.models.registry import FAMILIES, config_class

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "zoo"

# "module:attribute" of each layer's table keyed by family name.
LAYER_TABLES = ["zoo.training.families:REGISTRY", "zoo.generate:PRETRAINED", "zoo.generate:COMMANDS",
                "zoo.finetune:COMMANDS", "zoo.convert.registry:FAMILIES"]


def _table(spec: str):
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("spec", LAYER_TABLES)
def test_every_family_is_in_every_layer(spec):
    names = set(_table(spec))
    families = set(FAMILIES.names())
    assert not families - names, f"{spec} lacks the families {sorted(families - names)}: register them there"
    assert not names - families, f"{spec} names families zoo.models.registry does not know: {sorted(names - families)}"


def test_training_families_agree_with_the_models():
    from zoo.training.families import REGISTRY

    for name, family in REGISTRY.items():
        assert family.name == name
        assert family.config_class is config_class(name), name


def test_commands_fall_back_to_the_text_model():
    """A folder of a family without its own generate or fine-tune command (or of no family zoo can tell) goes to
    the GPT's command, which refuses it in one line: as launch/generate.py and launch/finetune.py always did."""
    import zoo.finetune.bert
    import zoo.finetune.gpt
    import zoo.finetune.unet
    import zoo.generate.gpt
    import zoo.generate.unet
    from zoo.finetune import command_of as finetune_command
    from zoo.generate import command_of as generate_command
    from zoo.models import bert, gpt, unet

    assert generate_command(unet.DIFFUSION_FAMILY) is zoo.generate.unet.main
    for family in (None, "rnn", gpt.FAMILY, bert.FAMILY, bert.CLASSIFIER_FAMILY, unet.SEG_FAMILY):
        assert generate_command(family) is zoo.generate.gpt.main, family
    assert finetune_command(bert.FAMILY) is finetune_command(bert.CLASSIFIER_FAMILY) is zoo.finetune.bert.main
    assert finetune_command(unet.SEG_FAMILY) is zoo.finetune.unet.main
    for family in (None, "rnn", gpt.FAMILY, unet.DIFFUSION_FAMILY):
        assert finetune_command(family) is zoo.finetune.gpt.main, family


# ---------------------------------------------------------------------------------------------------------------
# No bare family names outside a family's own files
# ---------------------------------------------------------------------------------------------------------------


def own_stems() -> dict[str, set[str]]:
    """family -> the stems a file name holds when the file is that family's own: the name of the model module that
    declares it (``gpt``, ``bert``, ``unet``); the diffusion U-Net's HF side is diffusers'."""
    stems: dict[str, set[str]] = {}
    for module in FAMILIES.modules:
        for name in importlib.import_module(module).FAMILIES:
            stems.setdefault(name, set()).add(module.rsplit(".", 1)[1])
    from zoo.models.unet import DIFFUSION_FAMILY

    stems[DIFFUSION_FAMILY].add("diffusers")
    return stems


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of the module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def bare_family_names(text: str, rel: str, stems: dict[str, set[str]]) -> list[str]:
    """``"file:line: 'name'"`` for each string constant of the source ``text`` of the file ``rel`` (relative to the
    repository) that equals a family name and is not in a docstring or in a file of that family's own."""
    if rel.startswith(("zoo/models/", "zoo/convert/hf/")):
        return []
    name = Path(rel).name
    tree = ast.parse(text, rel)
    skip = _docstrings(tree)
    hits = [node for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in stems
            and id(node) not in skip and not any(stem in name for stem in stems[node.value])]
    return [f"{rel}:{node.lineno}: {node.value!r}" for node in sorted(hits, key=lambda n: (n.lineno, n.col_offset))]


def _files(*places: str) -> list[Path]:
    out = []
    for place in places:
        p = ZOO / place
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


@pytest.mark.parametrize("places", [("generate", "training", "finetune", "plan", "bench"), ("dispatch.py",),
                                    ("convert",)], ids=lambda places: "+".join(places))
def test_no_bare_family_names(places):
    stems = own_stems()
    found = [hit for path in _files(*places)
             for hit in bare_family_names(path.read_text(), path.relative_to(ROOT).as_posix(), stems)]
    assert not found, ("name families by the model modules' constants (zoo.models.gpt.FAMILY, ...) or ask the "
                       "registry:\n" + "\n".join(found))


def test_the_name_check_sees_strings_but_not_docstrings():
    """The check itself: a bare name in code is found; one in a docstring, in the family's own file or in
    zoo/models is not."""
    stems = own_stems()
    code = 'def f():\n    """Docstring naming "gpt"."""\n    return "gpt", f"{1}" == "unet-diffusion"  # "bert"\n'

    def found(rel):
        return [hit.split(": ", 1)[1] for hit in bare_family_names(code, rel, stems)]

    assert found("zoo/generate/probe.py") == ["'gpt'", "'unet-diffusion'"]
    assert found("zoo/generate/unet_probe.py") == ["'gpt'"]
    assert found("zoo/convert/hf_diffusers.py") == ["'gpt'"]
    assert found("zoo/models/probe.py") == []
