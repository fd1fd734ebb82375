"""Dropout masks drawn with XLA's ThreeFry inside a compiled step on a CPU: `ThreeFryDropout`.

Why: Keras's TensorFlow backend draws a dropout mask with
`tf.random.stateless_uniform`'s default algorithm ("auto_select"). Its key and
counter come from a `StatelessRandomGetKeyCounter` op, which XLA lowers as a
scalar Philox scramble of the seed; XLA's CPU fusion then duplicates that scalar
work into the loop that generates the mask, so every element recomputes the key
(docs/performance.md: about 40x the CPU time of a number drawn by Philox with a
precomputed key, and 60x ThreeFry's). An explicit algorithm keeps the key out
of the per-element loop; XLA's ThreeFry draws faster than its Philox, and than
TensorFlow's own kernel. XLA's masks already differed from TensorFlow's kernels
(another counter layout), so a compiled step changes generator, not promise:
the masks remain a function of the layer's `SeedGenerator` state (and the
replica, `tputrain.loop.replica_seeds`), so a resume draws the same masks.

Only inside XLA programs: TensorFlow's CPU kernels have no ThreeFry, and an
uncompiled step keeps Keras's draws bit for bit. The layers are swapped back on
exit, as `tputrain.loop.step.ElementwiseFusion` does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from keras.src.layers.regularization.spatial_dropout import BaseSpatialDropout

# The algorithm of the masks: XLA's ThreeFry-2x32 (JAX's default generator too).
ALGORITHM = "threefry"
# The name scope of the masks' draws (`tputrain.loop.random_draws` leaves them out).
SCOPE = "threefry_dropout"

# `call`s that draw through `keras.random.dropout` with the layer's SeedGenerator,
# and how each finds its noise shape.
_NOISE_SHAPES: dict[Callable, Callable[[Any, Any], Any]] = {
    keras.layers.Dropout.call: lambda layer, inputs: layer.noise_shape,
    BaseSpatialDropout.call: lambda layer, inputs: layer._get_noise_shape(inputs),  # pylint: disable=protected-access
}


def _int32_seed(seed: tf.Tensor) -> tf.Tensor:
    """A SeedGenerator's seed as the int32 pair stateless ops take (as Keras casts it)."""
    if seed.dtype == tf.int32:
        return seed
    return tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)


def dropout(inputs: tf.Tensor, rate: float, noise_shape: Any, seed: tf.Tensor) -> tf.Tensor:
    """`inputs` with each unit (or each `noise_shape` slice) zeroed with probability
    `rate` and the rest scaled by 1 / (1 - rate), the mask drawn by ThreeFry: Keras's
    `keras.random.dropout` (TensorFlow's `stateless_dropout`) but for the generator."""
    if rate >= 1.0:
        return tf.zeros_like(inputs)
    with tf.name_scope(SCOPE):
        shape = tf.shape(inputs)
        if noise_shape is not None:
            shape = tf.stack([shape[i] if size is None else size
                              for i, size in enumerate(noise_shape)])
        uniform = tf.random.stateless_uniform(shape, seed=_int32_seed(seed),
                                              dtype=inputs.dtype, alg=ALGORITHM)
        scaled = inputs * tf.cast(1.0 / (1.0 - rate), inputs.dtype)
        return scaled * tf.cast(uniform >= tf.cast(rate, inputs.dtype), inputs.dtype)


def _call(layer: keras.layers.Layer, noise_shape: Callable[[Any, Any], Any]) -> Callable:
    def call(inputs, training=False):
        if training and layer.rate > 0:
            return dropout(inputs, layer.rate, noise_shape(layer, inputs),
                           layer.seed_generator.next())
        return inputs
    return call


class ThreeFryDropout:
    """While active (a compiled step traces), `model`'s Dropout and SpatialDropout layers
    draw their masks with ThreeFry; other random layers keep Keras's draws."""

    def __init__(self, model: keras.Model):
        self.swaps: list[tuple[keras.layers.Layer, Callable]] = []
        for layer in model._flatten_layers(include_self=False, recursive=True):  # pylint: disable=protected-access
            shape = _NOISE_SHAPES.get(getattr(type(layer), "call", None))
            if shape is not None and "call" not in vars(layer):
                self.swaps.append((layer, _call(layer, shape)))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: the swapped layers call `dropout` (instance attributes, removed on exit)."""
        try:
            for layer, call in self.swaps:
                vars(layer)["call"] = call  # no Keras tracking: a plain function
            yield
        finally:
            for layer, _ in self.swaps:
                vars(layer).pop("call", None)
