"""zoo as an installed package (pyproject.toml): every folder of zoo/ and configs/ is installed, each console script
runs the function its launch/ file runs, launch/ leaves sys.path alone, requirements.txt's pins satisfy the declared
ranges, and a missing extra is one line naming it. ``.ci/run`` installs the package for real and runs it."""

import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT, SETUPTOOLS = PYPROJECT["project"], PYPROJECT["tool"]["setuptools"]
COMMANDS = ("train", "finetune", "convert", "generate", "plan", "preprocess", "benchmark")


def _config_folders() -> dict[str, Path]:
    """Package name -> folder, for configs/ (installed as zoo.configs) and each folder in it."""
    folders = [ROOT / "configs", *(p for p in (ROOT / "configs").rglob("*") if p.is_dir() and p.name != "__pycache__")]
    return {".".join(["zoo", "configs", *p.relative_to(ROOT / "configs").parts]): p for p in folders}


def test_every_package_and_config_folder_is_installed():
    code = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "zoo").rglob("__init__.py")}
    configs = _config_folders()
    missing = (code | set(configs)) ^ set(SETUPTOOLS["packages"])
    assert not missing, f"pyproject.toml [tool.setuptools] packages must list exactly zoo's packages and configs' " \
                        f"folders; differs in {sorted(missing)}"
    for name, folder in configs.items():
        patterns = SETUPTOOLS["package-data"].get(name, [])
        left = [p.name for p in folder.iterdir() if p.is_file() and not any(fnmatch(p.name, pat) for pat in patterns)]
        assert not left, f"configs files not installed (pyproject.toml package-data {name!r}): {left}"


def test_console_scripts_run_what_launch_runs():
    import zoo.cli

    scripts = PROJECT["scripts"]
    assert set(scripts) == {f"zoo-{name}" for name in COMMANDS}
    for script, target in scripts.items():
        module, name = target.split(":")
        assert module == "zoo.cli" and callable(getattr(zoo.cli, name)), target
        launch = (ROOT / "launch" / f"{script.removeprefix('zoo-')}.py").read_text()
        assert f"from zoo.cli import {name}\n" in launch and f"sys.exit({name}())" in launch, script


def test_launch_scripts_leave_sys_path_alone():
    edits = [p.name for p in sorted((ROOT / "launch").glob("*.py")) if "sys.path" in p.read_text()]
    assert not edits, f"launch scripts import the installed zoo (pip install -e .), not their own path: {edits}"


def test_the_pinned_set_satisfies_the_declared_ranges():
    """Every pin of requirements.txt (the tested set) is declared, within its range, whose floor is the pin's
    major.minor; a declared package requirements.txt does not pin has no floor (nothing tested one)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = Version(next(iter(req.specifier)).version)
    extras = [r for group in PROJECT["optional-dependencies"].values() for r in group]
    declared = [Requirement(r) for r in PROJECT["dependencies"] + extras]
    assert set(pins) <= {canonicalize_name(r.name) for r in declared}
    for req in declared:
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            assert not req.specifier, f"{req}: requirements.txt pins no version of it, so no floor was tested"
            continue
        assert req.specifier.contains(pin), f"{req} refuses the tested {pin}"
        floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert floors == [Version(".".join(map(str, pin.release[:2])))], f"{req}: floor other than {pin}'s major.minor"


def test_default_configs_come_from_the_checkout_or_the_installed_package(tmp_path, monkeypatch):
    from zoo import package

    assert package.config_file("gpt/main.yaml") == ROOT / "configs/gpt/main.yaml"  # a checkout
    installed = tmp_path / "site-packages" / "zoo"
    (installed / "configs" / "gpt").mkdir(parents=True)
    (installed / "configs" / "gpt" / "main.yaml").write_text("model: {}\n")
    monkeypatch.setattr(package, "PACKAGE", installed)
    assert package.config_file("gpt/main.yaml") == installed / "configs/gpt/main.yaml"


def test_a_missing_extra_is_one_line_naming_it(monkeypatch, capsys):
    from zoo.cli import _run
    from zoo.package import EXTRAS, MissingExtra, require

    for module, extra in EXTRAS.items():
        assert any(r.split(">=")[0] == module for r in PROJECT["optional-dependencies"][extra]), (module, extra)
    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers now fails as if it were not installed
    line = ("diffusers is not installed: pip install 'zoo[diffusion]' (or pip install -r requirements.txt, "
            "which pins it)")
    with pytest.raises(MissingExtra) as raised:
        require("diffusers")
    assert str(raised.value) == line
    assert _run(lambda: require("diffusers")) == 2  # a command ends with the line, no traceback
    assert capsys.readouterr().err.splitlines() == [f"error: {line}"]
