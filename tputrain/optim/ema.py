"""EMA weights (`Trainer.ema_decay`): an exponential moving average of the model's
trainable weights, which evaluation, the best checkpoint, predict and export use.

tputrain keeps its own float32 averages, whatever optimizer the Task builds:

* created in the strategy's scope beside the model and checkpointed with it
  (`ema/` in the checkpoint), so a resumed run continues them bitwise;
* updated after each train step where the step is counted
  (`tputrain.loop.host_loop.count_step`), in cross-replica context (or inside a
  one-replica XLA step): one value for every replica, the same on 1 and N replicas;
* a step the non-finite guard did not apply (it counted it in `nonfinite_steps`)
  leaves them unchanged; the first applied step sets them to the weights (as
  Keras's `use_ema` does), so an `InitCheckpoint` loaded at the start is averaged
  from, not the random initialization;
* trainable weights only (as Model Garden averages): non-trainable state such as
  BatchNorm's moving statistics is already an average and is used as trained.

`averaged_weights(ema)` puts the averages into the model's variables for the
duration of a `with` block and the raw values back after it: training always
continues on the raw weights.

Keras's own `use_ema=True` lives inside a Keras optimizer, which updates its
averages in its step (the same first-step rule and order as here: with
`ema_decay=ema_momentum` both hold the same values, tests/test_keras_fit_ema.py,
unless Keras's `ema_overwrite_frequency` or `gradient_accumulation_steps` is set)
and which the checkpoint saves with the optimizer. `finalize_keras_averages` ends a
run on them as `model.fit` ends (`tputrain.fit` calls it);
`check_overwrite_supported` refuses the one setting tputrain's step cannot run.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import keras
import tensorflow as tf

from tputrain.core import tracing


class ExponentialAverage:
    """The averages of `model`'s trainable weights, and how many steps they hold.

    Build it in the strategy's scope; `state` is what the checkpoint saves.
    """

    def __init__(self, model: keras.Model, decay: float):
        self.decay = decay
        self.model = model
        self.state = tf.Module(name="ema")
        self.state.averages = [_average_of(v) for v in model.trainable_variables]
        self.state.updates = tf.Variable(0, dtype=tf.int64, trainable=False, name="ema_updates",
                                         aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    @property
    def averages(self) -> list[tf.Variable]:
        return list(self.state.averages)

    @tracing.graph_helper
    def update(self, applied: tf.Tensor) -> None:
        """After a step: average in the weights if the step was `applied`."""
        first = tf.equal(self.state.updates.read_value(), 0)
        decay = tf.where(first, tf.constant(0.0), tf.constant(self.decay, tf.float32))
        for average, variable in zip(self.state.averages, self.model.trainable_variables):
            old = average.read_value()
            new = decay * old + (1.0 - decay) * tf.cast(tf.convert_to_tensor(variable), tf.float32)
            average.assign(tf.where(applied, new, old))
        self.state.updates.assign_add(tf.cast(applied, tf.int64))


def _average_of(variable: Any) -> tf.Variable:
    """A float32 copy of `variable`, one value on every replica."""
    return tf.Variable(tf.cast(tf.convert_to_tensor(variable), tf.float32), trainable=False,
                       name="ema_average", aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def build_average(strategy: tf.distribute.Strategy, model: keras.Model,
                  decay: float | None) -> ExponentialAverage | None:
    """The run's averages (None without `ema_decay`), built in `strategy`'s scope."""
    if decay is None:
        return None
    with strategy.scope():
        return ExponentialAverage(model, decay)


@contextlib.contextmanager
def averaged_weights(ema: ExponentialAverage | None) -> Iterator[bool]:
    """Within: the model's trainable variables hold the averages (yields True); the
    raw values are put back after, bitwise. Without averages nothing changes (False)."""
    if ema is None or int(ema.state.updates.numpy()) == 0:
        yield False
        return
    variables = ema.model.trainable_variables
    raw = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
    try:
        for variable, average in zip(variables, ema.state.averages):
            variable.assign(tf.cast(tf.convert_to_tensor(average), variable.dtype))
        yield True
    finally:
        for variable, value in zip(variables, raw):
            variable.assign(value)


def load_averages(model: keras.Model, checkpoint: str) -> bool:
    """Reads `checkpoint`'s averages (if it has them) into `model`'s trainable
    variables, for export; returns whether it had them."""
    names = {name for name, _ in tf.train.list_variables(checkpoint)}
    if not any(name.startswith("ema/") for name in names):
        return False
    state = tf.Module(name="ema")
    state.averages = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False)
                      for v in model.trainable_variables]
    state.updates = tf.Variable(0, dtype=tf.int64, trainable=False)
    tf.train.Checkpoint(ema=state).read(checkpoint).expect_partial() \
        .assert_existing_objects_matched()
    if int(state.updates.numpy()) == 0:
        return False
    for variable, average in zip(model.trainable_variables, state.averages):
        variable.assign(tf.cast(average, variable.dtype))
    return True


def _innermost(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The user's optimizer inside Keras's LossScaleOptimizer or tputrain's wrappers."""
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def finalize_keras_averages(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> bool:
    """`model`'s trainable weights set to the averages of Keras's `use_ema=True` that
    `optimizer` keeps, by its own `finalize_variable_values`, as `model.fit` ends;
    returns whether it had averages (`use_ema`, and at least one step taken)."""
    optimizer = _innermost(optimizer)
    if not (uses_keras_ema(optimizer) and optimizer.built
            and int(keras.ops.convert_to_numpy(optimizer.iterations)) > 0):
        return False
    optimizer.finalize_variable_values(model.trainable_weights)
    return True


def uses_keras_ema(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether `optimizer` (or the one it wraps) keeps Keras's `use_ema` averages."""
    return bool(getattr(_innermost(optimizer), "use_ema", False))


def check_overwrite_supported(optimizer: keras.optimizers.Optimizer,
                              strategy: tf.distribute.Strategy, xla_plan: Any) -> None:
    """Keras's `ema_overwrite_frequency` writes the averages into the weights inside its
    update, under a condition: on several replicas of a MirroredStrategy only tputrain's
    per-device XLA update runs it (Keras's own raises a `merge_call` error there, as
    `model.fit` does). Else a ValueError naming the fix, before the first step."""
    frequency = getattr(_innermost(optimizer), "ema_overwrite_frequency", None)
    replicas = strategy.num_replicas_in_sync
    if (not (uses_keras_ema(optimizer) and frequency) or replicas == 1
            or isinstance(strategy, tf.distribute.TPUStrategy)):  # one graph: no threads
        return
    if not getattr(xla_plan, "apply_per_replica", False):
        why = getattr(xla_plan, "why", "off")
        raise ValueError(f"Keras's ema_overwrite_frequency={frequency} on {replicas} replicas "
                         f"needs the optimizer update compiled on each device (XLA here: {why}):"
                         " leave jit_compile at \"auto\" (or True), or compile the optimizer "
                         "with ema_overwrite_frequency=None")
