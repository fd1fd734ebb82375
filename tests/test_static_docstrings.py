"""Static check: no measured figure in a docstring (issue 35). Timings and speed-up
ratios go stale unseen there; they live in benchmarks/results and docs/performance.md
("Design measurements"), which the docstrings point to."""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tputrain"
# A sub-second timing with a decimal point ("0.41 ms") or a measured ratio ("1.22x").
# Not seconds: a limit a rule uses ("steps that take at most 0.25 s") is a setting.
MEASURED = re.compile(r"\b\d+\.\d+\s?(ms|µs|us|ns)\b|\b\d+\.\d+x\b")


def _measured_figures(source: str, name: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node) or ""
            for match in MEASURED.finditer(docstring):
                found.add(f"{name}:{getattr(node, 'name', '<module>')}: {match.group(0)}")
    return found


def test_no_docstring_holds_a_measured_figure():
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        found |= _measured_figures(path.read_text(), str(path.relative_to(PACKAGE)))
    assert found == set()


def test_the_check_sees_timings_and_ratios():
    source = ('"""Took 0.41 ms."""\n'
              'def f():\n    """1.22x less CPU time; 4.1 µs a draw."""\n'
              'def g():\n    """10 ms ticks of /proc/uptime; at most 0.25 s; 6 x."""\n')
    assert _measured_figures(source, "m") == {"m:<module>: 0.41 ms", "m:f: 1.22x",
                                              "m:f: 4.1 µs"}
