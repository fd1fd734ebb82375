"""Static check: rooms a newcomer can read: no function over 60 lines, no class
over 300 (issue 35's bar; a function's or class's lines include its docstring)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tputrain"
FUNCTION_LINES, CLASS_LINES = 60, 300


def _sizes(limit_of):
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = limit_of(node)
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                found.add(f"{path.relative_to(PACKAGE)}:{node.name}")
    return found


def _function_limit(node):
    return FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _class_limit(node):
    return CLASS_LINES if isinstance(node, ast.ClassDef) else None


def test_no_function_is_over_60_lines():
    assert _sizes(_function_limit) == set()


def test_no_class_is_over_300_lines():
    assert _sizes(_class_limit) == set()


def test_the_check_measures_lines():
    source = "class A:\n" + "    x = 1\n" * 300 + "def f():\n" + "    y = 1\n" * 60
    nodes = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(source))
             if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert nodes == {"A": 301, "f": 61}
