"""One all-reduce of the gradients, before the optimizer sees them.

Keras 3 optimizers clip (`clipnorm`, `clipvalue`, `global_clipnorm`) and decay
inside `apply`, *before* their own cross-replica sum, so on N replicas each
replica clipped its partial gradient: a different update from one replica's.
The update pipeline (`tputrain.loop.pipeline`) moves the sum in front: the
optimizer's `apply` receives gradients already summed over replicas (one batched
all-reduce per step, also under gradient accumulation and for a `Task.train_step`
override that calls `apply_gradients`), and its own later sum is turned off. Everything
the optimizer does then sees the global gradient: clipping, weight decay,
LARS/LAMB trust ratios, loss-scale unscaling and the NaN/Inf guard's check.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf


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


def no_second_sum(optimizer: keras.optimizers.Optimizer) -> None:
    """Turns off the Keras TF backend's own cross-replica sum in `apply`."""
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise TypeError(
            f"{type(optimizer).__name__} has no _all_reduce_sum_gradients: tputrain needs a "
            "Keras 3 optimizer on the TensorFlow backend to sum gradients before clipping")
    optimizer._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)
