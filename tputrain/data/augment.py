"""Random augmentation that resumes exactly: each element's seed comes from its position.

Stateful random ops (`tf.random.uniform`, `tf.image.random_*`, Keras random
layers) draw from state tf.data cannot checkpoint, so a resumed run draws other
numbers than an uninterrupted one. `stateless_augment` hands `fn` a seed that is
a pure function of (seed, host, the element's position in the stream) for
`tf.image.stateless_random_*` / `tf.random.stateless_*`. The position is counted
by an `enumerate` in the pipeline, whose counter the checkpointed iterator saves
and restores with the rest: a resume replays the same draws.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tputrain.core.checks import check_int
from tputrain.data.context import InputContext

Transformation = Callable[[tf.data.Dataset], tf.data.Dataset]


def element_seeds(seed: int, stream: int = 0) -> Callable[[tf.Tensor], tf.Tensor]:
    """position -> a shape-[2] int64 seed: distinct per (seed, stream, position), and
    the same on every device (Philox, not the device's default algorithm)."""
    base = tf.constant([seed, stream], tf.int64)
    return lambda position: tf.random.experimental.stateless_fold_in(
        base, position, alg="philox")


def stateless_augment(fn: Callable[..., Any], seed: int,
                      input_context: InputContext | None = None,
                      num_parallel_calls: int | None = tf.data.AUTOTUNE) -> Transformation:
    """A `dataset.apply` transformation: `fn(*element, seed)` on every element.

    `fn` gets the element as `Dataset.map` passes it (a tuple unpacked), then
    `seed`, a shape-[2] int64 tensor to give every random op it uses, e.g.
    `tf.image.stateless_random_flip_left_right(image, seed)` (derive several with
    `tf.random.split(seed, n)`). Apply it after `repeat()` and shuffling, so each
    epoch and each example gets new draws; after `batch`, one seed covers a batch
    (the `tf.image.stateless_random_*` ops still draw per image).

    Args:
        fn: the augmentation, built from stateless random ops only (a stateful one
            is still reported by the Trainer as not resuming exactly).
        seed: the run's augmentation seed.
        input_context: the builder's context: each input pipeline (host) then gets
            its own seeds. Without it every host draws the same sequence.
        num_parallel_calls: as for `Dataset.map`.
    """
    check_int("stateless_augment", "seed", seed, 0)
    if not callable(fn):
        raise TypeError(f"stateless_augment needs a function, got {type(fn).__name__}")
    stream = input_context.input_pipeline_id if input_context is not None else 0
    seeds = element_seeds(seed, stream)

    def augment(position: tf.Tensor, element: Any) -> Any:
        arguments = element if isinstance(element, tuple) else (element,)
        return fn(*arguments, seeds(position))

    def transformation(dataset: tf.data.Dataset) -> tf.data.Dataset:
        return dataset.enumerate().map(augment, num_parallel_calls=num_parallel_calls)
    return transformation
