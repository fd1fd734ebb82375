"""The optimizer's update as one XLA program on each replica's device.

Why: on N replicas XLA cannot compile the whole step (a program that applies
gradients under MirroredStrategy reaches the other devices' variables), so the
update ran as TensorFlow kernels, one pass over memory each: Adam's ten or so
elementwise kernels a variable took about a third of a 2-replica MLP step on CPU,
and the NaN/Inf guard needed a conditional around the whole update.

Once the gradients are summed (`tputrain.distribution.allreduce`), every replica holds the
same gradients, so each device can update its own copies without talking to the
others. `apply_on_each_device` does that for the update pipeline
(`tputrain.loop.pipeline`): one XLA program per local device, traced in that
replica's update context, so every read and write of a mirrored variable is its
copy on that device. The Keras TF
backend's own per-variable `extended.update` calls and merge calls are made
local while the program traces. The guard's selects fuse into the program
(`NonFiniteGuard.select_updates`), as on one replica. Its scaled check runs in each
program on that device's copy of the summed gradients (every copy is the same, so
is every verdict); the exact check is made once for every device
(`NonFiniteGuard.checking_once`).

Measured by `benchmarks/resume.py` (2 replicas, an MLP with dropout): less CPU
time a step than the TensorFlow kernels, the guard's cost with it included
(docs/performance.md, Design measurements, and the `resume` results).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib

_OWN_MODULES = ("keras.", "tputrain.")


def refusal(optimizer: keras.optimizers.Optimizer, compile_any: bool = False) -> str | None:
    """Why this optimizer's update is not compiled per device, or None if it is.

    `compile_any` (jit_compile=True) takes any optimizer class; "auto" only Keras's
    and tputrain's, whose updates are known to compile.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return "a loss-scale optimizer (mixed_float16)"
    if type(optimizer).apply is not keras.optimizers.Optimizer.apply:
        return f"{type(optimizer).__name__} defines its own apply"
    if not compile_any and not type(optimizer).__module__.startswith(_OWN_MODULES):
        return (f"a custom optimizer class ({type(optimizer).__name__}); "
                "Trainer.jit_compile=True compiles its update too")
    return None


def apply_on_each_device(strategy: tf.distribute.Strategy, apply: Callable,
                         grads: list[Any], trainable_variables: Any,
                         check_once: Callable | None = None) -> None:
    """Cross-replica context, gradients summed over replicas: `apply` (the pipeline's
    checked apply) as an XLA program on each local device, replica i's on device i.

    `check_once(strategy, grads)`, a context (the guard's `checking_once`), makes the
    check of the gradients that every device's update reads once, before them.
    """
    with check_once(strategy, grads) if check_once else contextlib.nullcontext():
        _each_device(strategy, apply, grads, trainable_variables)


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
    """While one device's update traces: `strategy.extended.update` updates only this
    replica's copy, and merge calls call straight through.

    Why a swap, and only inside this block: the Keras TF backend reaches every
    replica's copy of a variable through `extended.update` and the process-global
    `tf.__internal__.distribute.interim.maybe_merge_call`, with no argument or hook to
    aim them at one device; here each device's program updates its own copies. Both
    are set when the block is entered and put back when it is left, by any exit (an
    error in the user's optimizer included), so no TensorFlow global stays changed
    after a step is traced (`tests/loop/test_update.py`).
    """
    extended = strategy.extended
    interim = tf.__internal__.distribute.interim
    saved_merge = interim.maybe_merge_call
    own_update = vars(extended).get("update")  # an instance attribute before, if any

    def update(var, fn, args=(), kwargs=None, group=True):
        del group
        copy = var.values[replica] if hasattr(var, "values") else var
        return fn(copy, *args, **(kwargs or {}))

    def maybe_merge_call(fn, strategy_, *args, **kwargs):
        return fn(strategy_, *args, **kwargs)

    try:
        extended.update = update
        interim.maybe_merge_call = maybe_merge_call
        with distribute_lib.UpdateContext(replica):
            yield
    finally:
        interim.maybe_merge_call = saved_merge
        if own_update is None:
            vars(extended).pop("update", None)
        else:
            extended.update = own_update
