"""Positional input: one host's records as a function of its position, so a resume
rebuilds the stream where it stood instead of re-reading what came before.

The records are read in blocks (`tputrain.data.blocks`: K records of one file,
from a byte offset). Each epoch e all blocks are permuted by a stateless shuffle of
(seed, e); that order is cut into windows of S = `window_blocks` * K records (the
epoch's last window holds the rest), numbered on over the epochs. A window is read
as a parallel interleave of the block pieces it spans, and its records are
permuted by a stateless shuffle of (seed, window): a window shuffle instead of a
shuffle buffer. Which windows a host reads, and where it stands after E examples
consumed, is the ledger's arithmetic (`tputrain.data.ledger`: host h of H reads
windows h, h + H, ...; a host-count change carries partly read windows over), so
the stream from any position is: the window holding it, its first records
skipped, then every later window of the host. Nothing depends on what was read
before: a rebuild re-reads at most one window, and finding it is constant time.

Shuffle spread: a record moves within its window (S records) and the blocks
move anywhere in the epoch, where a shuffle buffer of the same size moves a
record at most that far from its place in the file interleave.

TF 2.21: `TFRecordDatasetV2` (the reader with `byte_offsets`) works only built
inside `flat_map`/`interleave`: as the pipeline's top-level source its graph
serialization drops `byte_offsets` and the iterator fails ("3 inputs specified of
4 inputs"). Here it is always inside `interleave` (`_piece`;
tests/data/test_positional.py pins the bug: when that test fails, TF has fixed it).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tputrain.core import tracing
from tputrain.data.blocks import Blocks
from tputrain.data.empty_input import NO_BATCH, EmptyInputError
from tputrain.data.ledger import Ledger, Position, Windows
from tputrain.data.packed_rows import Place, window_rows

_READ_BUFFER = 256 * 1024  # bytes a block reader buffers (tf.data's TFRecord default)
_ENDLESS = 2**62  # windows of a repeated stream: as good as for ever
_EPOCH_KEY, _WINDOW_KEY = 0, 1  # which shuffle a stateless seed is for


def _seed(seed: int, index: tf.Tensor, kind: int) -> tf.Tensor:
    """The stateless seed of one shuffle: (user seed, index x kind). No host in it: a
    window carried over to another host is read in the same order there."""
    return tf.stack([tf.constant(seed, tf.int64), tf.cast(index, tf.int64) * 2 + kind])


class PositionalRecords:
    """One host's serialized records of a block table, from any position.

    Args:
        blocks: the data's blocks (`tputrain.data.blocks.block_table`).
        num_hosts, host: the input pipelines and this one (`InputContext`).
        seed: the shuffles' seed (an int: the order is a function of it).
        window_blocks: blocks' worth of records permuted together (S = C * K).
        shuffle: False reads the blocks in file order, no permutation.
        compression: the files' compression (None, "GZIP", "ZLIB").
        read_parallelism: block pieces of a window read at once.
    """

    def __init__(self, blocks: Blocks, *, num_hosts: int = 1, host: int = 0, seed: int = 0,
                 window_blocks: int = 16, shuffle: bool = True, compression: str | None = None,
                 read_parallelism: int = 1):
        records = blocks.num_records
        window = min(int(window_blocks * blocks.counts.max(initial=0)), records)
        if not records or math.ceil(records / window) < num_hosts:
            raise EmptyInputError(
                f"positional input: the data has {records} record(s), "
                f"{math.ceil(records / window) if records else 0} window(s) of {window} an "
                f"epoch, fewer than the {num_hosts} input pipelines, so a pipeline {NO_BATCH} "
                "in a pass: write more data, or smaller blocks (or fewer window_blocks)")
        self.blocks, self.host, self.num_hosts = blocks, host, num_hosts
        self.seed, self.shuffle, self.compression = int(seed), shuffle, compression or ""
        self.window_blocks, self.read_parallelism = window_blocks, read_parallelism
        self.windows = Windows(window, records)
        self.epoch_records = records  # all hosts' records an epoch
        self.window_records = window

    def ledger(self, history: Sequence[tuple[int, ...]] = ()) -> Ledger:
        """The ledger after `history` ((examples consumed, hosts) per host count; empty:
        this object's hosts from the start)."""
        ledger = Ledger.replay(self.windows, history or ((0, self.num_hosts),))
        if ledger.hosts != self.num_hosts:
            raise ValueError(f"positional input: the layout history ends with "
                             f"{ledger.hosts} host(s), this input has {self.num_hosts}")
        return ledger

    def block_order(self, epoch: tf.Tensor | int) -> tf.Tensor:
        """Epoch `epoch`'s order of the blocks (indices into the block table)."""
        count = tf.range(len(self.blocks.counts), dtype=tf.int64)
        if not self.shuffle:
            return count
        return tf.random.experimental.stateless_shuffle(
            count, seed=_seed(self.seed, epoch, _EPOCH_KEY))

    def locate(self, position: int, ledger: Ledger | None = None) -> Position:
        """This host's place after `position` of its records (counted from the
        ledger's start): constant time, whatever `position`."""
        return (ledger or self.ledger()).locate(self.host, int(position))

    def dataset(self, position: int = 0, repeat: bool = True,
                ledger: Ledger | None = None) -> tf.data.Dataset:
        """This host's records from `position` on (counted from `ledger`'s start; the
        default ledger: this layout from the start). Without `repeat`, one pass:
        the host's windows of the first epoch."""
        if position < 0:
            raise ValueError(f"positional input: position {position} is negative")
        ledger = ledger or self.ledger()
        place = self.locate(position, ledger)
        per_epoch = self.windows.per_epoch
        pieces = [(w, skip) for w, skip in place.pieces if repeat or w < per_epoch]
        in_pass = max(0, -(-(per_epoch - ledger.fresh_window(self.host, 0)) // ledger.hosts))
        ends = _ENDLESS if repeat else max(place.k, in_pass)  # fresh windows of epoch 0
        if not repeat and not pieces and place.k >= in_pass:
            raise ValueError(f"positional input: position {position} is past this "
                             "host's records of a single pass")
        fresh = tf.data.Dataset.range(place.k, ends).map(
            lambda k: (ledger.fresh_window(self.host, 0) + k * ledger.hosts,
                       tf.where(k == place.k, tf.constant(place.skip, tf.int64), 0)))
        if pieces:
            windows, skips = zip(*pieces)
            fresh = tf.data.Dataset.from_tensor_slices(
                (tf.constant(windows, tf.int64), tf.constant(skips, tf.int64))
            ).concatenate(fresh)
        return fresh.flat_map(tracing.graph_helper(
            lambda window, skip: self._window(window).skip(skip)))

    def rows(self, to_rows: Callable[[tf.data.Dataset], tf.data.Dataset], place: Place = (0, 0),
             repeat: bool = True, ledger: Ledger | None = None) -> tf.data.Dataset:
        """This host's rows from `place` (`tputrain.data.packed_rows`): each of its
        windows' records through `to_rows` (parse and `to_static`) on its own."""
        ledger = ledger or self.ledger()
        if ledger.fresh or ledger.start:
            raise ValueError(
                "positional input with to_static: the run's input was split over another "
                "host count before (rows are not records: their places are not carried over "
                "to other hosts yet): resume on the host count it started with, or set "
                "positional=False")
        per_epoch = self.windows.per_epoch
        in_pass = -(-(per_epoch - self.host) // self.num_hosts)
        return window_rows(lambda w: to_rows(self._window(w)), self.host, self.num_hosts,
                           place, repeat, in_pass)

    def _pieces(self, index: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """(file, byte offset, first record, records to skip, records to take) of each
        block piece window `index` spans, in its epoch's block order."""
        per_epoch = self.windows.per_epoch
        order = self.block_order(index // per_epoch)
        sizes = tf.gather(tf.constant(self.blocks.counts), order)
        ends = tf.cumsum(sizes)
        begins = ends - sizes
        low = (index % per_epoch) * self.window_records
        high = tf.minimum(low + self.window_records, self.epoch_records)
        keep = (ends > low) & (begins < high)
        ids, begins, ends = (tf.boolean_mask(t, keep) for t in (order, begins, ends))
        skip = tf.maximum(low - begins, 0)
        take = tf.minimum(high, ends) - begins - skip
        return tuple(tf.gather(tf.constant(column), ids) for column in (
            self.blocks.file_index, self.blocks.offsets, self.blocks.first)) + (skip, take)

    def _window(self, index: tf.Tensor) -> tf.data.Dataset:
        """Window `index`'s records: its block pieces interleaved, then permuted."""
        cycle = self.window_blocks + 1 if self.shuffle else 1  # unshuffled: block by block
        calls = self.read_parallelism  # at most the cycle (tf.data's rule), or AUTOTUNE
        records = tf.data.Dataset.from_tensor_slices(self._pieces(index)).interleave(
            tracing.graph_helper(self._piece), cycle_length=cycle,
            num_parallel_calls=calls if calls == tf.data.AUTOTUNE else min(calls, cycle),
            deterministic=True)
        if not self.shuffle:
            return records
        seed = _seed(self.seed, index, _WINDOW_KEY)
        return records.batch(self.window_records).map(tracing.graph_helper(
            lambda batch: tf.gather(batch, tf.random.experimental.stateless_shuffle(
                tf.range(tf.shape(batch)[0]), seed=seed)))).unbatch()

    def _piece(self, file_index: tf.Tensor, offset: tf.Tensor, first: tf.Tensor,
               skip: tf.Tensor, take: tf.Tensor) -> tf.data.Dataset:
        """Records of one block: from its byte offset (or, compressed, its record index),
        `skip` of them passed (at the record level: cheap), `take` read."""
        path = tf.gather(tf.constant(self.blocks.files), file_index)
        if self.compression:
            return tf.data.TFRecordDataset(path, self.compression).skip(first + skip).take(take)
        variant = tf.raw_ops.TFRecordDatasetV2(
            filenames=tf.reshape(path, [1]), compression_type="",
            buffer_size=tf.constant(_READ_BUFFER, tf.int64), byte_offsets=tf.reshape(offset, [1]))
        return tf.data.experimental.from_variant(
            variant, tf.TensorSpec([], tf.string)).skip(skip).take(take)
