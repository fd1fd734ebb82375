"""Non-trainable model state kept one across replicas: batch norm's moving
statistics, weights declared `aggregation="sum"` or `"mean"`, and a refusal for the
rest.

Why: Keras 3 creates `BatchNormalization`'s moving mean and variance with no
aggregation, so on N replicas each device updates its own copy from its own
per-replica batch, and the copies drift apart: a checkpoint saved replica 0's
(the statistics of 1/N of the data), and an evaluation on N replicas normalized
each replica's examples with different statistics. (Keras 2 kept them as
sync-on-read variables, read as their mean.) The same held for any weight a layer
updates in its forward pass (a running count, mean or variance).

* Batch norm: after each train loop the copies of every device and worker are set
  to their mean, before anything saves or evaluates. The moving averages are linear
  in their variable, so the mean of the copies evolves exactly as if each device had
  kept its own and they were averaged on read: Keras 2's value, now also what every
  replica evaluates with. Copies already equal (a synchronized or frozen layer) are
  kept bit for bit. The cost is one small all-gather a loop, not a step.
* `add_weight(..., aggregation="mean")` or `"only_first_replica"`: TensorFlow makes
  every write one (the mean of the replicas' new values; replica 0's), so the copies
  never differ. A running mean updated as `m * momentum + batch_mean * (1 - momentum)`
  then follows the global batch's mean.
* `aggregation="sum"`: TensorFlow sums the *values* the replicas assign, and Keras
  writes `assign_add(d)` as `assign(v + d)`, so N replicas would write
  `N * v + sum(d)`. `sum_once` makes every replica but the first assign only its
  increment: each write leaves `v + sum over replicas of d` in every copy (exact for
  integer counts), whatever the loop and checkpoint boundaries.
* Any other non-trainable weight (`aggregation="none"`, Keras's default) must not
  change in training: a count each replica keeps of its own examples can be equal
  on every replica and still count half of them. Checksums of every copy are
  gathered before and after each loop; a weight that changed stops the run
  (`ReplicaStateError`) with one line naming it and the `aggregation=` that fixes
  it, before a save or evaluation. Frozen weights pass untouched.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tputrain.checkpointing.seeds import seed_generator_states

_SHOWN = 3  # weights named in a ReplicaStateError


class ReplicaStateError(ValueError):
    """A non-trainable weight with no declared aggregation differs between replicas."""


def moving_statistics(model: keras.Model) -> list[Any]:
    """The non-trainable floating-point variables of the model's batch-norm layers."""
    found: dict[int, Any] = {}
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            for variable in layer.non_trainable_variables:
                if tf.as_dtype(variable.dtype).is_floating:
                    found[id(variable)] = variable
    return list(found.values())


def forward_state(model: keras.Model) -> list[Any]:
    """The floating-point weights a train step's forward pass writes: batch norm's
    moving statistics and weights declared `aggregation="mean"` or `"sum"`."""
    found = {id(v): v for v in moving_statistics(model)}
    for variable in model.non_trainable_variables:
        if (getattr(variable, "aggregation", "none") in ("mean", "sum")
                and tf.as_dtype(variable.dtype).is_floating):
            found[id(variable)] = variable
    return list(found.values())


def undeclared_state(model: keras.Model) -> list[Any]:
    """The model's non-trainable weights with aggregation "none" that must stay equal on
    every replica (batch norm's statistics and the seed generators' states excluded:
    the first are averaged, the second advance alike on every replica)."""
    skip = {id(v) for v in moving_statistics(model) + seed_generator_states(model)}
    found: dict[int, Any] = {}
    for variable in model.non_trainable_variables:
        dtype = tf.as_dtype(variable.dtype)
        if (id(variable) not in skip and getattr(variable, "aggregation", "none") == "none"
                and (dtype.is_floating or dtype.is_integer or dtype.is_bool)):
            found[id(variable)] = variable
    return list(found.values())


def _summing_once(variable: Any) -> Callable:
    """`variable.assign` under which a replica other than the first assigns only its
    increment (`value - variable`), so TensorFlow's sum of the assigned values is the
    variable plus every replica's increment."""
    assign = variable.assign

    def assign_once(value: Any) -> Any:
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            value = tf.convert_to_tensor(value, variable.dtype)
            first = tf.equal(context.replica_id_in_sync_group, 0)
            value = tf.where(first, value, value - variable.value)
        return assign(value)
    assign_once.sums_once = True
    return assign_once


def sum_once(model: keras.Model) -> None:
    """Makes every non-trainable weight of `model` declared `aggregation="sum"` add each
    replica's increment once (an instance attribute over `assign`; idempotent)."""
    for variable in model.non_trainable_variables:
        if (getattr(variable, "aggregation", None) == "sum"
                and not getattr(variable.assign, "sums_once", False)):
            variable.assign = _summing_once(variable)


def _checksum(variable: Any) -> tf.Tensor:
    """An int64 checksum of the bits of this replica's copy: equal copies, equal sums."""
    value = tf.reshape(tf.convert_to_tensor(variable.value), [-1])
    if value.dtype == tf.bool:
        value = tf.cast(value, tf.int8)
    if value.dtype.is_floating:
        value = tf.bitcast(value, {2: tf.int16, 4: tf.int32, 8: tf.int64}[value.dtype.size])
    weights = tf.range(1, tf.size(value, out_type=tf.int64) + 1)  # order counts, too
    return tf.reduce_sum(tf.cast(value, tf.int64) * weights)


class ReplicaStatistics:
    """`average()` sets every replica's copy of the moving statistics to their mean
    (an all-gather, summed in one order, so every replica computes the same mean) and
    refuses undeclared state the loop since `begin()` changed (`ReplicaStateError`)."""

    def __init__(self, strategy: tf.distribute.Strategy, model: keras.Model):
        self.strategy = strategy
        many = strategy.num_replicas_in_sync > 1
        self.variables = moving_statistics(model) if many else []
        self.checked = undeclared_state(model) if many else []
        self._fn = tf.function(self._average) if (self.variables or self.checked) else None
        self._sums = tf.function(lambda: strategy.run(self._gathered_sums))
        self._before: np.ndarray | None = None

    def begin(self) -> None:
        """Before a loop (a collective): the checksums the loop's changes are found by."""
        if self.checked:
            self._before = self.strategy.experimental_local_results(self._sums())[0].numpy()

    def average(self) -> None:
        """Call on every worker at the same point (a collective); a no-op on one replica."""
        if self._fn is None:
            return
        after = self.strategy.experimental_local_results(self._fn())[0].numpy()
        if self.checked:
            self._refuse_changed(after)

    def _refuse_changed(self, after: np.ndarray) -> None:
        """`after`: [replicas, checked] checksums, the same on every worker, as `_before`."""
        changed = after.min(0) != after.max(0)
        if self._before is not None:
            changed |= (after != self._before).any(0)
        names = [v.path for v, c in zip(self.checked, changed) if c]
        if names:
            shown = ", ".join(repr(n) for n in names[:_SHOWN])
            more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
            raise ReplicaStateError(
                f"tputrain: non-trainable weight {shown}{more} changed in a train loop on "
                f"{self.strategy.num_replicas_in_sync} replicas with no declared aggregation "
                "(each replica updates its own copy from its own examples): declare it with "
                "add_weight(..., aggregation=\"sum\") for a count or total, "
                "aggregation=\"mean\" for a running mean or variance, or "
                "aggregation=\"only_first_replica\" for a value every replica computes alike "
                "(docs/distributed.md)")

    def _average(self) -> Any:
        return self.strategy.run(self._in_replica)

    def _in_replica(self) -> tf.Tensor:
        """One all-gather a dtype (every statistic flattened into one vector): a ResNet's
        hundred-odd statistics cost one collective, not a hundred. Returns the checked
        weights' checksums (`_gathered_sums`)."""
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
        return self._gathered_sums()

    def _gathered_sums(self) -> tf.Tensor:
        """Replica context: [replicas, checked] checksums, the same on every replica."""
        if not self.checked:
            return tf.zeros([0, 0], tf.int64)
        local = tf.stack([_checksum(v) for v in self.checked])
        return tf.distribute.get_replica_context().all_gather(local[tf.newaxis], axis=0)
