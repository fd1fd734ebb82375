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


def shared_fixture_users() -> dict[str, set[str]]:
    """fixture name -> `file.py::test` of every test taking a module- or session-scoped
    fixture (defined in its module or in conftest.py)."""
    def scoped(tree) -> set[str]:
        return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                for decorator in node.decorator_list if isinstance(decorator, ast.Call)
                for keyword in decorator.keywords if keyword.arg == "scope"
                and getattr(keyword.value, "value", None) in ("module", "session")}

    session = scoped(ast.parse((TESTS / "conftest.py").read_text()))
    users: dict[str, set[str]] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        fixtures = session | scoped(tree)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                for argument in node.args.args:
                    if argument.arg in fixtures:
                        users.setdefault(argument.arg, set()).add(f"{path.name}::{node.name}")
    return users


def test_every_user_of_a_shared_fixture_is_in_one_same_worker_group():
    """Otherwise each xdist worker computes the fixture again (minutes for some)."""
    from conftest import _group_of, same_worker_groups

    groups = same_worker_groups()
    users = shared_fixture_users()
    assert {"one_replica", "readme_digits", "best_reference"} <= set(users)
    for fixture, tests in users.items():
        assigned = {_group_of(f"tests/{test}[param]", groups) for test in tests}
        assert len(assigned) == 1 and not assigned.pop().startswith("tests/"), (fixture, tests)
