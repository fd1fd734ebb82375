"""Static checks on the package's layout (issue 53, "wings by role"): few modules at
the top, and nothing inside the package imports a module by its old path (those are
for users' code, which they warn: `tputrain/_compat.py`)."""

from __future__ import annotations

import ast
import pathlib

from tputrain import _compat

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tputrain"
# The front door (task, trainer, options, Keras) and the entry points; the rest sits in
# a wing whose `__init__.py` docstring maps it.
MAX_TOP_LEVEL = 12


def test_at_most_twelve_modules_sit_directly_in_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "_compat.py")
    assert len(top) <= MAX_TOP_LEVEL, (
        f"{len(top)} modules directly in tputrain/ ({', '.join(top)}): put a new module in "
        "the wing of its role (docs/architecture.md)")


def test_every_wing_has_a_docstring_that_maps_it():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(PACKAGE.parent)}: say what the wing holds"


def _imported_names(tree: ast.Module) -> list[tuple[int, str]]:
    """Every module path an import names (`from tputrain import x` names `tputrain.x`)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module))
            names += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return names


def test_no_package_module_imports_an_old_module_path():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for line, name in _imported_names(ast.parse(path.read_text())):
            if name in _compat.MOVED:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}: "
                             f"import {_compat.MOVED[name]}")
    assert not found, "\n".join(found)
