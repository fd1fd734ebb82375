"""Exact per-source example counts of a weighted mixture's training, checkpointed.

A `MixtureInput` tags each example with its source's index (`source_id`), which
packing repeats on every token of the example. The train step takes the id out
of the features before the Task sees them (the model never gets it), counts the
examples of each source in the replica's batch (packed rows: each segment once),
and logs the counts; the host loop sums them over replicas (every host's too,
as it sums the step's other logs) and over the loop's steps, and `record` adds
them to running totals in a variable the checkpoint holds, so a resumed run
continues them. The progress line and TensorBoard (`examples/<source>`) show
the totals. A dataset that is no mixture gets no counter: nothing changes.

A positional input's packed rows (`tputrain.data.packed_rows`) carry tags the
same way: the step strips them and sums, per host, the rows trained on, the
windows they ended and those windows' rows; the totals (in the checkpoint)
give each host's place in its rows, where a resume builds the input.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import tensorflow as tf

from tputrain.data.mixture import MixtureSources, without_source
from tputrain.data.packed_rows import ROW_KEYS, Place, places, row_sums
from tputrain.data.packing import SEGMENT_IDS
from tputrain.observe.progress import SOURCE_PREFIX

COUNTS_LOG = "source_examples"  # the step's log: int32 [sources], examples of each
TAG_PREFIX = SOURCE_PREFIX  # the cumulative counts' log and TensorBoard tag: examples/<name>
ROWS_LOG = "row_sums"  # the step's log: int32 [hosts, 3], `packed_rows.row_sums`


def has_row_tags(element_spec: Any) -> bool:
    """Batches of a positional input's packed rows (`tputrain.data.packed_rows`)."""
    return (isinstance(element_spec, tuple) and bool(element_spec)
            and isinstance(element_spec[0], Mapping) and all(k in element_spec[0] for k in ROW_KEYS))


def count_examples(features: Mapping[str, tf.Tensor], key: str, num_sources: int) -> tf.Tensor:
    """int32 [num_sources]: the examples of each source in a batch (any leading axes).

    Packed rows (an id a token, beside `segment_ids`) count a segment once, where
    it starts (its id differs from the previous token's); padding (segment 0) is
    none. Unpacked examples (an id each) count once each. Ops XLA compiles.
    """
    ids = tf.cast(features[key], tf.int32)
    segments = features.get(SEGMENT_IDS)
    if segments is not None and segments.shape.rank == ids.shape.rank and ids.shape.rank:
        before = tf.pad(segments[..., :-1], [[0, 0]] * (segments.shape.rank - 1) + [[1, 0]])
        starts = tf.cast((segments > 0) & (segments != before), tf.int32)
    else:
        starts = tf.ones_like(ids)
    each = tf.one_hot(ids, num_sources, dtype=tf.int32) * starts[..., None]
    return tf.reduce_sum(tf.reshape(each, [-1, num_sources]), axis=0)


class SourceCounter:
    """The running per-source totals of a mixture's training and the step's count;
    a positional input's packed rows: the per-host row sums (`row_hosts` hosts)."""

    def __init__(self, sources: MixtureSources | None, row_hosts: int = 0):
        self.names = sources.names if sources else ()
        self.source_key = sources.key if sources else None
        self.key = ((self.source_key,) if sources else ()) + (ROW_KEYS if row_hosts else ())
        # Plain variables (not mirrored): the host adds the global counts after each
        # loop, the same on every host.
        self.examples = tf.Variable(tf.zeros([len(self.names)], tf.int64), trainable=False,
                                    name="source_examples") if sources else None
        # Of any host count: a checkpoint of another one restores, and the input says
        # what it cannot do there (rows are not carried over to other hosts yet).
        self.row_hosts = row_hosts
        self.rows = tf.Variable(tf.zeros([row_hosts, 3], tf.int64), trainable=False,
                                shape=tf.TensorShape([None, 3]),
                                name="row_sums") if row_hosts else None

    def counting(self, step: Callable[[Any], dict[str, tf.Tensor]]
                 ) -> Callable[[Any], dict[str, tf.Tensor]]:
        """The replica step on the batch without the source id, logging its counts."""
        def counted(batch: Any) -> dict[str, tf.Tensor]:
            stripped = without_source(batch, self.key)
            if stripped is batch:  # no ids (a stand-in batch): nothing to count
                return step(batch)
            logs = dict(step(stripped))
            if self.examples is not None:
                logs[COUNTS_LOG] = count_examples(batch[0], self.source_key, len(self.names))
            if self.rows is not None:
                logs[ROWS_LOG] = row_sums(batch[0], self.row_hosts)
            return logs
        return counted

    def record(self, totals: dict[str, Any]) -> None:
        """Takes a loop's summed counts (`HostLoop.run`) out of `totals` into the totals."""
        counts, rows = totals.pop(COUNTS_LOG, None), totals.pop(ROWS_LOG, None)
        if counts is not None:
            self.examples.assign_add(tf.cast(counts, tf.int64))
        if rows is not None:
            self.rows.assign_add(tf.cast(rows, tf.int64))

    def row_places(self) -> tuple[Place, ...]:
        """Each host's place in its packed rows (none without them)."""
        return places(self.rows.numpy()) if self.rows is not None else ()

    def logs(self) -> dict[str, float]:
        """The running totals as logs: `examples/<name>`."""
        if self.examples is None:
            return {}
        return {f"{TAG_PREFIX}{name}": float(count)
                for name, count in zip(self.names, self.examples.numpy())}


def checkpointed(counter: SourceCounter | None) -> dict[str, tf.Variable]:
    """The checkpoint's trackables of a mixture's counts and packed rows' sums: none
    without them."""
    if counter is None:
        return {}
    return {name: variable for name, variable in (
        ("source_examples", counter.examples), ("row_sums", counter.rows)) if variable is not None}


def source_logs(counter: SourceCounter | None) -> dict[str, float]:
    """The loop's logs of a mixture's counts (`SourceCounter.logs`): none without one."""
    return {} if counter is None else counter.logs()
