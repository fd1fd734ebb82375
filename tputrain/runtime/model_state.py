"""What the Trainer builds in strategy scope: the model and everything that updates it.

Built before the first step so that slot variables are mirrored and a restore can
fill them; the model's layers get the run's precision overrides, a seed per
replica for random layers and sum-once non-trainable state (tputrain/loop).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tputrain.fault_tolerance.guard import NonFiniteGuard
from tputrain.precision.layers import override_layer_dtypes
from tputrain.loop.replica_seeds import fold_replica_into_seeds
from tputrain.loop.replica_stats import sum_once
from tputrain.keras_task import KerasTask
from tputrain.loop.inputs import zeros_of
from tputrain.options import RematOptions
from tputrain.precision import wrap_optimizer_for_policy
from tputrain.loop.remat import build_with_remat
from tputrain.task import Task, overrides


# model -> ids of the trainable variables its optimizer, EMA and checkpoints were built for.
_BUILT_FOR: "weakref.WeakKeyDictionary[keras.Model, tuple[int, ...]]" = weakref.WeakKeyDictionary()


class ModelState(NamedTuple):
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    train_metrics: list[Any]
    eval_metrics: list[Any]
    step: tf.Variable  # the global step: optimizer updates done
    guard: NonFiniteGuard


def ensure_built(model: keras.Model, features_spec: Any) -> None:
    """Builds subclassed models (no Input layer) by calling them on zeros."""
    if not (model.built and model.variables):
        model(zeros_of(features_spec), training=False)


# keras.Model methods tputrain never calls: the Task methods that take their place
# (one of them overridden is the port) and the port's signature.
_MODEL_HOOKS = {
    "train_step": (("train_step", "compute_gradients"),
                   "train_step(self, batch, model, optimizer, metrics, global_batch_size)"),
    "compute_loss": (("train_step", "compute_gradients", "compute_loss", "total_loss"),
                     "total_loss(self, labels, outputs, model, global_batch_size, "
                     "micro_batches=1, sample_weight=None)"),
    "test_step": (("eval_step", "eval_outputs"),
                  "eval_step(self, batch, model, metrics, global_batch_size)"),
    "compute_metrics": (("update_metrics", "train_step", "eval_step"),
                        "update_metrics(self, metrics, labels, outputs, sample_weight=None)"),
}


def check_model_train_step(model: keras.Model, task: Task) -> None:
    """Refuses a model that overrides `keras.Model.train_step` (or `compute_loss`,
    `test_step`, `compute_metrics`) when the Task's own would run instead: nothing
    would call the model's, so it would silently train or evaluate without it. A
    Task that overrides the matching method is the port."""
    base = KerasTask if isinstance(task, KerasTask) else Task
    for method, (replacements, signature) in _MODEL_HOOKS.items():
        if getattr(type(model), method, None) is getattr(keras.Model, method):
            continue
        if any(overrides(task, name, base) for name in replacements):
            continue
        raise TypeError(_port_message(type(model).__name__, method, signature, task))


def _port_message(name: str, method: str, signature: str, task: Task) -> str:
    where = (f"tputrain: {name}.{method} overrides keras.Model.{method}, which tputrain never "
             "calls (the Task's step trains and evaluates the model)")
    if type(task) is KerasTask:  # tputrain.fit's: the port is a subclass passed as task=
        return (f"{where}: port its body to a KerasTask in two lines, `class Ported("
                f"tputrain.KerasTask): def {signature}: ...` and `tputrain.fit(model, "
                "train_data, ..., task=Ported)` (docs/tasks.md, \"Port a model's train_step\")")
    return (f"{where}: move it to {type(task).__name__}.{signature.replace('self, ', '', 1)} "
            "(docs/tasks.md, \"Port a model's train_step\")")


def build_model_state(task: Task, strategy: tf.distribute.Strategy, batch_spec: Any,
                      keep_float32_layers: Any, guard: NonFiniteGuard | None,
                      remat: RematOptions | None = None) -> ModelState:
    """Model, optimizer, metrics, step counter and guard, in `strategy`'s scope
    (the model's layers built in `remat`'s `keras.RematScope`: tputrain/loop/remat.py)."""
    with strategy.scope():
        model = build_with_remat(task.build_model, remat)
        ensure_built(model, batch_spec)
        override_layer_dtypes(model, keep_float32_layers)
        fold_replica_into_seeds(model)  # dropout masks differ per replica
        sum_once(model)  # aggregation="sum" weights add each replica's share once
        check_model_train_step(model, task)
        # mixed_float16 wraps any optimizer for Keras 3 loss scaling.
        optimizer = wrap_optimizer_for_policy(task.build_optimizer())
        optimizer.build(model.trainable_variables)
        _BUILT_FOR[model] = tuple(id(v) for v in model.trainable_variables)
        train_metrics, eval_metrics = list(task.build_metrics()), list(task.build_metrics())
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        guard = guard if guard is not None else NonFiniteGuard()
        guard.build()
        return ModelState(model, optimizer, train_metrics, eval_metrics, step, guard)


def check_trainable_unchanged(model: keras.Model) -> None:
    """A ValueError naming the fix when `model`'s trainable variables are not those
    the optimizer was built for once training has begun (an action's `enable_lora`):
    `Trainer.train()` adopts a change made before it (tputrain/runtime/trainable_change.py)."""
    built = _BUILT_FOR.get(model)
    if built is None or built == tuple(id(v) for v in model.trainable_variables):
        return
    raise ValueError(
        "the model's trainable variables changed during training (enable_lora, or layers "
        "frozen or unfrozen, on trainer.model): do it before Trainer.train() (which rebuilds "
        "the optimizer, EMA and checkpoint for them) or in Task.build_model")
