"""The package's import graph and its measures (issue 53), from the tree or a commit.

    python tools/import_graph.py                  # the working tree
    python tools/import_graph.py --rev 8586c7e    # any commit, read through git
    python tools/import_graph.py --json           # the measures as one JSON object
    python tools/import_graph.py --up             # list each arrow that runs up

Every import counts: at the top of a module, inside a function, under
`if TYPE_CHECKING:`, and the modules a package's lazy `_EXPORTS` table names (all
are arrows a reader follows); what runs only under `if __name__ == "__main__":` does
not. The measures:

- files and folders at each level of `tputrain/` (level 0: directly in it);
- rooms: each module directly in `tputrain/` and each folder in it (a wing) is one
  room; the room graph has an arrow A -> B when a module of A imports one of B;
- cycles: the room graph's strongly connected parts of more than one room;
- arrows back up: the fewest room arrows whose removal leaves no cycle (found exactly
  for a part of up to 16 rooms, by the greedy order and local moves above that);
  the layers are the longest import chains of what is left (a room that imports no
  other sits on layer 1);
- arrows up the wings: module imports that point up the order of the wings in
  `docs/architecture.md`'s picture (`WING_ORDER`, top first), the measure that file
  quotes.

A developer tool kept out of the package (it reads the package's source, imports
nothing of it); `tests/test_import_graph.py` checks its counting on small graphs and
holds the package's arrows up the wings at their number.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import pathlib
import subprocess
import sys
from typing import Iterable

REPO_DIR = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "tputrain"
# docs/architecture.md's picture, top to bottom: a wing imports only wings below it.
# "" is the front door (the modules directly in tputrain/); the edges (cli, config,
# tuning, tracking) come next, then each wing.
WING_ORDER = ("", "cli", "config", "tuning", "tracking", "jobs", "serving", "actions",
              "runtime", "tasks", "precision", "loop", "data", "distribution",
              "fault_tolerance", "optim", "observe", "checkpointing", "core")
EXACT_UP_TO = 16
# Modules of the package that live outside tputrain/: configs/ ships as `tputrain.configs`
# (pyproject.toml), a leaf (else `from tputrain import configs` would read as the package).
OUTSIDE = ("tputrain.configs",)

Graph = dict[str, set[str]]


def read_tree(rev: str | None) -> dict[str, str]:
    """Path under the repository (`tputrain/...py`) -> source, from the tree or a commit."""
    if rev is None:
        return {path.relative_to(REPO_DIR).as_posix(): path.read_text()
                for path in sorted((REPO_DIR / PACKAGE).rglob("*.py"))}
    names = subprocess.run(["git", "-C", str(REPO_DIR), "ls-tree", "-r", "--name-only", rev,
                            PACKAGE], capture_output=True, text=True, check=True).stdout.split()
    return {name: subprocess.run(["git", "-C", str(REPO_DIR), "show", f"{rev}:{name}"],
                                 capture_output=True, text=True, check=True).stdout
            for name in names if name.endswith(".py")}


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_script_block(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"')


def _walk(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node but those of a script block."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        pending += [child for child in ast.iter_child_nodes(node) if not _is_script_block(child)]


def _named_modules(tree: ast.Module) -> set[str]:
    """Module paths a package's top-level dict of strings names (a lazy `_EXPORTS`)."""
    return {value.value for node in tree.body
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)
            for value in node.value.values
            if isinstance(value, ast.Constant) and isinstance(value.value, str)
            and value.value.startswith(PACKAGE + ".")}


def imports_of(name: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """The package modules `source` (module `name`) imports, anywhere in it."""
    tree = ast.parse(source)
    found = _named_modules(tree) if is_package else set()
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                      for alias in node.names}
    return {target for target in found if target in known and target != name}


def module_graph(tree: dict[str, str]) -> Graph:
    names = {module_name(path): path for path in tree}
    packages = {module_name(path) for path in tree if path.endswith("/__init__.py")}
    known = set(names) | set(OUTSIDE)
    graph = {name: imports_of(name, tree[path], known, name in packages)
             for name, path in names.items()}
    return {name: targets - set(OUTSIDE) for name, targets in graph.items()}


def room_of(module: str) -> str:
    """`tputrain.loop.step` -> `loop`; `tputrain.trainer` -> `trainer.py`; the package's
    own `__init__` -> `__init__.py`."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    return parts[0] if len(parts) > 1 else parts[0] + ".py"


def room_names(modules: Graph, tree: dict[str, str]) -> dict[str, str]:
    """Module -> its room (a folder's own `__init__` is the folder's room)."""
    folders = {path.split("/")[1] for path in tree if path.count("/") >= 2}
    return {module: (room.removesuffix(".py") if room.removesuffix(".py") in folders else room)
            for module in modules for room in [room_of(module)]}


def room_graph(modules: Graph, tree: dict[str, str]) -> Graph:
    room = room_names(modules, tree)
    rooms: Graph = {name: set() for name in room.values()}
    for module, targets in modules.items():
        rooms[room[module]] |= {room[target] for target in targets} - {room[module]}
    return rooms


def arrows_between(modules: Graph, tree: dict[str, str], source: str,
                   target: str) -> list[tuple[str, str]]:
    """The module imports behind the room arrow `source` -> `target`."""
    room = room_names(modules, tree)
    return sorted((a, b) for a in modules for b in modules[a]
                  if room[a] == source and room[b] == target)


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components, every one (singletons too), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    components.append(sorted(component))
    return components


def cycles(graph: Graph) -> list[list[str]]:
    return [part for part in strongly_connected(graph) if len(part) > 1]


def _back(order: list[str], graph: Graph) -> int:
    """Arrows from a room to one earlier in `order` (an order lists importers first)."""
    place = {node: i for i, node in enumerate(order)}
    return sum(1 for node in order for target in graph[node]
               if target in place and place[target] < place[node])


def _exact_order(part: list[str], graph: Graph) -> list[str]:
    """The order of `part` with the fewest arrows back, by dynamic programming on subsets
    (best[S]: the fewest back arrows when the rooms of S come first, in some order)."""
    n = len(part)
    place = {node: i for i, node in enumerate(part)}
    out = [sum(1 << place[target] for target in graph[node] if target in place) for node in part]
    best: dict[int, tuple[int, int]] = {0: (0, -1)}
    for subset in range(1 << n):  # every subset after its own subsets
        if subset not in best:
            continue
        cost = best[subset][0]
        for i in range(n):
            if subset >> i & 1:
                continue
            grown, added = subset | 1 << i, bin(out[i] & subset).count("1")
            if grown not in best or best[grown][0] > cost + added:
                best[grown] = (cost + added, i)
    order, subset = [], (1 << n) - 1
    while subset:
        i = best[subset][1]
        order.append(part[i])
        subset &= ~(1 << i)
    return order[::-1]


def _greedy_order(part: list[str], graph: Graph) -> list[str]:
    """Eades, Lin and Smyth's order (sources first, sinks last, else the room with the
    most arrows out less arrows in), then single rooms moved while that removes an
    arrow back."""
    left, front, back = set(part), [], []
    while left:
        sinks = [n for n in sorted(left) if not graph[n] & left]
        sources = [n for n in sorted(left) if not any(n in graph[m] for m in left)]
        if sinks or sources:
            back[:0] = sinks
            front += [n for n in sources if n not in sinks]
            left -= set(sinks) | set(sources)
            continue
        node = max(sorted(left), key=lambda n: len(graph[n] & left)
                   - sum(n in graph[m] for m in left))
        front.append(node)
        left.discard(node)
    order = front + back
    improved = True
    while improved:
        improved = False
        for node in list(order):
            rest = [n for n in order if n != node]
            candidates = [rest[:i] + [node] + rest[i:] for i in range(len(rest) + 1)]
            better = min(candidates, key=lambda o: _back(o, graph))
            if _back(better, graph) < _back(order, graph):
                order, improved = better, True
    return order


def layered(graph: Graph) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """The arrows back up (fewest, per cycle) and each room's layer once they are left
    out (1: imports no other room; else one above the highest room it imports)."""
    back: list[tuple[str, str]] = []
    for part in cycles(graph):
        order = (_exact_order if len(part) <= EXACT_UP_TO else _greedy_order)(part, graph)
        place = {node: i for i, node in enumerate(order)}
        back += [(node, target) for node in order for target in sorted(graph[node])
                 if target in place and place[target] < place[node]]
    kept = {node: graph[node] - {target for source, target in back if source == node}
            for node in graph}
    layer: dict[str, int] = {}
    for part in strongly_connected(kept):  # Tarjan gives the imported before the importer
        (node,) = part
        layer[node] = 1 + max((layer[target] for target in kept[node]), default=0)
    return sorted(back), layer


def wing_of(module: str) -> str:
    """A module's wing; `_compat` (old paths, importing nothing of tputrain) is core's."""
    parts = module.split(".")[1:]
    if parts == ["_compat"]:
        return "core"
    return parts[0] if len(parts) > 1 or (parts and parts[0] in WING_ORDER[1:]) else ""


def arrows_up_the_wings(modules: Graph) -> list[tuple[str, str]]:
    """Module imports from a wing to one above it in `WING_ORDER`."""
    rank = {wing: i for i, wing in enumerate(WING_ORDER)}
    return sorted((source, target) for source, targets in modules.items() for target in targets
                  if rank.get(wing_of(target), 0) < rank.get(wing_of(source), 0))


def levels(tree: dict[str, str]) -> list[tuple[int, int]]:
    """(files, folders) at each level of the package (0: directly in it)."""
    files: dict[int, int] = {}
    folders: dict[int, set[str]] = {}
    for path in tree:
        parts = path.split("/")[1:]
        files[len(parts) - 1] = files.get(len(parts) - 1, 0) + 1
        for depth in range(len(parts) - 1):
            folders.setdefault(depth, set()).add("/".join(parts[:depth + 1]))
    depth = max(files) + 1
    return [(files.get(d, 0), len(folders.get(d, ()))) for d in range(depth)]


def measures(rev: str | None = None) -> dict[str, object]:
    tree = read_tree(rev)
    modules = module_graph(tree)
    rooms = room_graph(modules, tree)
    back, layer = layered(rooms)
    module_cycles = cycles(modules)
    up = arrows_up_the_wings(modules)
    return {
        "rev": rev or "working tree",
        "levels": [{"level": i, "files": f, "folders": d} for i, (f, d) in enumerate(levels(tree))],
        "modules": len(modules), "module_arrows": sum(map(len, modules.values())),
        "rooms": len(rooms), "room_arrows": sum(map(len, rooms.values())),
        "layers": max(layer.values()),
        "room_cycles": [len(part) for part in cycles(rooms)],
        "room_arrows_back_up": [f"{a} -> {b}" for a, b in back],
        "module_cycles": [len(part) for part in module_cycles],
        "module_arrows_in_cycles": sum(len(modules[m] & set(p)) for p in module_cycles for m in p),
        "arrows_up_the_wings": len(up),
        "arrows_up_the_wings_by_target": _count(target for _, target in up),
        "up": [f"{a} -> {b}" for a, b in up],
    }


def _count(names: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a commit to read instead of the working tree")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--up", action="store_true", help="list the arrows up the wings")
    args = parser.parse_args(argv)
    found = measures(args.rev)
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    for key, value in found.items():
        if key != "up" or args.up:
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
