"""Packaging: the TensorFlow-free requirements list matches pyproject's dependencies."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _names(requirements):
    return {re.split(r"[<>=!~\[ ]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def test_requirements_core_is_pyproject_minus_tensorflow():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [l for l in (ROOT / "requirements-core.txt").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert sorted(lines) == sorted(d for d in project["dependencies"]
                                   if _names([d]) != {"tensorflow"})
    assert "tensorflow" in _names(project["dependencies"])


def test_builtin_configs_ship_in_the_package():
    import tputrain.configs  # the repository's configs/ folder, packaged

    shipped = {p.name for p in Path(tputrain.configs.__file__).parent.glob("*.gin")}
    assert {"digits.gin", "synthetic_transformer.gin"} <= shipped


def test_every_subpackage_ships_in_the_wheel():
    """A package missing from [tool.setuptools] packages installs broken (non-editable)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "tputrain").rglob("__init__.py") if "__pycache__" not in p.parts}
    assert on_disk <= listed, f"not packaged: {sorted(on_disk - listed)}"
