"""Old module paths of moved modules: one table, one import hook.

Modules moved into wings by role (issues 35 and 53), and from one wing to another
(an old path maps to the module's place now, never to another old path). An old path keeps working until
the release named in `REMOVED_IN`: importing it warns with a `DeprecationWarning` that
names the new place, and gives the very module object of the new path
(`sys.modules[old] is sys.modules[new]`), so a monkeypatch through either name patches
the one module. `python -m <old>` runs the new module. `tputrain/__init__.py` installs
the hook (`install`); this module imports nothing of TensorFlow.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType
from typing import Any, Sequence

REMOVED_IN = "0.3"

# Old module path -> its module now.
MOVED = {
    # issue 35
    "tputrain.allreduce": "tputrain.distribution.allreduce",
    "tputrain.audit": "tputrain.precision.audit",
    "tputrain.checkpoint": "tputrain.checkpointing",
    "tputrain.cluster": "tputrain.distribution.cluster",
    "tputrain.communication": "tputrain.distribution.communication",
    "tputrain.launch": "tputrain.distribution.launch",
    "tputrain.layer_precision": "tputrain.precision.layers",
    "tputrain.strategy": "tputrain.distribution.strategy",
    # issue 53
    "tputrain.advice": "tputrain.jobs.advice",
    "tputrain.aggregation": "tputrain.jobs.aggregation",
    "tputrain.batch_finder": "tputrain.jobs.batch_finder",
    "tputrain.batch_report": "tputrain.jobs.batch_report",
    "tputrain.best": "tputrain.actions.best",
    "tputrain.builders": "tputrain.core.builders",
    "tputrain.checks": "tputrain.core.checks",
    "tputrain.compile_cache": "tputrain.loop.compile_cache",
    "tputrain.config_summary": "tputrain.actions.config_summary",
    "tputrain.configurables": "tputrain.config.registry",
    "tputrain.console": "tputrain.observe.console",
    "tputrain.context": "tputrain.runtime.context",
    "tputrain.controller": "tputrain.runtime.controller",
    "tputrain.diagnose": "tputrain.jobs.diagnose",
    "tputrain.ema": "tputrain.optim.ema",
    "tputrain.eval_events": "tputrain.observe.eval_events",
    "tputrain.export": "tputrain.serving.export",
    "tputrain.flops": "tputrain.observe.flops",
    "tputrain.gcs": "tputrain.runtime.gcs",
    "tputrain.goodput": "tputrain.observe.goodput",
    "tputrain.guard": "tputrain.fault_tolerance.guard",
    "tputrain.init_checkpoint": "tputrain.actions.init_checkpoint",
    "tputrain.input_layout": "tputrain.checkpointing.input_layout",
    "tputrain.keras_callback_state": "tputrain.actions.keras_callback_state",
    "tputrain.keras_callbacks": "tputrain.actions.keras_callbacks",
    "tputrain.keras_clone": "tputrain.runtime.keras_clone",
    "tputrain.keras_saving": "tputrain.serving.keras_saving",
    "tputrain.lars": "tputrain.optim.lars",
    "tputrain.lock": "tputrain.fault_tolerance.lock",
    "tputrain.model_state": "tputrain.runtime.model_state",
    "tputrain.optimizers": "tputrain.optim.optimizers",
    "tputrain.plan": "tputrain.runtime.plan",
    "tputrain.predict": "tputrain.jobs.predict",
    "tputrain.preemption": "tputrain.fault_tolerance.preemption",
    "tputrain.preflight": "tputrain.runtime.preflight",
    "tputrain.process_exit": "tputrain.runtime.process_exit",
    "tputrain.process_start": "tputrain.runtime.process_start",
    "tputrain.progress": "tputrain.observe.progress",
    "tputrain.progress_bar": "tputrain.observe.progress_bar",
    "tputrain.remat": "tputrain.loop.remat",
    "tputrain.run_view": "tputrain.runtime.run_view",
    "tputrain.schedules": "tputrain.optim.schedules",
    "tputrain.sidecar": "tputrain.jobs.sidecar",
    "tputrain.tracing": "tputrain.core.tracing",
    "tputrain.trainable_change": "tputrain.runtime.trainable_change",
    "tputrain.validate": "tputrain.runtime.validate",
    "tputrain.vertex": "tputrain.jobs.vertex",
    "tputrain.write_tfrecords_cli": "tputrain.data.arrays",
    # issue 53, imports down the wings: shared helpers into the bottom wing
    "tputrain.config.builders": "tputrain.core.builders",
    "tputrain.loop.aggregation": "tputrain.jobs.aggregation",
    "tputrain.loop.tracing": "tputrain.core.tracing",
    "tputrain.runtime.checks": "tputrain.core.checks",
}


# Old place of a name that moved to another module (`module.name`) -> its module now.
# The old module's own `__getattr__` asks `moved_name`, so `from old import Name` works
# and warns, without the old module importing the new one (which imports it).
MOVED_NAMES = {
    # issue 53, one built-in action a module in actions/
    "tputrain.actions.best.EARLY_STOPPING_FILE": "tputrain.actions.early_stopping",
    "tputrain.actions.best.EarlyStopping": "tputrain.actions.early_stopping",
    "tputrain.actions.best.early_stopping_path": "tputrain.actions.early_stopping",
    "tputrain.serving.export.Export": "tputrain.actions.export",
}


def moved_name(module: str, name: str) -> Any:
    """`module.name` from where it lives now, with a `DeprecationWarning` naming it;
    an `AttributeError` for a name that never moved (a module's `__getattr__`)."""
    old = f"{module}.{name}"
    if old not in MOVED_NAMES:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{old} moved to {MOVED_NAMES[old]}.{name}; the old name will be removed "
                  f"in {REMOVED_IN}", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(MOVED_NAMES[old]), name)


def message(old: str) -> str:
    """What importing `old` warns."""
    return f"{old} moved to {MOVED[old]}; the old name will be removed in {REMOVED_IN}"


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the new module itself (and runs it for `python -m old`)."""

    def __init__(self, old: str) -> None:
        self.old = old
        self.new_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(message(self.old), DeprecationWarning, stacklevel=3)
        module = importlib.import_module(MOVED[self.old])
        self.new_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the new module ran when it was imported): the import system
        records it under the old name and gave it the old spec; give its own back."""
        module.__spec__ = self.new_spec

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for `python -m <old>` (runpy runs it as `__main__`)."""
        warnings.warn(message(self.old), DeprecationWarning, stacklevel=2)
        new = MOVED[self.old]
        spec = importlib.util.find_spec(new)
        return spec.loader.get_code(new)  # type: ignore[union-attr]

    def is_package(self, fullname: str) -> bool:
        return False


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of `MOVED` (and nothing else)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        # origin: the moved file, which `python -m <old>` shows as sys.argv[0]
        origin = importlib.util.find_spec(MOVED[fullname]).origin  # type: ignore[union-attr]
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname), origin=origin)


def install() -> None:
    """Puts the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
