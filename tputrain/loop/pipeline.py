"""One update pipeline: reduce -> finite check -> apply, around the user's optimizer.

The Trainer leaves the optimizer a Task builds as built: checkpoints, `trainer.optimizer`
and a user's own code (Keras `fit` with it afterwards included) see it unchanged. The
step calls `UpdatePipeline.apply`, and a Task's `compute_gradients` and `train_step`
receive the pipeline as their `optimizer`: a `keras.optimizers.Optimizer` holding the
user's as `inner_optimizer` (as Keras's `LossScaleOptimizer` holds one), whose
`apply`, `apply_gradients` and `scale_loss` run the pipeline and whose
`learning_rate`, `iterations` and `variables` are the inner optimizer's. Two changes
to the inner optimizer last only while its `apply` runs (traces) inside the pipeline's,
because the Keras TF backend has no other hook for them, and are undone on every exit:
its own cross-replica sum is off (`tputrain.distribution.allreduce.summed_already`),
and under a masked update its writes are the guard's (`NonFiniteGuard.select_apply`).

In the order the code reads:
1. reduce: in replica context on N replicas, the gradients are summed once
   (`tputrain.distribution.allreduce`), so clipping, weight decay and the check see the sum;
2. check: the NaN/Inf guard's verdict (`tputrain.fault_tolerance.guard`): a conditional around the
   update, or, in an XLA program, a select on each of its writes;
3. apply: the optimizer's own `apply`, on each device as one XLA program when the
   plan says so (`tputrain.loop.update`).
"""

from __future__ import annotations

from typing import Any, Iterable

import keras
import tensorflow as tf

from tputrain.core import tracing
from tputrain.distribution.allreduce import all_reduce_sum, summed_already
from tputrain.fault_tolerance.guard import NonFiniteGuard
from tputrain.loop.update import apply_on_each_device

class UpdatePipeline(keras.optimizers.Optimizer):
    """The optimizer's update as tputrain runs it, wrapping the Task's optimizer.

    Args:
      optimizer: the Task's optimizer (a `LossScaleOptimizer` under mixed_float16),
        kept as `inner_optimizer`.
      guard: the NaN/Inf guard whose check and policy the update follows.
      allreduce_dtype: the dtype gradients cross replicas in
        (`CommunicationOptions.allreduce_dtype`).
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, guard: NonFiniteGuard,
                 allreduce_dtype: str = "float32"):
        super().__init__(learning_rate=0.0, name=f"{optimizer.name}_pipeline")
        self.inner_optimizer = optimizer
        self._guard = guard
        self._dtype = allreduce_dtype
        self._each_device = False

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's (a Task may read or set it through the pipeline)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        """The inner optimizer's step counter."""
        return self.inner_optimizer.iterations

    @property
    def variables(self) -> list[Any]:
        """The inner optimizer's variables (the pipeline keeps no state of its own)."""
        return self.inner_optimizer.variables

    def build(self, var_list: list[Any]) -> None:
        """Builds the inner optimizer's slots for these variables."""
        self.inner_optimizer.build(var_list)
        self.built = True

    def finalize_variable_values(self, var_list: list[Any]) -> None:
        """The inner optimizer's (its moving average, if it keeps one)."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def _sums_itself(self) -> keras.optimizers.Optimizer:
        """The optimizer whose `apply` sums gradients over replicas (a loss-scale
        optimizer's inner one)."""
        return getattr(self.inner_optimizer, "inner_optimizer", None) or self.inner_optimizer

    def set_plan(self, select: bool, each_device: bool) -> None:
        """From the XLA plan (`StepBuilder.build`): a bad step's writes are masked by
        selects (`select`, an update inside XLA) and the update runs as one XLA
        program on each device (`each_device`, N replicas)."""
        self._guard.select_updates(select)
        self._each_device = bool(each_device)

    @tracing.graph_helper
    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """The optimizer's `scale_loss`, then the guard's check scale while a scaled
        step traces (`NonFiniteGuard.scaling_loss`)."""
        return self._guard.scaled_loss(self.inner_optimizer,
                                       self.inner_optimizer.scale_loss(loss))

    @tracing.graph_helper
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> tf.Variable:
        """Keras's `apply_gradients`, through the pipeline; returns the step counter."""
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(list(grads), list(trainable_variables))
        return self.inner_optimizer.iterations

    @tracing.graph_helper
    def apply(self, grads: Iterable[Any], trainable_variables: Any = None) -> None:
        """Reduce, check, apply (module docstring)."""
        with summed_already(self._sums_itself()):
            self._reduce_check_apply(list(grads), trainable_variables)

    @tracing.graph_helper
    def _reduce_check_apply(self, grads: list[Any], trainable_variables: Any) -> None:
        """The three stages, the inner optimizer's own sum turned off (`apply`)."""
        context = tf.distribute.get_replica_context()
        replicated = context is not None and context.num_replicas_in_sync > 1
        if replicated:
            grads = all_reduce_sum(context, grads, self._dtype)
        if replicated and self._each_device:
            context.merge_call(self._apply_on_each_device, args=(grads, trainable_variables))
            return
        self._checked_apply(grads, trainable_variables)

    @tracing.graph_helper
    def _apply_on_each_device(self, strategy: tf.distribute.Strategy, grads: list[Any],
                              trainable_variables: Any) -> None:
        """Cross-replica context: each device's update (`tputrain.loop.update`). Under
        the scaled check each device's program checks its copy of the summed gradients
        (one plain sum a gradient, inside the program: no device waits for another);
        otherwise the exact check is made once for every device, before their programs."""
        once = self._guard.guards(self.inner_optimizer) and not self._guard.scales(self.inner_optimizer)
        apply_on_each_device(strategy, self._checked_apply, grads, trainable_variables,
                             self._guard.checking_once if once else None)

    def scales_on_each_device(self) -> bool:
        """Whether gradients of a scaled loss can cross replicas to each device's update:
        an update program per device, and a wire dtype with float32's range."""
        return self._each_device and tf.as_dtype(self._dtype) != tf.float16

    @tracing.graph_helper
    def _checked_apply(self, grads: list[Any], trainable_variables: Any) -> None:
        """The guard's check around the optimizer's own apply (gradients summed)."""
        optimizer, guard = self.inner_optimizer, self._guard
        if not guard.guards(optimizer):
            optimizer.apply(grads, trainable_variables)
            return
        if guard.selecting:
            guard.select_apply(optimizer, optimizer.apply, grads, trainable_variables)
            return
        context = tf.distribute.get_replica_context()
        if context is None:  # cross-replica context: nothing to agree on
            bad = guard.gradients_bad(grads)
            guard.record(bad)
            tf.cond(bad, lambda: tf.constant(False),
                    lambda: _done(optimizer.apply(grads, trainable_variables)))
            return
        # The gradients are summed over replicas: every replica reaches the same verdict.
        context.merge_call(self._conditional_apply,
                           args=(guard.gradients_bad(grads), grads, trainable_variables))

    @tracing.graph_helper
    def _conditional_apply(self, strategy: tf.distribute.Strategy, local_bad: Any,
                           grads: list[Any], trainable_variables: Any) -> None:
        """Cross-replica context: the update on every replica, or none. A replica-context
        cond cannot hold the optimizer's merge_call (Keras's loss-scale optimizer also
        decides in cross-replica context)."""
        bad = strategy.experimental_local_results(local_bad)[0]

        def apply_on_every_replica():
            strategy.extended.call_for_each_replica(
                self.inner_optimizer.apply, args=(grads, trainable_variables))
            return tf.constant(True)

        tf.cond(bad, lambda: tf.constant(False), apply_on_every_replica)
        self._guard.record(bad)


def _done(result: Any) -> tf.Tensor:
    del result
    return tf.constant(True)
