"""Shuffles whose order is a function of (seed, epoch) and nothing else.

`Dataset.shuffle(seed=s, reshuffle_each_iteration=True)` draws each epoch's
seeds from one generator shared by every iterator of that dataset object. The
Trainer makes throwaway iterators (the input probe, the iterator-size
pre-flight) from the train dataset, so the train order would depend on how
many iterators were made before it and, in a multi-epoch run, on when the
background prefetch started its next epoch. Here each epoch is built from its
index instead: files are permuted by a stateless op seeded with (seed, epoch)
and records are shuffled by a buffer seeded with (seed, epoch) that never
reshuffles. Any iterator, fresh, probed before or restored from a checkpoint,
sees the same order, and the pipeline stays checkpointable (no stateful op).
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

_FOREVER = 2**62


def epoch_seed(seed: int, epoch: tf.Tensor) -> tf.Tensor:
    """An int64 seed of (seed, epoch): distinct epochs give distinct seeds."""
    return tf.constant(seed, tf.int64) * 1_000_003 + tf.cast(epoch, tf.int64) + 1


def by_epoch(make: Callable[[tf.Tensor], tf.data.Dataset], repeat: bool) -> tf.data.Dataset:
    """make(0), then make(1), ... (one epoch with repeat=False). Repeated, the
    cardinality is infinite, as `Dataset.repeat()` makes it."""
    epochs = tf.data.Dataset.range(_FOREVER if repeat else 1).flat_map(make)
    return epochs.repeat() if repeat else epochs


def shuffle_epoch(examples: tf.data.Dataset, buffer_size: int, seed: int,
                  epoch: tf.Tensor) -> tf.data.Dataset:
    """`examples` through a shuffle buffer seeded with (seed, epoch), never reshuffled.

    The raw op, because `Dataset.shuffle` takes one seed and pairs it with the
    global seed in Python (a tensor seed fails under a global seed), and inside a
    tf.data function adds a stateful seed-generator op the iterator could not save.
    """
    specs = tf.nest.flatten(examples.element_spec)
    variant = tf.raw_ops.ShuffleDataset(
        input_dataset=tf.data.experimental.to_variant(examples),
        buffer_size=tf.constant(buffer_size, tf.int64), seed=tf.constant(seed, tf.int64),
        seed2=epoch_seed(seed, epoch), reshuffle_each_iteration=False,
        output_types=[spec.dtype for spec in specs], output_shapes=[spec.shape for spec in specs])
    return tf.data.experimental.from_variant(variant, examples.element_spec)


def permuted(tensors: Sequence[tf.Tensor], seed: int, epoch: tf.Tensor) -> tf.data.Dataset:
    """The rows of `tensors` (paths and what goes with them) in the order of a
    stateless permutation seeded with (seed, epoch)."""
    count = tf.shape(tensors[0], out_type=tf.int64)[0]
    order = tf.random.experimental.stateless_shuffle(
        tf.range(count), seed=tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64)]))
    rows = tuple(tf.gather(tensor, order) for tensor in tensors)
    return tf.data.Dataset.from_tensor_slices(rows if len(rows) > 1 else rows[0])
