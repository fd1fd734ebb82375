"""Static checks on the package's shape (issue 53, "objects with narrow faces"):
no import cycle, lazy and `TYPE_CHECKING` imports included; only the Trainer's own
module and the CLI take a `Trainer`; no class forwards attribute reads to another
object through `__getattr__`.

Run as a script, it prints the measures: the import arrows in cycles and the
modules importing `tputrain.trainer`.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tputrain"
# The modules that build or drive a Trainer: the front door and the command line.
TRAINER_OWNERS = ("trainer.py", "cli/")
# Modules that import the Trainer class to build, subclass or register one, but take
# none (their functions take a `RunView` or an action's context); each still to
# move beside the Trainer or into the CLI when the package is grouped into wings.
BUILD_A_TRAINER = {
    "jobs/batch_finder.py": "find_batch builds one Trainer per batch it tries",
    "keras_fit.py": "tputrain.fit builds the Trainer of a Keras model",
    "jobs/sidecar.py": "ReadOnlyTrainer is a Trainer",
    "config/registry.py": "the gin registry registers the Trainer",
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    modules = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    # configs/ ships as the package `tputrain.configs` (pyproject.toml): a leaf.
    return {**modules, "tputrain.configs": PACKAGE.parent / "configs" / "__init__.py"}


def _lazy_exports(tree: ast.Module) -> set[str]:
    """The modules a package's PEP 562 `__getattr__` imports by name (`_EXPORTS`)."""
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            found |= {value.value for value in node.value.values
                      if isinstance(value, ast.Constant) and isinstance(value.value, str)
                      and value.value.startswith("tputrain")}
    return found


def _is_script_block(node: ast.AST) -> bool:
    """`if __name__ == "__main__":`: run as a script, the module is `__main__`, not the
    package's module, so what it imports there closes no cycle (`python -m`)."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"')


def _nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` except those of a script block."""
    found, pending = [], [tree]
    while pending:
        node = pending.pop()
        found.append(node)
        pending += [child for child in ast.iter_child_nodes(node) if not _is_script_block(child)]
    return found


def imports_of(name: str, source: str, known: set[str]) -> set[str]:
    """The package modules `source` imports anywhere: at the top, inside functions and
    under `if TYPE_CHECKING:` (each is an arrow a reader follows)."""
    tree = ast.parse(source)
    found = _lazy_exports(tree) if name == "tputrain" else set()
    for node in _nodes(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                anchor = name.split(".")[:len(name.split(".")) - node.level + (
                    1 if _is_package(name, known) else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {target for target in found if target in known and target != name}


def _is_package(name: str, known: set[str]) -> bool:
    return any(other.startswith(name + ".") for other in known)


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: imports_of(name, path.read_text(), known) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module (each holds a cycle): the
    measuring tool's own (`tools/import_graph.py`), so both count cycles alike."""
    from docgen_loader import load_tool  # tests/support: on the path under pytest and as a script

    return load_tool("import_graph").cycles(graph)


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first)."""
    members, start = set(component), component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *path[::-1][1:], start]
                if target not in parents:
                    parents[target] = node
                    following.append(target)
        frontier = following
    return component


def arrows_in_cycles(graph: dict[str, set[str]]) -> int:
    return sum(len(graph[node] & set(component))
               for component in strongly_connected(graph) for node in component)


def test_no_import_cycle_among_package_modules():
    graph = import_graph()
    cycles = [" -> ".join(a_cycle(graph, component))
              for component in strongly_connected(graph)]
    assert cycles == [], f"{arrows_in_cycles(graph)} import arrows in cycles; e.g. {cycles}"


def test_the_cycle_check_sees_a_lazy_and_a_type_checking_import():
    known = {"tputrain", "tputrain.a", "tputrain.b", "tputrain.c"}
    graph = {"tputrain": set(),
             "tputrain.a": imports_of("tputrain.a", "def f():\n    import tputrain.b\n", known),
             "tputrain.b": imports_of("tputrain.b", "from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from tputrain.c import C\n", known),
             "tputrain.c": imports_of("tputrain.c", "from tputrain import a\n", known)}
    assert strongly_connected(graph) == [["tputrain.a", "tputrain.b", "tputrain.c"]]
    assert a_cycle(graph, ["tputrain.a", "tputrain.b", "tputrain.c"]) == [
        "tputrain.a", "tputrain.b", "tputrain.c", "tputrain.a"]
    assert arrows_in_cycles(graph) == 3
    # `import tputrain` reaches the package, whose lazy exports import the rest.
    init = "_EXPORTS = {'A': 'tputrain.a'}\ndef __getattr__(name): ...\n"
    assert imports_of("tputrain", init, known) == {"tputrain.a"}
    assert imports_of("tputrain.a", "import tputrain\n", known) == {"tputrain"}
    # What `python -m tputrain.a` runs imports from `__main__`, not from tputrain.a.
    script = "if __name__ == '__main__':\n    from tputrain.b import main\n"
    assert imports_of("tputrain.a", script, known) == set()


def _outside_trainer_owners() -> list[tuple[str, str]]:
    return [(str(path.relative_to(PACKAGE).as_posix()), path.read_text())
            for path in sorted(PACKAGE.rglob("*.py"))
            if not path.relative_to(PACKAGE).as_posix().startswith(TRAINER_OWNERS)]


def takes_a_trainer(source: str) -> list[str]:
    """Parameters annotated `Trainer` (or a type of it), and imports of `tputrain.trainer`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for argument in arguments:
                text = ast.unparse(argument.annotation) if argument.annotation else ""
                if re.search(r"\bTrainer\b", text) and not text.startswith("Callable["):
                    found.append(f"{node.name}({argument.arg}: {text})")
        elif isinstance(node, ast.ImportFrom) and node.module == "tputrain.trainer":
            found.append("from tputrain.trainer import ...")
        elif isinstance(node, ast.ImportFrom) and node.module == "tputrain" and any(
                alias.name == "trainer" for alias in node.names):
            found.append("from tputrain import trainer")
        elif isinstance(node, ast.Import) and any(alias.name == "tputrain.trainer"
                                                  for alias in node.names):
            found.append("import tputrain.trainer")
    return found


def test_only_the_trainer_and_the_cli_take_a_trainer():
    """Jobs (predict, side-car, export, diagnose...) take a `RunView`, actions a context."""
    found = {name: [where for where in takes_a_trainer(source) if "import" not in where]
             for name, source in _outside_trainer_owners()}
    assert {name: where for name, where in found.items() if where} == {}


def test_only_the_trainer_the_cli_and_its_builders_import_the_trainer():
    found = {name for name, source in _outside_trainer_owners()
             if any("import" in where for where in takes_a_trainer(source))}
    assert found == set(BUILD_A_TRAINER)


def test_the_trainer_check_sees_an_annotation_and_an_import():
    source = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from tputrain.trainer import Trainer\n"
              "def f(trainer: 'Trainer', x: int) -> None: ...\n"
              "def g(*, owner: type[Trainer]) -> None: ...\n")
    assert sorted(takes_a_trainer(source)) == [
        "f(trainer: 'Trainer')", "from tputrain.trainer import ...", "g(owner: type[Trainer])"]
    assert takes_a_trainer("def f(view: RunView, o: TrainerOptions) -> None: ...\n") == []


def forwarding_classes(source: str) -> list[str]:
    """Classes defining `__getattr__`: a read that neither a reader nor an IDE can follow."""
    return [node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)
            for item in node.body if isinstance(item, ast.FunctionDef)
            and item.name == "__getattr__"]


def test_no_class_defines_getattr():
    """A module's own PEP 562 `__getattr__` (the package's lazy API, an alias of a
    moved module) is not a class's and is allowed."""
    found = {str(path.relative_to(PACKAGE)): forwarding_classes(path.read_text())
             for path in sorted(PACKAGE.rglob("*.py"))}
    assert {name: classes for name, classes in found.items() if classes} == {}


def test_the_getattr_check_sees_a_class_and_allows_a_module():
    source = ("def __getattr__(name): ...\n"
              "class Proxy:\n    def __getattr__(self, name):\n        return 1\n")
    assert forwarding_classes(source) == ["Proxy"]


def measures() -> dict[str, object]:
    graph = import_graph()
    components = strongly_connected(graph)
    trainer_importers = sorted(name for name, targets in graph.items()
                               if "tputrain.trainer" in targets)
    return {"modules": len(graph), "arrows": sum(map(len, graph.values())),
            "arrows_in_cycles": arrows_in_cycles(graph),
            "cycles": [len(component) for component in components],
            "modules_importing_trainer": trainer_importers,
            "take_a_trainer": {name: where for name, source in _outside_trainer_owners()
                               if (where := takes_a_trainer(source))}}


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "support"))
    for key, value in measures().items():
        print(f"{key}: {value}", file=sys.stdout)
