"""The non-finite guard: NaN/Inf losses or gradients never reach the weights.

Checked inside the compiled step, where it is nearly free: one pass over the
gradients, which are already summed over replicas (so every replica makes the
same decision without another all-reduce). A step with a non-finite loss or
gradient does not update the weights (the optimizer's apply is skipped, as
Keras's loss-scale optimizer does for overflow), and then, by `policy`:

* "raise" (default): the loop stops and `NonFiniteError` names the step;
  the weights are those before that step, and no checkpoint is written.
* "skip": training goes on; skipped steps are counted (`nonfinite_steps` in
  the logs and TensorBoard). The step counter still advances, because the
  batch was consumed.
* "rollback": the model, optimizer and dropout RNG are restored from the last
  checkpoint, the data position is *not* (the batches since are skipped, as
  large-model practice does for loss spikes), and training continues; more than
  `max_rollbacks` rollbacks raise `NonFiniteError`.
* None: no checks at all (to measure what they cost: `benchmarks/resume.py`).

Under mixed_float16 the Keras `LossScaleOptimizer` already skips overflowing
steps and lowers its scale; the guard then watches only the loss, since
non-finite scaled gradients are expected there.
"""

from __future__ import annotations

import types
from typing import Any, Mapping

import gin
import keras
import tensorflow as tf

POLICIES = ("raise", "skip", "rollback", None)


class NonFiniteError(FloatingPointError):
    """Training produced a NaN/Inf loss or gradient (policy 'raise' or too many rollbacks)."""


def _all_finite(values: list[Any]) -> tf.Tensor:
    """Whether every element is finite, in one read of each tensor.

    NaN and Inf propagate through a sum, so the sum of all sums is finite iff
    every element is (a float32 sum above 3e38 also counts as non-finite, which
    for a gradient is as bad). `reduce_all(is_finite(x))` would write a boolean
    copy of each gradient first.
    """
    sums = [tf.reduce_sum(tf.cast(v.values if isinstance(v, tf.IndexedSlices) else v,
                                  tf.float32))  # sparse (embedding) gradients: no densifying
            for v in values if v is not None and tf.as_dtype(v.dtype).is_floating]
    return tf.math.is_finite(tf.add_n(sums)) if sums else tf.constant(True)


@gin.configurable
class NonFiniteGuard:
    """Detects non-finite losses/gradients in the compiled step and applies `policy`.

    Args:
      policy: "raise", "skip", "rollback" or None (see the module docstring).
      max_rollbacks: with "rollback", how many rollbacks before giving up.
      check_gradients: also check gradients (skips the update in-step); False
        checks only the step's logged loss, after the update.
    """

    def __init__(self, policy: str | None = "raise", max_rollbacks: int = 3,
                 check_gradients: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"NonFiniteGuard.policy must be one of {POLICIES}, got {policy!r}")
        if max_rollbacks < 0:
            raise ValueError(f"NonFiniteGuard.max_rollbacks must be >= 0, got {max_rollbacks}")
        self.policy = policy
        self.max_rollbacks = int(max_rollbacks)
        self.check_gradients = check_gradients
        self.rollbacks = 0
        self._built = False

    def build(self) -> None:
        """Creates the guard's variables; call inside `strategy.scope()`."""
        def counter(name):
            return tf.Variable(0, dtype=tf.int64, trainable=False, name=name,
                               aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

        self.nonfinite_steps = counter("nonfinite_steps")  # cumulative, checkpointed
        self.tripped_at = counter("nonfinite_tripped_at")  # first bad step this loop, or 0
        self._gradients_bad = counter("nonfinite_gradients")  # set by the guarded apply
        self._built = True

    # ------------------------------------------------------- inside the step

    def wrap_optimizer(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Makes `optimizer.apply` skip non-finite updates (all replicas agree).

        Replica context: the gradients arrive summed over replicas
        (`tputrain.allreduce.reduce_gradients_first` wraps this wrapper), so each
        replica's check agrees; the (cross-replica) `tf.cond` either runs the
        optimizer's own apply on every replica or skips it.
        """
        if (self.policy is None or not self.check_gradients
                or getattr(optimizer, "_tputrain_guarded", False)):
            return
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return  # it skips overflowing steps itself (see the module docstring)
        original_apply = optimizer.apply
        guard = self
        self._apply = original_apply

        def guarded_apply(self_, grads, trainable_variables=None):
            del self_
            grads = list(grads)
            context = tf.distribute.get_replica_context()
            if context is None:  # cross-replica context: nothing to agree on
                bad = tf.logical_not(_all_finite(grads))
                guard._gradients_bad.assign(tf.cast(bad, tf.int64))
                tf.cond(bad, lambda: tf.constant(False),
                        lambda: _as_op(guard._apply(grads, trainable_variables)))
                return
            # The gradients are already summed over replicas (tputrain.allreduce), so
            # every replica reaches the same verdict: no all-reduce of it is needed.
            local_bad = tf.logical_not(_all_finite(grads))

            def cross_replica(distribution, local_bad, grads):
                bad = distribution.experimental_local_results(local_bad)[0]

                def apply_on_every_replica():
                    distribution.extended.call_for_each_replica(
                        guard._apply, args=(grads, trainable_variables))
                    return tf.constant(True)

                # A cond in cross-replica context: a replica-context cond cannot
                # hold the optimizer's merge_call (Keras's LossScaleOptimizer does the same).
                tf.cond(bad, lambda: tf.constant(False), apply_on_every_replica)
                guard._gradients_bad.assign(tf.cast(bad, tf.int64))

            context.merge_call(cross_replica, args=(local_bad, grads))

        optimizer.apply = types.MethodType(guarded_apply, optimizer)
        optimizer._tputrain_guarded = True

    def guards_apply(self, optimizer: keras.optimizers.Optimizer) -> bool:
        """Whether `wrap_optimizer` put the update of `optimizer` under a conditional."""
        return bool(getattr(optimizer, "_tputrain_guarded", False))

    def compile_apply(self) -> None:
        """XLA-compiles the optimizer's own apply, apart from the conditional around it.

        One XLA program holding the conditional update cost 8% of an MLP step (the
        update can no longer be done in place); the gradients in one program, the
        decision in TensorFlow, the update in a second program cost 3%.
        """
        if getattr(self, "_apply_compiled", False):
            return
        # The optimizer was built on the variables the Trainer updates, so the compiled
        # apply takes only the gradients (Keras variables are not tf.function arguments).
        apply = self._apply
        compiled = tf.function(lambda grads: apply(grads), jit_compile=True)
        self._apply = lambda grads, trainable_variables=None: compiled(list(grads))
        self._apply_compiled = True

    def observe(self, logs: Mapping[str, tf.Tensor], step: tf.Variable) -> None:
        """Cross-replica, after each train step: records a non-finite step."""
        if self.policy is None:
            return
        values = [v for v in logs.values() if tf.as_dtype(v.dtype).is_floating]
        bad = tf.logical_not(_all_finite(values))
        if self.check_gradients:
            bad = tf.logical_or(bad, self._gradients_bad.read_value() > 0)
            self._gradients_bad.assign(0)

        # Arithmetic, not a tf.cond: a conditional here cost a few % of a small step.
        self.nonfinite_steps.assign_add(tf.cast(bad, tf.int64))
        if self.policy != "skip":
            first = tf.logical_and(bad, tf.equal(self.tripped_at, 0))
            self.tripped_at.assign(tf.where(first, tf.cast(step, tf.int64), self.tripped_at))

    def should_stop(self) -> tf.Tensor:
        """Whether the loop must stop before its next step (not under "skip")."""
        if self.policy in (None, "skip"):
            return tf.constant(False)
        return self.tripped_at.read_value() > 0

    # ---------------------------------------------------- between host loops

    def take_trip(self) -> int:
        """Returns the step that tripped the guard in the last loop (0: none); resets it."""
        step = int(self.tripped_at.numpy())
        if step:
            self.tripped_at.assign(0)
        return step

    def message(self, step: int, gave_up: bool = False, no_checkpoint: bool = False) -> str:
        """The one-line error for a non-finite step, naming what to do."""
        text = (f"non-finite loss or gradients at step {step}; the update was not applied and "
                "nothing was checkpointed")
        if gave_up:
            return (f"{text}, after {self.max_rollbacks} rollbacks: lower the learning rate or "
                    "check the data, or raise NonFiniteGuard.max_rollbacks")
        if no_checkpoint:
            return (f"{text}, and there is no checkpoint to roll back to yet: lower "
                    "Trainer.checkpoint_every or the learning rate, or set "
                    "NonFiniteGuard.policy = 'skip'")
        return (f"{text}. Lower the learning rate, check the inputs of that step, or set "
                "NonFiniteGuard.policy = 'skip' or 'rollback'")


def _as_op(result: Any) -> tf.Tensor:
    del result
    return tf.constant(True)
