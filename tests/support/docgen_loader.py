"""The scripts in tools/ (docgen.py, import_graph.py) for the tests that check them."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_tool(name: str):
    """tools/<name>.py, a script outside the package, imported by its path (once a process)."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def load_docgen():
    """tools/docgen.py, a script outside the package, imported by its path."""
    return load_tool("docgen")
