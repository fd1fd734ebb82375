"""Padding or truncating variable-length sequences to one fixed length: the simple baseline.

Every example becomes one row of `length` positions: shorter ones are padded
with 0, longer ones truncated (their tail is lost). It costs a whole row per
example whatever its length, so the share of real tokens is the mean length
over `length`; packing (`tputrain.data.packing`) spends nearly every position
on real tokens and loses none. The rows carry the same `segment_ids`,
`positions` and `loss_weights` as packed ones (one segment a row), so a model
written for packing reads them unchanged.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import tensorflow as tf

from tputrain.data.packing import (LOSS_WEIGHTS, POSITIONS, SEGMENT_IDS, check_length,
                                   check_same_lengths, sequence_features)


def pad_sequences(dataset: tf.data.Dataset, length: int,
                  keys: Iterable[str] | None = None) -> tf.data.Dataset:
    """Pads (with 0) or truncates each example's rank-1 features to `length`.

    Args:
        dataset: unbatched dicts of rank-1 features (those in `keys` if given,
            of one length within an example) and scalars (kept as they are).
        length: positions a row.
        keys: the features to pad; None pads every rank-1 feature.

    Returns examples of `{feature: [length], "segment_ids", "positions",
    "loss_weights": [length]}` plus the scalars, all statically shaped.
    """
    where = "pad_sequences"
    length = check_length(where, length)
    sequences, scalars = sequence_features(dataset.element_spec, keys, where)
    index = tf.range(length, dtype=tf.int32)

    def pad(example):
        n = tf.minimum(tf.cast(check_same_lengths(example, sequences, where), tf.int32), length)
        row = {name: example[name] for name in scalars}
        for name in sequences:
            kept = example[name][:length]
            row[name] = tf.ensure_shape(tf.pad(kept, [[0, length - tf.size(kept)]]), [length])
        real = index < n
        row[SEGMENT_IDS] = tf.cast(real, tf.int32)
        row[POSITIONS] = tf.where(real, index, 0)
        row[LOSS_WEIGHTS] = tf.cast(real, tf.float32)
        return row

    return dataset.map(pad)


class PadSequences:
    """`pad_sequences` as a `TFRecordInput(to_static=...)` transform (gin-bindable).

    Args:
        length: positions a row; longer examples are truncated.
        keys: features to pad; None pads every rank-1 feature.
    """

    def __init__(self, length: int, keys: Sequence[str] | None = None):
        self.length = check_length("PadSequences", length)
        self.keys = None if keys is None else tuple([keys] if isinstance(keys, str) else keys)

    def __call__(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        return pad_sequences(dataset, self.length, self.keys)

    def __repr__(self) -> str:
        return f"PadSequences({self.length}, keys={self.keys})"
