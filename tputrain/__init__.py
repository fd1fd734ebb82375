"""tputrain: a TPU-first training library for TensorFlow 2 / Keras 3.

The public API is re-exported here; everything else is an implementation detail.

Importing tputrain does not import TensorFlow (`tputrain --help` answers without
it), and changes nothing in gin: the first use of a public name loads the whole API
(PEP 562 `__getattr__`), registering every gin configurable
(`tputrain.configurables`). To parse gin yourself, use `tputrain.config.parse_gin`
(what the CLI calls), or `import tputrain.configurables` before gin's own
`parse_config_file` (docs/configuration.md). Whoever imports TensorFlow first
afterwards, it starts with its start-up noise filtered
(`tputrain.console.filter_tensorflow_startup`).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from tputrain import process_start  # noqa: F401  first: goodput's start-up begins here

# TensorFlow's C++ INFO lines drown the progress lines; users can still override.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from tputrain import compile_cache  # noqa: E402  (imports no TensorFlow)
from tputrain.console import filter_tensorflow_startup  # noqa: E402  (imports no TensorFlow)
from tputrain import process_exit  # noqa: E402  (imports no TensorFlow)

compile_cache.enable()  # before TensorFlow finds its devices, when it reads TF_XLA_FLAGS
filter_tensorflow_startup()  # before anything imports TensorFlow (docs/architecture.md)
process_exit.install()  # the process ends promptly after its last line

__version__ = "0.1.0"

# Public name -> the module defining it.
_EXPORTS = {
    "data": "tputrain.data",
    "Action": "tputrain.actions",
    "ActionContext": "tputrain.context",
    "RunPlan": "tputrain.plan",
    "show_progress": "tputrain.console",
    "Controller": "tputrain.controller",
    "Checkpointer": "tputrain.checkpointing.manager",
    "CheckpointMismatchError": "tputrain.checkpointing.integrity",
    "NonFiniteError": "tputrain.guard",
    "NonFiniteGuard": "tputrain.guard",
    "ReplicaStateError": "tputrain.loop.replica_stats",
    "PREEMPTED_EXIT_CODE": "tputrain.preemption",
    "Preempted": "tputrain.preemption",
    "audit_precision": "tputrain.configurables",  # gin-configured
    "LARS": "tputrain.lars",
    "override_layer_dtypes": "tputrain.precision.layers",
    "build_optimizer": "tputrain.configurables",  # gin-configured
    "WarmupDecay": "tputrain.schedules",
    "scale_learning_rate": "tputrain.schedules",
    "find_batch": "tputrain.batch_finder",
    "FindBatchResult": "tputrain.batch_report",
    "warmup_schedule": "tputrain.configurables",  # gin-configured
    "set_precision_policy": "tputrain.configurables",  # gin-configured
    "resolve_strategy": "tputrain.configurables",  # gin-configured
    "split_cpu": "tputrain.configurables",  # gin-configured
    "Task": "tputrain.task",
    "KerasTask": "tputrain.keras_task",
    "KerasCallbacks": "tputrain.keras_callbacks",
    "fit": "tputrain.keras_fit",
    "Trainer": "tputrain.trainer",
    "TrainerOptions": "tputrain.options",
    "CheckpointOptions": "tputrain.options",
    "PrecisionOptions": "tputrain.options",
    "ProfilingOptions": "tputrain.options",
    "RematOptions": "tputrain.options",
    "CommunicationOptions": "tputrain.distribution.communication",
    "BestCheckpoint": "tputrain.best",
    "EarlyStopping": "tputrain.best",
    "Export": "tputrain.export",
    "export_checkpoint": "tputrain.export",
    "export_for_serving": "tputrain.keras_saving",
    "InitCheckpoint": "tputrain.init_checkpoint",
    "MLflowTracker": "tputrain.tracking",
    "WandbTracker": "tputrain.tracking",
    "NoNewCheckpointError": "tputrain.sidecar",
    "ReadOnlyTrainer": "tputrain.sidecar",
    "evaluate_checkpoints": "tputrain.sidecar",
    "averaged_weights": "tputrain.ema",
    "write_atomically": "tputrain.checkpointing.atomic",
    "atomic_path": "tputrain.checkpointing.atomic",
    "RunDirectory": "tputrain.checkpointing.run_directory",
    "ExponentialAverage": "tputrain.ema",
}

__all__ = list(_EXPORTS)


def _resolve(name: str) -> Any:
    module = importlib.import_module(_EXPORTS[name])
    value = module if _EXPORTS[name].endswith(f".{name}") else getattr(module, name)
    globals()[name] = value
    return value


def load_api() -> None:
    """Imports every public module and registers gin's configurables
    (`tputrain.configurables`)."""
    for name in _EXPORTS:
        if name not in globals():
            _resolve(name)
    importlib.import_module("tputrain.configurables")


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tputrain' has no attribute {name!r}")
    value = _resolve(name)  # its own module first: a module loading may ask for one name
    load_api()
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
