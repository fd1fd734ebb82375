"""tputrain: a TPU-first training library for TensorFlow 2 / Keras 3.

The public API is re-exported here; everything else is an implementation detail.
"""

import os

# TensorFlow's C++ INFO lines drown the progress lines; users can still override.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from tputrain.console import quiet_tensorflow_startup  # noqa: E402

quiet_tensorflow_startup()  # before any other import of TensorFlow (docs/architecture.md)

from tputrain import data  # noqa: E402
from tputrain.actions import Action  # noqa: E402
from tputrain.console import show_progress  # noqa: E402
from tputrain.controller import Controller  # noqa: E402
from tputrain.checkpoint import Checkpointer, CheckpointMismatchError  # noqa: E402
from tputrain.guard import NonFiniteError, NonFiniteGuard  # noqa: E402
from tputrain.loop.replica_stats import ReplicaStateError  # noqa: E402
from tputrain.preemption import PREEMPTED_EXIT_CODE, Preempted  # noqa: E402
from tputrain.audit import audit_precision  # noqa: E402
from tputrain.lars import LARS  # noqa: E402
from tputrain.layer_precision import override_layer_dtypes  # noqa: E402
from tputrain.optimizers import build_optimizer  # noqa: E402
from tputrain.schedules import WarmupDecay, scale_learning_rate, warmup_schedule  # noqa: E402
from tputrain.precision import set_precision_policy  # noqa: E402
from tputrain.strategy import resolve_strategy, split_cpu  # noqa: E402
from tputrain.task import Task  # noqa: E402
from tputrain.trainer import Trainer  # noqa: E402
from tputrain.best import BestCheckpoint, EarlyStopping  # noqa: E402
from tputrain.export import Export, export_checkpoint  # noqa: E402
from tputrain.init_checkpoint import InitCheckpoint  # noqa: E402
from tputrain.sidecar import NoNewCheckpointError, ReadOnlyTrainer, evaluate_checkpoints  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Action",
    "BestCheckpoint",
    "EarlyStopping",
    "Export",
    "InitCheckpoint",
    "NoNewCheckpointError",
    "ReadOnlyTrainer",
    "evaluate_checkpoints",
    "export_checkpoint",
    "Controller",
    "show_progress",
    "Checkpointer",
    "CheckpointMismatchError",
    "NonFiniteError",
    "NonFiniteGuard",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "ReplicaStateError",
    "LARS",
    "WarmupDecay",
    "audit_precision",
    "override_layer_dtypes",
    "scale_learning_rate",
    "warmup_schedule",
    "Task",
    "Trainer",
    "build_optimizer",
    "data",
    "resolve_strategy",
    "set_precision_policy",
    "split_cpu",
]
