"""The layers of the code: data flows down, nothing imports upward (docs/architecture.md, "Layout").

Every ``import zoo.X`` / ``from zoo.X import`` in every module of ``zoo/`` (also inside functions) is read from the
source, and a package may only import from packages at its own level or below.
"""

import ast
from pathlib import Path

ZOO = Path(__file__).resolve().parents[1] / "zoo"
ORDER = ["compat", "progress", "flags", "package", "parallel", "models", "convert", "data", "generate", "training",
         "finetune", "bench", "plan", "dispatch", "cli"]
LEVEL = {name: i for i, name in enumerate(ORDER)}
LEVEL["bench"] = LEVEL["plan"] = LEVEL["finetune"]  # siblings: none imports another
# level 0 too: small modules every layer may use (flags: the command lines; package: shipped configs and extras)
LEVEL["flags"] = LEVEL["package"] = LEVEL["progress"]


def imported_packages(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        out += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("zoo.")]
    return out


def test_every_package_is_placed():
    packages = {p.stem if p.is_file() else p.name for p in ZOO.iterdir() if p.name != "__init__.py"
                and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert packages == set(ORDER), f"place new packages in ORDER: {sorted(packages ^ set(ORDER))}"


def test_no_package_imports_from_a_higher_one():
    upward = []
    for path in sorted(ZOO.rglob("*.py")):
        rel = path.relative_to(ZOO)
        if rel.parts == ("__init__.py",):
            continue
        mine = rel.parts[0].removesuffix(".py")
        for line, theirs in imported_packages(path):
            if theirs in LEVEL and LEVEL[theirs] > LEVEL[mine]:
                upward.append(f"zoo/{rel}:{line} imports zoo.{theirs}")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)
