"""Static checks on the package's files: one atomic-write helper, one model_dir layout.

A temp-file-then-rename written by hand drifts (five naming schemes, one a fixed
`path + ".tmp"` two writers collide on, fsync in some and not others), and a
model_dir path built by hand in eight modules leaves no one place that says what a
model_dir holds. These checks keep both in one module each.
"""

from __future__ import annotations

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tputrain"
ATOMIC = PACKAGE / "checkpointing" / "atomic.py"
RUN_DIRECTORY = PACKAGE / "checkpointing" / "run_directory.py"
LAYOUT_WORDS = ("checkpoints", "export", "best")
# A path part: no spaces, the word alone or between slashes ("checkpoints",
# "/export/", "best/best.json"); prose ("a model_dir/checkpoints folder") has spaces.
_PATH_PART = re.compile(rf"^(?:[^\s]*/)?(?:{'|'.join(LAYOUT_WORDS)})(?:/[^\s]*)?$")
_DIR_NAME = re.compile(r"(DIR|PATH|FOLDER|SUBDIR)", re.IGNORECASE)


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _renames(path: pathlib.Path) -> list[str]:
    """`os.replace(...)`, `os.rename(...)`, `*.gfile.rename(...)`, `shutil.move(...)` calls."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = ast.unparse(node.func)
        if name in ("os.replace", "os.rename", "shutil.move") or name.endswith("gfile.rename"):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}")
    return found


def test_every_rename_is_in_the_atomic_write_helper():
    """A writer calls `tputrain.write_atomically` / `atomic_path` (or `atomic.move`)."""
    assert [r for path in _modules() if path != ATOMIC for r in _renames(path)] == []


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _path_uses(tree: ast.AST) -> set[int]:
    """The string constants a path is built from: arguments of a `*.join(...)`, the
    parts of an f-string beside a "/", a value assigned to a `*_DIR`/`*PATH*` name."""
    uses: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("path.join", "Path")):
            uses.update(id(a) for a in node.args if isinstance(a, ast.Constant))
        elif isinstance(node, ast.JoinedStr):
            uses.update(id(v) for v in node.values
                        if isinstance(v, ast.Constant) and "/" in str(v.value))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            uses.update(id(v) for v in (node.left, node.right) if isinstance(v, ast.Constant))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_DIR_NAME.search(ast.unparse(t)) for t in targets):
                values = node.value.elts if isinstance(node.value, (ast.Tuple, ast.List)) \
                    else [node.value]
                uses.update(id(v) for v in values if isinstance(v, ast.Constant))
    return uses


def _layout_parts(source: str, label: str) -> list[str]:
    tree = ast.parse(source)
    skip, uses = _docstrings(tree), _path_uses(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in skip and id(node) in uses):
            parts = re.split(r"/", node.value.strip("/"))
            if any(part in LAYOUT_WORDS for part in parts) or (
                    "/" in node.value and _PATH_PART.match(node.value.strip())):
                found.append(f"{label}:{node.lineno}: {node.value!r}")
    return found


def test_the_model_dir_layout_is_named_only_by_run_directory():
    """`RunDirectory(model_dir).checkpoints` etc., not "checkpoints" joined by hand."""
    assert [p for path in _modules() if path != RUN_DIRECTORY
            for p in _layout_parts(path.read_text(), str(path.relative_to(PACKAGE.parent)))] == []


def test_the_layout_check_finds_what_it_looks_for():
    """The scan sees joins, f-strings and *_DIR constants, and skips prose and flags."""
    source = ('import os\nEXPORT_DIR = "export"\nos.path.join(d, "checkpoints")\n'
              'f"{d}/best/{x}"\nflags.DEFINE_bool("best", None, "x")\n'
              'raise ValueError("a model_dir/checkpoints folder")\n')
    found = _layout_parts(source, "sample")
    assert sorted(int(line.split(":")[1]) for line in found) == [2, 3, 4]
