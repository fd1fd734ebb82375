"""Keras's random draws made with XLA's ThreeFry inside a compiled step on a CPU:
`ThreeFryDraws`.

Why: Keras's TensorFlow backend draws (dropout masks, `keras.random.normal` and
`uniform`) with `tf.random.stateless_*`'s default algorithm ("auto_select"). Its key
and counter come from a `StatelessRandomGetKeyCounter` op, which XLA lowers as a
scalar Philox scramble of the seed; XLA's CPU fusion then duplicates that scalar
work into the loop that generates the numbers, so every element recomputes the key
(docs/performance.md: about 40x the CPU time of a number drawn by Philox with a
precomputed key, and 60x ThreeFry's). An explicit algorithm keeps the key out of
the per-element loop; XLA's ThreeFry draws faster than its Philox, and as fast as
TensorFlow's own kernels or faster. XLA's numbers already differed from
TensorFlow's kernels (another counter layout), so a compiled step changes
generator, not promise: the draws remain a function of the layer's `SeedGenerator`
state (and the replica, `tputrain.loop.replica_seeds`), so a resume draws the same.

What it covers: every draw through Keras's TensorFlow backend (`dropout`, `normal`,
`uniform`, `truncated_normal`, `randint`): Dropout, SpatialDropout, GaussianNoise,
GaussianDropout, AlphaDropout, the random augmentation layers' factors, and a
custom layer drawing with `keras.random`. Not `categorical`, `shuffle`, `gamma`,
`binomial` or `beta` (no algorithm argument), nor a draw made with `tf.random`
directly (`tputrain.loop.random_draws` counts those against XLA).

Only inside XLA programs and only in the thread that traces one: TensorFlow's CPU
kernels have no ThreeFry, and an uncompiled step (or other work meanwhile) keeps
Keras's draws bit for bit. Keras's functions are put back on exit, as
`tputrain.loop.step.ElementwiseFusion` swaps back its layers.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import random as keras_draws
from keras.src.random.seed_generator import draw_seed

# The algorithm of the draws: XLA's ThreeFry-2x32 (JAX's default generator too).
ALGORITHM = "threefry"
# The name scope of the draws (`tputrain.loop.random_draws` leaves them out).
SCOPE = "threefry_draws"


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


def _dropout(inputs, rate, noise_shape=None, seed=None):
    if rate == 0.0:
        return inputs
    return dropout(inputs, rate, noise_shape, draw_seed(seed))


def _normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    with tf.name_scope(SCOPE):
        return tf.random.stateless_normal(shape, seed=_int32_seed(draw_seed(seed)), mean=mean,
                                          stddev=stddev, dtype=dtype or keras.config.floatx(),
                                          alg=ALGORITHM)


def _truncated_normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    with tf.name_scope(SCOPE):
        return tf.random.stateless_truncated_normal(
            shape, seed=_int32_seed(draw_seed(seed)), mean=mean, stddev=stddev,
            dtype=dtype or keras.config.floatx(), alg=ALGORITHM)


def _uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
    dtype = dtype or keras.config.floatx()
    with tf.name_scope(SCOPE):
        return tf.random.stateless_uniform(shape, seed=_int32_seed(draw_seed(seed)),
                                           minval=tf.cast(minval, dtype),
                                           maxval=tf.cast(maxval, dtype), dtype=dtype,
                                           alg=ALGORITHM)


def _randint(shape, minval, maxval, dtype="int32", seed=None):
    drawn = dtype if tf.as_dtype(dtype) in (tf.int32, tf.int64) else tf.int64
    with tf.name_scope(SCOPE):
        return tf.cast(tf.random.stateless_uniform(
            shape, seed=_int32_seed(draw_seed(seed)), minval=minval, maxval=maxval,
            dtype=drawn, alg=ALGORITHM), dtype)


# Keras's TensorFlow-backend draws and ours, by name (the same signatures).
_OURS: dict[str, Callable] = {"dropout": _dropout, "normal": _normal, "uniform": _uniform,
                              "truncated_normal": _truncated_normal, "randint": _randint}
_LOCK = threading.Lock()
_TRACING: collections.Counter = collections.Counter()  # thread id -> active swaps
_KERAS: dict[str, Callable] = {}  # Keras's own functions while swapped


def _dispatching(name: str, keras_draw: Callable) -> Callable:
    ours = _OURS[name]

    def draw(*args, **kwargs):
        if threading.get_ident() in _TRACING:
            return ours(*args, **kwargs)
        return keras_draw(*args, **kwargs)
    return draw


@contextlib.contextmanager
def threefry_draws() -> Iterator[None]:
    """Within, in this thread, Keras's backend draws with ThreeFry (other threads as
    Keras does); nests, and Keras's functions are back once the last one exits."""
    thread = threading.get_ident()
    with _LOCK:
        if not _TRACING:
            for name in _OURS:
                _KERAS[name] = getattr(keras_draws, name)
                setattr(keras_draws, name, _dispatching(name, _KERAS[name]))
        _TRACING[thread] += 1
    try:
        yield
    finally:
        with _LOCK:
            _TRACING[thread] -= 1
            if not _TRACING[thread]:
                del _TRACING[thread]
            if not _TRACING:
                for name, keras_draw in _KERAS.items():
                    setattr(keras_draws, name, keras_draw)
                _KERAS.clear()


class ThreeFryDraws:
    """While active (a compiled step traces), `model`'s random layers (`layers`: those
    with a SeedGenerator) draw with ThreeFry through Keras's backend."""

    def __init__(self, model: keras.Model):
        self.layers = [layer for layer in
                       model._flatten_layers(include_self=False, recursive=True)  # pylint: disable=protected-access
                       if getattr(layer, "_seed_generators", None)]

    def active(self) -> contextlib.AbstractContextManager:
        """Within: Keras's draws in this thread are ThreeFry's (`threefry_draws`)."""
        return threefry_draws()
