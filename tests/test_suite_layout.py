"""The suite's own layout: shared helpers live in support modules, not in test modules.

A test module that imports another runs (and collects) that module's tests' set-up
in a process that did not ask for it, and ties two files that should change alone.
"""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module `path` imports, at any depth (including the
    scripts it embeds as strings, which child processes run with tests/ on the path)."""
    names = set()
    sources = [path.read_text()]
    for node in ast.walk(ast.parse(sources[0])):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                sources.append(node.value)
                ast.parse(node.value)
            except SyntaxError:
                sources.pop()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_another():
    offenders = {path.name: sorted(name for name in imported_modules(path)
                                   if name.startswith("test_"))
                 for path in sorted(TESTS.glob("*.py"))}
    assert {name: found for name, found in offenders.items() if found} == {}
