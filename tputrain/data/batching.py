"""Per-replica batching shared by the input builders (TFRecordInput, TFDSInput).

Every builder resolves the per-replica batch from the `InputContext`, batches
with `drop_remainder=True` (static shapes), optionally splits off the label and
checks that every shape is static. For datasets that fit in memory,
`in_memory_batches` serves batches by index from tensors held in RAM: one
gather per batch instead of per-example shuffle and batch work, which matters
on hosts with few cores, where tf.data threads compete with the train step.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Mapping

import keras
import tensorflow as tf
from absl import logging

from tputrain.data.context import InputContext

_CHUNK_BYTES = 16 * 2**20  # in-memory batches are gathered this much at a time
_NOT_STATIC = ("TPUs need static shapes: pad or resize every example to one shape "
               "before batching")


def resolve_per_replica_batch(builder: str, configured: int | None,
                              context: InputContext) -> int:
    """The per-replica batch, from the builder's own global batch or the context's."""
    global_batch = configured
    if global_batch is None:
        global_batch = context.global_batch_size
    elif context.global_batch_size not in (None, global_batch):
        logging.warning(
            "%s.global_batch_size=%d overrides the input context's global batch %d: set it "
            "in one place (usually the Trainer)", builder, global_batch,
            context.global_batch_size)
    if global_batch is None:
        raise ValueError(
            f"{builder} has no global batch size: set {builder}.global_batch_size or pass an "
            "InputContext with global_batch_size (the Trainer does this)")
    return context.get_per_replica_batch_size(global_batch)


def split_label(features: dict[str, Any], label_key: str | None):
    """`features` itself, or `(features without the label, label)`."""
    if label_key is None:
        return features
    features = dict(features)
    label = features.pop(label_key)
    return features, label


def pad_to_batch(batch: Any, batch_size: int) -> tuple[Any, Any, tf.Tensor]:
    """`(features, labels)` of up to `batch_size` rows -> `(features, labels, weights)`.

    Rows past the real ones are zeros with weight 0, so an eval split of any size
    keeps the static batch shape TPUs need without dropping its last examples:
    losses and metrics weighted by `weights` count only the real rows.
    """
    if not (isinstance(batch, tuple) and len(batch) == 2):
        raise ValueError("pad_remainder needs (features, labels) batches: set label_key")
    rows = tf.shape(tf.nest.flatten(batch)[0])[0]

    def pad(t: tf.Tensor) -> tf.Tensor:
        padding = [[0, batch_size - rows]] + [[0, 0]] * (t.shape.rank - 1)
        return tf.ensure_shape(tf.pad(t, padding), [batch_size] + t.shape[1:])

    weights = tf.sequence_mask(rows, batch_size, dtype=tf.float32)
    return (*tf.nest.map_structure(pad, batch), weights)


def check_pad_remainder(builder: str, pad_remainder: bool, repeat: bool,
                        label_key: str | None) -> None:
    """Padding with weights is for a finite, labelled (eval) split."""
    if pad_remainder and (repeat or label_key is None):
        raise ValueError(f"{builder}: pad_remainder is for evaluation: it needs repeat=False "
                         "and a label_key")


def check_static(builder: str, element_spec: Any, fix: str = _NOT_STATIC) -> None:
    """Fails with the feature's name if any batch shape is not fully known."""
    for path, spec in keras.tree.flatten_with_path(element_spec):
        path = "/".join(map(str, path))
        shape = getattr(spec, "shape", None)
        if shape is not None and not shape.is_fully_defined():
            raise ValueError(f"{builder}: feature {path!r} has non-static shape {shape} in the "
                             f"input pipeline: {fix}")


def random_seed() -> int:
    """A seed for `seed=None` (a different order per run, fixed within the run)."""
    return random.SystemRandom().randrange(2**31)


def in_memory_batches(examples: Mapping[str, tf.Tensor], batch_size: int, *, shuffle: bool,
                      seed: int | None, repeat: bool,
                      finish: Callable[[dict[str, tf.Tensor]], Any] | None = None
                      ) -> tf.data.Dataset:
    """Batches of `batch_size` rows of `examples` (a dict of [N, ...] tensors in RAM).

    Like `repeat -> batch(drop_remainder=True)` over the examples, with a full
    permutation per epoch when `shuffle` (the same `seed` gives the same
    orders) and batches that carry on across epoch ends, so every example is
    seen once per epoch. Without `repeat` the last partial batch is dropped.
    `finish` (e.g. splitting off the label) is applied to whole chunks of
    batches. Batches are gathered a chunk (up to ~16 MB) at a time and then
    sliced, so the per-batch cost is one slice: ~3.5x less host time per batch
    than a gather per batch on a busy 2-core host.
    """
    sizes = {name: int(t.shape[0]) for name, t in examples.items()}
    num_examples = next(iter(sizes.values()))
    if len(set(sizes.values())) != 1:
        raise ValueError(f"in-memory features have different lengths: {sizes}")
    if num_examples < batch_size and not repeat:
        raise ValueError(f"{num_examples} examples make no batch of {batch_size}: use a smaller "
                         "batch or more data")
    if num_examples == 0:
        raise ValueError("no examples to batch: the input is empty")
    seed = random_seed() if (shuffle and seed is None) else (seed or 0)
    row_bytes = sum((t.dtype.size or 64) * max(1, t.shape[1:].num_elements() or 1)
                    for t in examples.values())
    batches_per_chunk = int(max(1, min(256, _CHUNK_BYTES // max(1, row_bytes * batch_size))))
    tensors = dict(examples)
    finish = finish or (lambda batch: batch)

    def one_epoch(leftover: tf.Tensor, epoch: tf.Tensor):
        order = tf.range(num_examples, dtype=tf.int32)
        if shuffle:
            order = tf.random.experimental.stateless_shuffle(
                order, seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
        pool = tf.concat([leftover, order], axis=0)
        num_batches = tf.size(pool) // batch_size
        used = num_batches * batch_size
        return pool[used:], tf.reshape(pool[:used], [num_batches, batch_size])

    def gathered(chunk: tf.Tensor) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices(
            finish({name: tf.gather(t, chunk) for name, t in tensors.items()}))

    epochs = tf.data.Dataset.range(2**62 if repeat else 1)
    index_batches = epochs.scan(tf.zeros([0], tf.int32), one_epoch)
    return index_batches.flat_map(
        lambda matrix: tf.data.Dataset.from_tensor_slices(matrix).batch(batches_per_chunk)
        .flat_map(gathered))
