"""Positional input: one host's records as a function of its position, so a resume
rebuilds the stream where it stood instead of re-reading what came before.

The records are read in blocks (`tputrain.data.blocks`: K records of one file,
from a byte offset). Host h of H owns blocks h, h + H, h + 2H, ... of the table
(every host reads every file, and the fewer-files-than-hosts case needs no record
sharding). Each epoch e the host's blocks are permuted by a stateless shuffle of
(seed, e, h); consecutive groups of `window_blocks` blocks form windows; a window
is read as a parallel interleave of its blocks and its records are permuted by a
stateless shuffle of (seed, window, h): a window shuffle instead of a shuffle
buffer. Nothing depends on what was read before, so the stream from position p
(records this host consumed) is: the window holding p, its first records
skipped, then every later window. Finding that window costs one epoch's block
order, whatever p is: a rebuild re-reads at most one window.

Shuffle spread: a record moves within its window (C * K records) and the blocks
move anywhere in the epoch, where a shuffle buffer of the same size moves a
record at most that far from its place in the file interleave.

TF 2.21: `TFRecordDatasetV2` (the reader with `byte_offsets`) works only built
inside `flat_map`/`interleave`: as the pipeline's top-level source its graph
serialization drops `byte_offsets` and the iterator fails ("3 inputs specified of
4 inputs"). Here it is always inside `interleave` (tests/test_positional.py pins it).
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tputrain.loop import tracing
from tputrain.data.blocks import Blocks
from tputrain.data.empty_input import NO_BATCH, EmptyInputError

_READ_BUFFER = 256 * 1024  # bytes a block reader buffers (tf.data's TFRecord default)
_ENDLESS = 2**62  # windows of a repeated stream: as good as for ever
_EPOCH_KEY, _WINDOW_KEY = 0, 1  # which shuffle a stateless seed is for


def _seed(seed: int, index: tf.Tensor, host: int, hosts: int, kind: int) -> tf.Tensor:
    """The stateless seed of one shuffle: (user seed, index x host x kind)."""
    key = (tf.cast(index, tf.int64) * hosts + host) * 2 + kind
    return tf.stack([tf.constant(seed, tf.int64), key])


class PositionalRecords:
    """One host's serialized records of a block table, from any position.

    Args:
        blocks: the data's blocks (`tputrain.data.blocks.block_table`).
        num_hosts, host: the input pipelines and this one (`InputContext`).
        seed: the shuffles' seed (an int: the order is a function of it).
        window_blocks: blocks whose records are permuted together (C).
        shuffle: False reads the host's blocks in file order, no permutation.
        compression: the files' compression (None, "GZIP", "ZLIB").
        read_parallelism: blocks of a window read at once.
    """

    def __init__(self, blocks: Blocks, *, num_hosts: int = 1, host: int = 0, seed: int = 0,
                 window_blocks: int = 16, shuffle: bool = True, compression: str | None = None,
                 read_parallelism: int = 1):
        own = np.arange(len(blocks.counts), dtype=np.int64)[host::num_hosts]
        if not len(own) or not blocks.counts[own].sum():
            raise EmptyInputError(
                f"positional input: the data has {len(blocks.counts)} block(s) of records, "
                f"none for input pipeline {host} of {num_hosts}, so it {NO_BATCH}: write "
                "more data, or smaller blocks")
        self.blocks, self.host, self.num_hosts = blocks, host, num_hosts
        self.seed, self.shuffle, self.compression = int(seed), shuffle, compression or ""
        self.window_blocks, self.read_parallelism = window_blocks, read_parallelism
        self._own = own
        self.epoch_records = int(blocks.counts[own].sum())  # this host's records an epoch
        self.windows = math.ceil(len(own) / window_blocks)  # this host's windows an epoch
        self.window_records = int(window_blocks * blocks.counts.max())

    def block_order(self, epoch: tf.Tensor | int) -> tf.Tensor:
        """Epoch `epoch`'s order of this host's blocks (indices into its own blocks)."""
        count = tf.range(len(self._own), dtype=tf.int64)
        if not self.shuffle:
            return count
        return tf.random.experimental.stateless_shuffle(
            count, seed=_seed(self.seed, epoch, self.host, self.num_hosts, _EPOCH_KEY))

    def locate(self, position: int) -> tuple[int, int]:
        """(window index counted from the first epoch, records to skip in it) of the
        record at host position `position`: one epoch's block order, whatever `position`."""
        epoch, within = divmod(int(position), self.epoch_records)
        order = self.block_order(epoch).numpy()
        sizes = self.blocks.counts[self._own[order]]
        ends = np.cumsum(np.add.reduceat(sizes, np.arange(0, len(sizes), self.window_blocks)))
        window = int(np.searchsorted(ends, within, side="right"))
        return epoch * self.windows + window, within - (int(ends[window - 1]) if window else 0)

    def dataset(self, position: int = 0, repeat: bool = True) -> tf.data.Dataset:
        """The records from host position `position` on (one epoch without `repeat`)."""
        if position < 0:
            raise ValueError(f"positional input: position {position} is negative")
        if not repeat and position >= self.epoch_records:
            raise ValueError(f"positional input: position {position} is past the "
                             f"{self.epoch_records} records of a single pass")
        start, skip = self.locate(position)
        windows = tf.data.Dataset.range(start, _ENDLESS if repeat else self.windows)
        records = windows.flat_map(tracing.graph_helper(self._window))
        return records.skip(skip) if skip else records

    def _window(self, index: tf.Tensor) -> tf.data.Dataset:
        """Window `index`'s records: its blocks interleaved, then permuted."""
        epoch, window = index // self.windows, index % self.windows
        begin = window * self.window_blocks
        chosen = self.block_order(epoch)[begin:begin + self.window_blocks]
        ids = tf.gather(tf.constant(self._own), chosen)
        table = tuple(tf.gather(tf.constant(column), ids) for column in (
            self.blocks.file_index, self.blocks.offsets, self.blocks.first, self.blocks.counts))
        records = tf.data.Dataset.from_tensor_slices(table).interleave(
            tracing.graph_helper(self._block),
            cycle_length=self.window_blocks if self.shuffle else 1,
            num_parallel_calls=self.read_parallelism, deterministic=True)
        if not self.shuffle:
            return records
        seed = _seed(self.seed, index, self.host, self.num_hosts, _WINDOW_KEY)
        return records.batch(self.window_records).map(tracing.graph_helper(
            lambda batch: tf.gather(batch, tf.random.experimental.stateless_shuffle(
                tf.range(tf.shape(batch)[0]), seed=seed)))).unbatch()

    def _block(self, file_index: tf.Tensor, offset: tf.Tensor, first: tf.Tensor,
               count: tf.Tensor) -> tf.data.Dataset:
        """One block's records: from its byte offset (or, compressed, its record index)."""
        path = tf.gather(tf.constant(self.blocks.files), file_index)
        if self.compression:
            return tf.data.TFRecordDataset(path, self.compression).skip(first).take(count)
        variant = tf.raw_ops.TFRecordDatasetV2(
            filenames=tf.reshape(path, [1]), compression_type="",
            buffer_size=tf.constant(_READ_BUFFER, tf.int64), byte_offsets=tf.reshape(offset, [1]))
        return tf.data.experimental.from_variant(
            variant, tf.TensorSpec([], tf.string)).take(count)
