"""The suite's own layout: shared helpers live in support modules (tests/support/), not
in test modules, and each test module sits in the folder of the module it tests.

A test module that imports another runs (and collects) that module's tests' set-up
in a process that did not ask for it, and ties two files that should change alone.
"""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "tputrain"
SUPPORT = TESTS / "support"

# The move into wings (issue 53): where each top-level module goes. While the move has
# not landed, `tputrain/<old>.py` still exists and the layout check reads it at its new
# place; once it has, no entry matches a file and the tree alone decides. None: an alias
# file the move deletes (its module already lives in a wing).
MOVED = {
    "advice": "jobs/advice", "aggregation": "jobs/aggregation", "batch_finder": "jobs/batch_finder",
    "batch_report": "jobs/batch_report", "best": "actions/best", "checks": "core/checks",
    "compile_cache": "loop/compile_cache", "config": "config/parsing",
    "config_summary": "actions/config_summary", "configurables": "config/registry",
    "console": "observe/console", "context": "runtime/context", "controller": "runtime/controller",
    "diagnose": "jobs/diagnose", "ema": "optim/ema", "eval_events": "observe/eval_events",
    "export": "serving/export", "flops": "observe/flops", "gcs": "runtime/gcs",
    "goodput": "observe/goodput", "guard": "fault_tolerance/guard",
    "init_checkpoint": "actions/init_checkpoint", "input_layout": "checkpointing/input_layout",
    "keras_callback_state": "actions/keras_callback_state",
    "keras_callbacks": "actions/keras_callbacks", "keras_saving": "serving/keras_saving",
    "lars": "optim/lars", "lock": "fault_tolerance/lock", "model_state": "runtime/model_state",
    "optimizers": "optim/optimizers", "plan": "runtime/plan", "predict": "jobs/predict",
    "preemption": "fault_tolerance/preemption", "preflight": "runtime/preflight",
    "process_exit": "runtime/process_exit", "process_start": "runtime/process_start",
    "progress": "observe/progress", "progress_bar": "observe/progress_bar", "remat": "loop/remat",
    "schedules": "optim/schedules", "sidecar": "jobs/sidecar", "tracing": "core/tracing",
    "validate": "runtime/validate", "vertex": "jobs/vertex", "write_tfrecords_cli": "data/arrays",
    **dict.fromkeys(["allreduce", "audit", "cluster", "communication", "launch",
                     "layer_precision", "strategy", "checkpoint"]),
}
# Test modules named after a package, not a module in it.
TESTED_PACKAGE = {"checkpoint": "checkpointing"}


def suite_modules() -> list[Path]:
    """Every `test_*.py` of the suite, in tests/ and its folders (not support/)."""
    return sorted(path for path in TESTS.rglob("test_*.py")
                  if SUPPORT not in path.parents and "__pycache__" not in path.parts)


def module_folders() -> dict[str, set[str]]:
    """module name -> the folders of tputrain holding `<name>.py` ("" for the top level),
    on the layout after the move into wings (`MOVED`), and every wing `w` as a module
    named `w` in folder `w` (the home of `test_<wing>.py`)."""
    folders: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        place = path.relative_to(PACKAGE).with_suffix("").as_posix()
        if "__pycache__" in place or path.name == "__init__.py":
            continue
        if "/" not in place and place in MOVED:
            if MOVED[place] is None:
                continue
            place = MOVED[place]
        folder, _, name = place.rpartition("/")
        folders.setdefault(name, set()).add(folder)
        if folder:
            folders.setdefault(folder.split("/")[0], set()).add(folder.split("/")[0])
    for name, package in TESTED_PACKAGE.items():
        folders.setdefault(name, set()).add(package)
    return folders


def test_every_test_module_sits_in_the_folder_of_the_module_it_tests():
    """`test_<name>.py` lives in `tests/<folder>/` where `tputrain/<folder>/<name>.py`
    exists (any of them if several do); a test of no single module in tests/ itself."""
    folders = module_folders()
    misplaced = {}
    for path in suite_modules():
        name = path.stem.removeprefix("test_")
        here = path.parent.relative_to(TESTS).as_posix().removeprefix(".")
        expected = folders.get(name, {""})
        if here not in expected:
            misplaced[path.relative_to(TESTS).as_posix()] = sorted(
                f"tests/{folder}/" if folder else "tests/" for folder in expected)
    assert misplaced == {}


def test_test_module_names_are_unique_and_folders_are_not_packages():
    """pytest's default (prepend) import mode imports each test module by its base name,
    and conftest's same_worker groups key on it; an __init__.py would change both."""
    names = [path.name for path in suite_modules()]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []
    assert sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("__init__.py")) == []


def test_support_modules_live_in_support():
    """Only test modules and conftest.py outside tests/support/."""
    stray = [path.relative_to(TESTS).as_posix() for path in TESTS.rglob("*.py")
             if SUPPORT not in path.parents and not path.name.startswith("test_")
             and path.name != "conftest.py" and "__pycache__" not in path.parts]
    assert stray == []


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
                 for path in sorted(TESTS.rglob("*.py")) if "__pycache__" not in path.parts}
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
    for path in suite_modules():
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
