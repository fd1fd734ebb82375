"""Keras's BatchNormalization as TensorFlow's fused kernel, for steps XLA does not compile.

Why: Keras 3's TensorFlow backend computes a batch norm as `tf.nn.moments` and
`tf.nn.batch_normalization`, and TensorFlow differentiates them op by op: about a
dozen kernels forward and backward, each a pass over the activations. Keras 2 used
`FusedBatchNormV3` (one kernel forward, one backward, oneDNN's on x86 CPUs, cuDNN's
on GPUs). Where XLA compiles the step it fuses Keras's ops itself; where it does not
(a conv net on a oneDNN CPU, the N-replica forward pass, a model with dropout on a
CPU) the step swaps the fused kernel in while it traces (`ElementwiseFusion` in
`tputrain.loop.step`), and the layers are Keras's own again afterwards.

The maths is Keras's: normalized by the batch's biased variance, computed in
float32 whatever the policy, moving statistics updated as
`moving * momentum + batch * (1 - momentum)` with the biased variance (the kernel
returns the unbiased one; it is rescaled). Inputs of another rank than the
kernel's four (a Dense's or a Conv1D's outputs) are reshaped to [examples, 1, 1,
channels]: the statistics are over every axis but the channels' either way.
Calls the kernel does not cover (inference, a frozen layer, a mask, channels not
last, float64) run Keras's call.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

_MIN_EPSILON = 1.001e-5  # the fused kernel's floor (tf.compat.v1.nn.fused_batch_norm)


def fused_batch_norm(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor,
                     epsilon: float) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Normalized `x` (NHWC, float32), the batch mean and the batch's biased variance."""
    y, mean, unbiased = tf.compat.v1.nn.fused_batch_norm(
        x, gamma, beta, epsilon=epsilon, data_format="NHWC", is_training=True)
    count = tf.cast(tf.reduce_prod(tf.shape(x)[:-1]), tf.float32)
    # The kernel scales by count / (count - 1), by 1 for a single value.
    return y, mean, unbiased * tf.where(count > 1.0, (count - 1.0) / count, 1.0)


def fused_call(layer: keras.layers.Layer) -> Callable | None:
    """A `call` for a plain Keras BatchNormalization the fused kernel covers; None for
    other layers (subclasses, renorm, synchronized, an epsilon under the kernel's floor)."""
    if (type(layer) is not keras.layers.BatchNormalization or layer.renorm
            or layer.synchronized or layer.epsilon < _MIN_EPSILON):
        return None

    def call(inputs, training=None, mask=None):
        if not _covered(layer, inputs, training, mask):
            return type(layer).call(layer, inputs, training=training, mask=mask)
        return _train_call(layer, inputs)
    return call


def _covered(layer: keras.layers.Layer, inputs: Any, training: Any, mask: Any) -> bool:
    """A training call of a trainable layer on unmasked channels-last inputs."""
    rank = tf.TensorShape(inputs.shape).rank
    return (training is True and layer.trainable and mask is None and rank is not None
            and rank >= 2 and layer.axis % rank == rank - 1
            and tf.as_dtype(inputs.dtype) != tf.float64)


def _train_call(layer: keras.layers.Layer, inputs: tf.Tensor) -> tf.Tensor:
    x = tf.cast(inputs, tf.float32)
    shape = tf.shape(x)
    if x.shape.rank != 4:
        x = tf.reshape(x, [-1, 1, 1, x.shape[-1]])
    moving_mean = tf.cast(layer.moving_mean.value, tf.float32)
    moving_variance = tf.cast(layer.moving_variance.value, tf.float32)
    channels = tf.TensorShape(x.shape)[-1]
    gamma = (tf.cast(layer.gamma.value, tf.float32) if layer.scale
             else tf.ones([channels], tf.float32))
    beta = (tf.cast(layer.beta.value, tf.float32) if layer.center
            else tf.zeros([channels], tf.float32))
    y, mean, variance = fused_batch_norm(x, gamma, beta, layer.epsilon)
    momentum = layer.momentum
    layer.moving_mean.assign(moving_mean * momentum + mean * (1.0 - momentum))
    layer.moving_variance.assign(moving_variance * momentum + variance * (1.0 - momentum))
    return tf.cast(y if inputs.shape.rank == 4 else tf.reshape(y, shape), layer.compute_dtype)
