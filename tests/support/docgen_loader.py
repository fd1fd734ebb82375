"""tools/docgen.py (a script outside the package) for the tests that check the docs."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_docgen():
    """tools/docgen.py, a script outside the package, imported by its path."""
    module = sys.modules.get("docgen")
    if module is None:
        spec = importlib.util.spec_from_file_location("docgen", ROOT / "tools" / "docgen.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["docgen"] = module
        spec.loader.exec_module(module)
    return module
