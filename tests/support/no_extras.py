"""A Python without tputrain's tracking and tuning extras, in a venv that has them.

`install()` puts a meta-path finder first that refuses `mlflow`, `wandb` and `optuna`
(and their submodules) with ImportError, as a fresh `pip install tputrain` would,
and appends each refused name to the file `$TPUTRAIN_TEST_REFUSED` at once (a
process that ends by `os._exit` keeps the record): a test reads from it whether
anything even tried to import one.

    python -m no_extras MODULE [ARGS...]    # `python -m MODULE ARGS...` without the extras
"""

from __future__ import annotations

import importlib.abc
import os
import runpy
import sys

EXTRAS = ("mlflow", "wandb", "optuna")
REFUSED_FILE = "TPUTRAIN_TEST_REFUSED"


class RefuseExtras(importlib.abc.MetaPathFinder):
    """Finds nothing: raises ImportError for the extras' packages, as if not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in EXTRAS:
            return None  # the next finder's business
        record = os.environ.get(REFUSED_FILE)
        if record:
            with open(record, "a", encoding="utf-8") as f:
                f.write(name + "\n")
        raise ModuleNotFoundError(f"No module named {name!r} (tests/support/no_extras.py)",
                                  name=name)


def install() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in EXTRAS:
            raise RuntimeError(f"{name} was imported before no_extras.install()")
    sys.meta_path.insert(0, RefuseExtras())


def refused(path) -> list[str]:
    """The names refused in the process that wrote `path` (none: [])."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().split()
    except FileNotFoundError:
        return []


if __name__ == "__main__":
    install()
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
