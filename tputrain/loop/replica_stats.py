"""Batch norm's moving statistics made one across replicas after each loop.

Why: Keras 3 creates `BatchNormalization`'s moving mean and variance with no
aggregation, so on N replicas each device updates its own copy from its own
per-replica batch, and the copies drift apart: a checkpoint saved replica 0's
(the statistics of 1/N of the data), and an evaluation on N replicas normalized
each replica's examples with different statistics. (Keras 2 kept them as
sync-on-read variables, read as their mean.)

After each train loop the copies of every device and worker are set to their
mean, before anything saves or evaluates. The moving averages are linear in
their variable, so the mean of the copies evolves exactly as if each device had
kept its own and they were averaged on read: Keras 2's value, now also what every
replica evaluates with. Copies already equal (a synchronized or frozen layer) are
kept bit for bit. The cost is one small all-gather a loop, not a step.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf


def moving_statistics(model: keras.Model) -> list[Any]:
    """The non-trainable floating-point variables of the model's batch-norm layers."""
    found: dict[int, Any] = {}
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            for variable in layer.non_trainable_variables:
                if tf.as_dtype(variable.dtype).is_floating:
                    found[id(variable)] = variable
    return list(found.values())


class ReplicaStatistics:
    """`average()` sets every replica's copy of the moving statistics to their mean
    (an all-gather, summed in one order, so every replica computes the same mean)."""

    def __init__(self, strategy: tf.distribute.Strategy, model: keras.Model):
        self.strategy = strategy
        many = strategy.num_replicas_in_sync > 1
        self.variables = moving_statistics(model) if many else []
        self._fn = tf.function(self._average) if self.variables else None

    def average(self) -> None:
        """Call on every worker at the same point (a collective); a no-op on one replica."""
        if self._fn is not None:
            self._fn()

    def _average(self) -> None:
        self.strategy.run(self._in_replica)

    def _in_replica(self) -> None:
        """One all-gather a dtype (every statistic flattened into one vector): a ResNet's
        hundred-odd statistics cost one collective, not a hundred."""
        context = tf.distribute.get_replica_context()
        by_dtype: dict[tf.DType, list[Any]] = {}
        for variable in self.variables:
            by_dtype.setdefault(tf.as_dtype(variable.dtype), []).append(variable)
        for group in by_dtype.values():
            local = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in group], 0)
            copies = context.all_gather(local[tf.newaxis], axis=0)  # the same everywhere
            same = tf.equal(tf.reduce_min(copies, 0), tf.reduce_max(copies, 0))
            mean = tf.reduce_sum(copies, 0) / context.num_replicas_in_sync
            merged = tf.where(same, local, mean)  # equal copies kept bit for bit
            sizes = [int(v.shape.num_elements()) for v in group]
            for variable, part in zip(group, tf.split(merged, sizes)):
                variable.assign(tf.reshape(part, variable.shape))
