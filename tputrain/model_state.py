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

from tputrain.guard import NonFiniteGuard
from tputrain.precision.layers import override_layer_dtypes
from tputrain.loop.replica_seeds import fold_replica_into_seeds
from tputrain.loop.replica_stats import sum_once
from tputrain.loop.step import check_model_train_step, ensure_built
from tputrain.options import RematOptions
from tputrain.precision import wrap_optimizer_for_policy
from tputrain.remat import build_with_remat
from tputrain.task import Task


# model -> ids of the trainable variables its optimizer, EMA and checkpoints were built for.
_BUILT_FOR: "weakref.WeakKeyDictionary[keras.Model, tuple[int, ...]]" = weakref.WeakKeyDictionary()


class ModelState(NamedTuple):
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    train_metrics: list[Any]
    eval_metrics: list[Any]
    step: tf.Variable  # the global step: optimizer updates done
    guard: NonFiniteGuard


def build_model_state(task: Task, strategy: tf.distribute.Strategy, batch_spec: Any,
                      keep_float32_layers: Any, guard: NonFiniteGuard | None,
                      remat: RematOptions | None = None) -> ModelState:
    """Model, optimizer, metrics, step counter and guard, in `strategy`'s scope
    (the model's layers built in `remat`'s `keras.RematScope`: tputrain/remat.py)."""
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
    `build_model_state` built the optimizer for (LoRA enabled, layers frozen or
    unfrozen on `trainer.model` afterwards): the optimizer's slots, the EMA
    averages and the checkpoint's keys would not match them."""
    built = _BUILT_FOR.get(model)
    if built is None or built == tuple(id(v) for v in model.trainable_variables):
        return
    raise ValueError(
        "the model's trainable variables changed after the Trainer built its optimizer, EMA "
        "and checkpoints (enable_lora, or layers frozen or unfrozen, on trainer.model): do it "
        "in Task.build_model before returning the model (e.g. backbone.enable_lora(rank); "
        "KerasHubLMTask(lora_rank=...)), then build the Trainer")
