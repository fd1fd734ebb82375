"""The optimizer's update as one XLA program on each replica's device.

Why: on N replicas XLA cannot compile the whole step (a program that applies
gradients under MirroredStrategy reaches the other devices' variables), so the
update ran as TensorFlow kernels, one pass over memory each: Adam's ten or so
elementwise kernels a variable took about a third of a 2-replica MLP step on CPU,
and the NaN/Inf guard needed a conditional around the whole update.

Once the gradients are summed (`tputrain.allreduce`), every replica holds the
same gradients, so each device can update its own copies without talking to the
others. `update_on_each_device` makes the optimizer's `apply` do that: one XLA
program per local device, traced in that replica's update context, so every read
and write of a mirrored variable is its copy on that device. The Keras TF
backend's own per-variable `extended.update` calls and merge calls are made
local while the program traces. The guard's selects fuse into the program
(`NonFiniteGuard.select_updates`), as on one replica; its check is made once for
every device (`NonFiniteGuard.checking_once`).

Measured (`benchmarks/resume.py`: 2 replicas, MLP 256-1024-1024-10 with dropout,
CPU, two runs): 1.22x less CPU time a step than the TensorFlow kernels; guard on
vs off 0.979-0.988 (0.958-0.971 around the kernels, in earlier runs).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import keras
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib

_OWN_MODULES = ("keras.", "tputrain.")


def update_on_each_device(optimizer: keras.optimizers.Optimizer) -> None:
    """Wraps `optimizer.apply`: in replica context on several replicas, with the
    wrapper switched on (`set_update_on_each_device`), the update runs as one XLA
    program on each local device. Wrap the guard first and the all-reduce after
    (`reduce_gradients_first`): this wrapper must see summed gradients. Idempotent."""
    if hasattr(optimizer, "_tputrain_each_device"):
        return
    inner_apply = optimizer.apply

    def apply(self_, grads, trainable_variables=None):
        del self_
        context = tf.distribute.get_replica_context()
        if (not optimizer._tputrain_each_device or context is None
                or context.num_replicas_in_sync == 1):
            return inner_apply(grads, trainable_variables)
        context.merge_call(_apply_on_each_device,
                           args=(optimizer, inner_apply, list(grads), trainable_variables))
        return None

    optimizer.apply = types.MethodType(apply, optimizer)
    optimizer._tputrain_each_device = False


def set_update_on_each_device(optimizer: keras.optimizers.Optimizer, on: bool) -> None:
    """Switches the per-device update on or off (`StepBuilder.build`, from its plan)."""
    if hasattr(optimizer, "_tputrain_each_device"):
        optimizer._tputrain_each_device = bool(on)


def refusal(optimizer: keras.optimizers.Optimizer, compile_any: bool = False) -> str | None:
    """Why this optimizer's update is not compiled per device, or None if it is.

    `compile_any` (jit_compile=True) takes any optimizer class; "auto" only Keras's
    and tputrain's, whose updates are known to compile.
    """
    if not hasattr(optimizer, "_tputrain_each_device"):
        return "the optimizer is not wrapped for it"
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return "a loss-scale optimizer (mixed_float16)"
    if type(optimizer).apply is not keras.optimizers.Optimizer.apply:
        return f"{type(optimizer).__name__} defines its own apply"
    if not compile_any and not type(optimizer).__module__.startswith(_OWN_MODULES):
        return (f"a custom optimizer class ({type(optimizer).__name__}); "
                "Trainer.jit_compile=True compiles its update too")
    return None


def _apply_on_each_device(strategy: tf.distribute.Strategy,
                          optimizer: keras.optimizers.Optimizer, inner_apply: Any,
                          grads: list[Any], trainable_variables: Any) -> None:
    """Cross-replica context: the update of replica i as an XLA program on device i.

    A check of the gradients that every device's update reads (the guard's,
    `NonFiniteGuard.checking_once`) is made once, before them, not once a device.
    """
    check_once = getattr(optimizer, "_tputrain_check_once", None)
    with check_once(strategy, grads) if check_once else contextlib.nullcontext():
        _each_device(strategy, inner_apply, grads, trainable_variables)


def _each_device(strategy: tf.distribute.Strategy, inner_apply: Any, grads: list[Any],
                 trainable_variables: Any) -> None:
    for replica, device in enumerate(strategy.extended.worker_devices):
        local = [None if g is None else strategy.experimental_local_results(g)[replica]
                 for g in grads]

        def update(local_grads, replica=replica):
            with _this_replica_only(strategy, replica):
                inner_apply(local_grads, trainable_variables)
            return tf.constant(True)

        with tf.device(device), distribute_lib.UpdateContext(replica):
            tf.function(update, jit_compile=True, autograph=False)(local)


@contextlib.contextmanager
def _this_replica_only(strategy: tf.distribute.Strategy, replica: int) -> Iterator[None]:
    """While an update traces: `strategy.extended.update` updates only this replica's
    copy, and merge calls call straight through (the Keras TF backend uses both to
    reach every replica's copy; here each device updates its own)."""
    extended = strategy.extended
    interim = tf.__internal__.distribute.interim
    saved_merge = interim.maybe_merge_call

    def update(var, fn, args=(), kwargs=None, group=True):
        del group
        copy = var.values[replica] if hasattr(var, "values") else var
        return fn(copy, *args, **(kwargs or {}))

    def maybe_merge_call(fn, strategy_, *args, **kwargs):
        return fn(strategy_, *args, **kwargs)

    extended.update = update
    interim.maybe_merge_call = maybe_merge_call
    try:
        with distribute_lib.UpdateContext(replica):
            yield
    finally:
        del extended.update
        interim.maybe_merge_call = saved_merge
