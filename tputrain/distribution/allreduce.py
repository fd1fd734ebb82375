"""One all-reduce of the gradients, before the optimizer sees them.

Keras 3 optimizers clip (`clipnorm`, `clipvalue`, `global_clipnorm`) and decay
inside `apply`, *before* their own cross-replica sum, so on N replicas each
replica clipped its partial gradient: a different update from one replica's.
The update pipeline (`tputrain.loop.pipeline`) moves the sum in front: the
optimizer's `apply` receives gradients already summed over replicas (one batched
all-reduce per step, also under gradient accumulation and for a `Task.train_step`
override that calls `apply_gradients`), and its own later sum is turned off while
the pipeline traces that `apply` (`summed_already`). Everything
the optimizer does then sees the global gradient: clipping, weight decay,
LARS/LAMB trust ratios, loss-scale unscaling and the NaN/Inf guard's check.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import keras
import tensorflow as tf

_SUM = "_all_reduce_sum_gradients"  # the Keras TF backend's own sum (summed_already)
_LOCK = threading.Lock()
_ACTIVE: dict[int, tuple[int, bool, Any]] = {}  # id(optimizer) -> (entries, had, saved)


def all_reduce_sum(context: tf.distribute.ReplicaContext, gradients: list[Any],
                   dtype: str = "float32") -> list[Any]:
    """Replica context: the gradients summed over replicas (None stays None).

    With `dtype` "bfloat16"/"float16", floating gradients cross in that dtype (half
    the bytes) and come back in their own (float32) dtype for the update.
    """
    present = [i for i, g in enumerate(gradients) if g is not None]
    if not present:
        return gradients
    wire = tf.as_dtype(dtype)

    def down(gradient):
        gradient = tf.convert_to_tensor(gradient) if wire != tf.float32 else gradient
        floating = tf.as_dtype(gradient.dtype).is_floating
        return tf.cast(gradient, wire) if floating and gradient.dtype != wire else gradient

    reduced = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                 [down(gradients[i]) for i in present])
    out = list(gradients)
    for i, value in zip(present, reduced):
        out[i] = tf.cast(value, gradients[i].dtype) if value.dtype != gradients[i].dtype else value
    return out


@contextlib.contextmanager
def summed_already(optimizer: keras.optimizers.Optimizer) -> Iterator[None]:
    """While the update pipeline's `apply` runs (traces): the Keras TF backend's own
    cross-replica sum in `optimizer.apply` passes the gradients through unchanged.

    Why an instance attribute, for a while: the backend's `_backend_update_step` calls
    `self._all_reduce_sum_gradients` whenever a replica context is active, and offers
    no argument, flag or subclass-free hook to skip it; calling `apply` in
    cross-replica context instead breaks its weight decay and per-variable updates
    (they need a replica context's merge call). Python reads the method only while
    `apply` runs, which in a step is while the step traces, so the attribute exists
    only then: every exit (return, error, a preemption's exception) restores the
    optimizer as built, and Keras's own `fit` with it later sums gradients as usual.
    Each replica's thread enters it; the first entry sets it, the last exit restores it.
    """
    if not hasattr(optimizer, _SUM):
        raise TypeError(
            f"{type(optimizer).__name__} has no _all_reduce_sum_gradients: tputrain needs a "
            "Keras 3 optimizer on the TensorFlow backend to sum gradients before clipping")
    with _LOCK:  # replicas trace `apply` in threads of their own (MirroredStrategy)
        count, had, saved = _ACTIVE.get(id(optimizer), (0, _SUM in vars(optimizer), None))
        if count == 0:
            saved = vars(optimizer).get(_SUM)
            optimizer._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)
        _ACTIVE[id(optimizer)] = (count + 1, had, saved)
    try:
        yield
    finally:
        with _LOCK:
            count, had, saved = _ACTIVE.pop(id(optimizer))
            if count > 1:
                _ACTIVE[id(optimizer)] = (count - 1, had, saved)
            elif had:
                vars(optimizer)[_SUM] = saved
            else:
                del vars(optimizer)[_SUM]
