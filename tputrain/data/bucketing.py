"""Bucketing by length: batches of similar lengths, each padded to its bucket's length.

Between padding everything to the longest and packing: examples are grouped by
length into a few buckets (tf.data's own `bucket_by_sequence_length`), and a
batch is padded only to its bucket's length, so short examples waste less.
The cost is shape: a batch's length is one of the bucket lengths, not one
static shape, so the element spec's length is unknown (None) and a compiled
step traces one program per bucket. tputrain's Trainer compiles one program
and refuses dynamic shapes; train it with packing (`PackSequences`), which
needs one shape and wastes the least. Bucketing suits evaluation or a custom
loop that compiles per bucket.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import tensorflow as tf

from tputrain.data.packing import (LOSS_WEIGHTS, POSITIONS, SEGMENT_IDS, check_length,
                                   check_same_lengths, sequence_features)


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    lengths = [check_length("bucket_by_length", n) for n in lengths]
    if not lengths or lengths != sorted(set(lengths)):
        raise ValueError(f"bucket_by_length: lengths must be increasing bucket lengths, e.g. "
                         f"[64, 128, 256], got {lengths!r}")
    return lengths


def bucket_by_length(dataset: tf.data.Dataset, lengths: Sequence[int], batch_size: int,
                     keys: Iterable[str] | None = None) -> tf.data.Dataset:
    """Batches examples by length; each batch is padded to its bucket's length.

    Args:
        dataset: unbatched dicts of rank-1 features (those in `keys` if given)
            and scalars.
        lengths: the bucket lengths, increasing; an example goes to the
            shortest bucket it fits, and one longer than the last is truncated.
        batch_size: examples a batch (partial batches are dropped).
        keys: the features to bucket; None: every rank-1 feature.

    Returns batches of `[batch_size, L]` features with L one of `lengths`,
    plus `segment_ids`, `positions` and `loss_weights` as in packing.
    """
    where = "bucket_by_length"
    lengths = _check_lengths(lengths)
    sequences, scalars = sequence_features(dataset.element_spec, keys, where)
    longest = lengths[-1]

    def truncate(example):
        n = tf.minimum(tf.cast(check_same_lengths(example, sequences, where), tf.int32), longest)
        row = {name: example[name] for name in scalars}
        row.update({name: example[name][:longest] for name in sequences})
        row[SEGMENT_IDS] = tf.ones([n], tf.int32)
        row[POSITIONS] = tf.range(n, dtype=tf.int32)
        row[LOSS_WEIGHTS] = tf.ones([n], tf.float32)
        return row

    # A boundary b holds lengths < b, padded to b - 1: so b = bucket length + 1.
    return dataset.map(truncate).bucket_by_sequence_length(
        element_length_func=lambda row: tf.shape(row[SEGMENT_IDS])[0],
        bucket_boundaries=[n + 1 for n in lengths],
        bucket_batch_sizes=[batch_size] * (len(lengths) + 1),
        pad_to_bucket_boundary=True, drop_remainder=True)
