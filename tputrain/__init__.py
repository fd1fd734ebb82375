"""tputrain: a TPU-first training library for TensorFlow 2 / Keras 3.

The public API is re-exported here; everything else is an implementation detail.

Importing tputrain does not import TensorFlow (`tputrain --help` answers without
it), and changes nothing in gin: the first use of a public name loads the whole API
(PEP 562 `__getattr__`), registering every gin configurable
(`tputrain.config.registry`). To parse gin yourself, use `tputrain.config.parse_gin`
(what the CLI calls), or `import tputrain.config.registry` before gin's own
`parse_config_file` (docs/configuration.md). Whoever imports TensorFlow first
afterwards, it starts with its start-up noise filtered
(`tputrain.observe.console.filter_tensorflow_startup`).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from tputrain.runtime import process_start  # noqa: F401  first: goodput's start-up begins here
from tputrain import _compat  # noqa: E402  (imports no TensorFlow)

_compat.install()  # old module paths (tputrain.actions.best, ...) warn and name the moved module

# TensorFlow's C++ INFO lines drown the progress lines; users can still override.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from tputrain.loop import compile_cache  # noqa: E402  (imports no TensorFlow)
from tputrain.observe.console import filter_tensorflow_startup  # noqa: E402  (no TensorFlow)
from tputrain.runtime import process_exit  # noqa: E402  (imports no TensorFlow)

compile_cache.enable()  # before TensorFlow finds its devices, when it reads TF_XLA_FLAGS
filter_tensorflow_startup()  # before anything imports TensorFlow (docs/architecture.md)
process_exit.install()  # the process ends promptly after its last line

__version__ = "0.1.0"

# Public name -> the module defining it.
_EXPORTS = {
    "data": "tputrain.data",
    "Action": "tputrain.actions",
    "ActionContext": "tputrain.runtime.context",
    "RunPlan": "tputrain.runtime.plan",
    "show_progress": "tputrain.observe.console",
    "Controller": "tputrain.runtime.controller",
    "Checkpointer": "tputrain.checkpointing.manager",
    "CheckpointMismatchError": "tputrain.checkpointing.integrity",
    "NonFiniteError": "tputrain.fault_tolerance.guard",
    "NonFiniteGuard": "tputrain.fault_tolerance.guard",
    "ReplicaStateError": "tputrain.loop.replica_stats",
    "PREEMPTED_EXIT_CODE": "tputrain.fault_tolerance.preemption",
    "Preempted": "tputrain.fault_tolerance.preemption",
    "audit_precision": "tputrain.config.registry",  # gin-configured
    "LARS": "tputrain.optim.lars",
    "override_layer_dtypes": "tputrain.precision.layers",
    "build_optimizer": "tputrain.config.registry",  # gin-configured
    "WarmupDecay": "tputrain.optim.schedules",
    "scale_learning_rate": "tputrain.optim.schedules",
    "find_batch": "tputrain.jobs.batch_finder",
    "FindBatchResult": "tputrain.jobs.batch_report",
    "warmup_schedule": "tputrain.config.registry",  # gin-configured
    "set_precision_policy": "tputrain.config.registry",  # gin-configured
    "resolve_strategy": "tputrain.config.registry",  # gin-configured
    "split_cpu": "tputrain.config.registry",  # gin-configured
    "Task": "tputrain.task",
    "KerasTask": "tputrain.keras_task",
    "KerasCallbacks": "tputrain.actions.keras_callbacks",
    "fit": "tputrain.keras_fit",
    "Trainer": "tputrain.trainer",
    "TrainerOptions": "tputrain.options",
    "CheckpointOptions": "tputrain.options",
    "PrecisionOptions": "tputrain.options",
    "ProfilingOptions": "tputrain.options",
    "RematOptions": "tputrain.options",
    "CommunicationOptions": "tputrain.distribution.communication",
    "BestCheckpoint": "tputrain.actions.best",
    "EarlyStopping": "tputrain.actions.early_stopping",
    "Export": "tputrain.actions.export",
    "export_checkpoint": "tputrain.serving.export",
    "export_for_serving": "tputrain.serving.keras_saving",
    "InitCheckpoint": "tputrain.actions.init_checkpoint",
    "MLflowTracker": "tputrain.tracking",
    "WandbTracker": "tputrain.tracking",
    "NoNewCheckpointError": "tputrain.jobs.sidecar",
    "ReadOnlyTrainer": "tputrain.jobs.sidecar",
    "evaluate_checkpoints": "tputrain.jobs.sidecar",
    "averaged_weights": "tputrain.optim.ema",
    "write_atomically": "tputrain.checkpointing.atomic",
    "atomic_path": "tputrain.checkpointing.atomic",
    "RunDirectory": "tputrain.checkpointing.run_directory",
    "ExponentialAverage": "tputrain.optim.ema",
}

__all__ = list(_EXPORTS)


def _resolve(name: str) -> Any:
    module = importlib.import_module(_EXPORTS[name])
    value = module if _EXPORTS[name].endswith(f".{name}") else getattr(module, name)
    globals()[name] = value
    return value


def load_api() -> None:
    """Imports every public module and registers gin's configurables
    (`tputrain.config.registry`)."""
    for name in _EXPORTS:
        if name not in globals():
            _resolve(name)
    importlib.import_module("tputrain.config.registry")


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tputrain' has no attribute {name!r}")
    value = _resolve(name)  # its own module first: a module loading may ask for one name
    load_api()
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
