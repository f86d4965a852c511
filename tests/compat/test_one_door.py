"""Private names of DeepSpeed, torch and accelerate are used only in ``zoo/compat/`` (docs/architecture.md,
"Dependencies' internals"): any other module of ``zoo/`` reaching one fails here, naming the line.

Read from the source with ``ast``: an attribute or import whose name starts with ``_`` (dunders aside) on a name
bound to one of those libraries (``torch._dynamo``, ``from deepspeed.x import _y``, ``engine._global_grad_norm``),
and the private attributes zoo is known to touch on DeepSpeed's objects.
"""

import ast
from pathlib import Path

import pytest

ZOO = Path(__file__).resolve().parents[2] / "zoo"
LIBRARIES = ("torch", "deepspeed", "accelerate")
# Objects of those libraries that zoo holds in variables of these names (a DeepSpeed engine, its optimizer).
LIBRARY_OBJECTS = ("engine", "optimizer")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(source: str, path: str) -> list[str]:
    """``"path:line name"`` for each private name of the libraries the source reaches."""
    tree = ast.parse(source, path)
    aliases = set(LIBRARIES) | set(LIBRARY_OBJECTS)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARIES:
                    if any(_private(part) for part in a.name.split(".")):
                        found.append(f"{path}:{node.lineno} import {a.name}")
                    aliases.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in LIBRARIES:
            parts = node.module.split(".") + [a.name for a in node.names]
            if any(_private(part) for part in parts):
                found.append(f"{path}:{node.lineno} from {node.module} import "
                             f"{', '.join(a.name for a in node.names)}")
            aliases.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _root(node) in aliases:
            found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return found


def test_private_names_only_in_compat():
    found = []
    for path in sorted(ZOO.rglob("*.py")):
        rel = path.relative_to(ZOO.parent).as_posix()
        if not rel.startswith("zoo/compat/"):
            found += private_uses(path.read_text(), rel)
    assert not found, "move these into a function of zoo/compat/ (why, versions, a canary):\n" + "\n".join(found)


@pytest.mark.parametrize("code, hits", [
    ("import torch._dynamo\n", 1),
    ("from torch.utils._python_dispatch import TorchDispatchMode\n", 1),
    ("import torch\nx = torch._C\n", 1),
    ("import deepspeed.comm as dist\ndist._groups\n", 1),
    ("def f(engine):\n    engine._global_grad_norm = 1\n", 1),
    ("import torch\ntorch.__version__\nclass A:\n    def f(self):\n        self._x = 1\n", 0),
    ("import numpy as np\nnp._private\n", 0),
])
def test_the_check_finds_private_names(code, hits):
    assert len(private_uses(code, "x.py")) == hits
