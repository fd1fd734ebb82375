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
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import tensorflow as tf

from tputrain.data.mixture import MixtureSources
from tputrain.data.packing import SEGMENT_IDS
from tputrain.observe.progress import SOURCE_PREFIX

COUNTS_LOG = "source_examples"  # the step's log: int32 [sources], examples of each
TAG_PREFIX = SOURCE_PREFIX  # the cumulative counts' log and TensorBoard tag: examples/<name>


def without_source(batch: Any, key: str) -> Any:
    """`(features, labels, ...)` (tensors or specs) with `features[key]` left out."""
    if not (isinstance(batch, tuple) and batch and isinstance(batch[0], Mapping)
            and key in batch[0]):
        return batch
    return ({name: value for name, value in batch[0].items() if name != key}, *batch[1:])


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
    """The running per-source totals of a mixture's training and the step's count."""

    def __init__(self, sources: MixtureSources):
        self.names, self.key = sources.names, sources.key
        # A plain variable (not mirrored): the host adds the global counts after each
        # loop, the same on every host.
        self.examples = tf.Variable(tf.zeros([len(self.names)], tf.int64), trainable=False,
                                    name="source_examples")

    def counting(self, step: Callable[[Any], dict[str, tf.Tensor]]
                 ) -> Callable[[Any], dict[str, tf.Tensor]]:
        """The replica step on the batch without the source id, logging its counts."""
        def counted(batch: Any) -> dict[str, tf.Tensor]:
            stripped = without_source(batch, self.key)
            if stripped is batch:  # no ids (a stand-in batch): nothing to count
                return step(batch)
            logs = step(stripped)
            return {**logs, COUNTS_LOG: count_examples(batch[0], self.key, len(self.names))}
        return counted

    def record(self, totals: dict[str, Any]) -> None:
        """Takes a loop's summed counts (`HostLoop.run`) out of `totals` into the totals."""
        counts = totals.pop(COUNTS_LOG, None)
        if counts is not None:
            self.examples.assign_add(tf.cast(counts, tf.int64))

    def logs(self) -> dict[str, float]:
        """The running totals as logs: `examples/<name>`."""
        return {f"{TAG_PREFIX}{name}": float(count)
                for name, count in zip(self.names, self.examples.numpy())}


def checkpointed(counter: SourceCounter | None) -> dict[str, tf.Variable]:
    """The checkpoint's trackables of a mixture's counts: none without a mixture."""
    return {} if counter is None else {"source_examples": counter.examples}


def source_logs(counter: SourceCounter | None) -> dict[str, float]:
    """The loop's logs of a mixture's counts (`SourceCounter.logs`): none without one."""
    return {} if counter is None else counter.logs()
