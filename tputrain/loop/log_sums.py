"""A loop's running sums of the step's logs, started before the step is traced.

A `tf.while_loop` needs the structure of its loop variables before it traces its
body, and the sums of the step's logs are one of them. Where the step is its own
traced function (one replica, `tputrain.core.tracing.once`), a trace of it for the
structure is the trace the loop calls (`HostLoop.log_zeros`). Where the step is
inlined (several replicas: each replica's copy is traced in the loop), such a trace
would be a second trace of the model on every replica: `CarriedSums` carries the
sums as one optional instead, empty until the first step, so the structure comes
from the step's one trace inside the loop.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class CarriedSums:
    """Sums of the step's logs carried through a loop as one optional (a variant
    tensor): `start()` is empty, `add` adds a step's logs to the sums (the first
    step's to zeros: 0 + x is x, so the sums are bitwise those started from the
    first step's logs) and `result` unpacks them after the loop, in the logs'
    structure, once a step was traced (`add`)."""

    def __init__(self) -> None:
        self.structure: Any = None  # the specs of the step's logs, once traced

    def start(self) -> tf.Tensor:
        return tf.raw_ops.OptionalNone()

    def _components(self, carried: tf.Tensor) -> list[tf.Tensor]:
        flat = tf.nest.flatten(self.structure)
        return tf.raw_ops.OptionalGetValue(optional=carried,
                                           output_types=[t.dtype for t in flat],
                                           output_shapes=[t.shape for t in flat])

    def add(self, carried: tf.Tensor, logs: Any) -> tf.Tensor:
        self.structure = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), logs)
        flat = tf.nest.flatten(logs)
        before = tf.cond(tf.raw_ops.OptionalHasValue(optional=carried),
                         lambda: list(self._components(carried)),
                         lambda: [tf.zeros_like(t) for t in flat])
        return tf.raw_ops.OptionalFromValue(
            components=[tf.add(total, t) for total, t in zip(before, flat)])

    def result(self, carried: tf.Tensor) -> Any:
        """The sums in the logs' structure; the loop ran at least one step."""
        if self.structure is None:
            raise RuntimeError("CarriedSums.result before a step was traced (add)")
        return tf.nest.pack_sequence_as(self.structure, list(self._components(carried)))
