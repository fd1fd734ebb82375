"""Walking a tf.data pipeline's stages, for the checks that read what a pipeline does.

tf.data has no public API for this: it reads private `Dataset` attributes
(`_inputs`, `_functions`), kept in this one place.
"""

from __future__ import annotations

from typing import Iterator

import tensorflow as tf
from tensorflow.core.framework import node_def_pb2


def dataset_stages(dataset: tf.data.Dataset
                   ) -> Iterator[tuple[tf.data.Dataset, list[node_def_pb2.NodeDef]]]:
    """Each stage from the output up (each once), with every node of its functions,
    nested ones included."""
    stack, seen = [dataset], set()
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        nodes: list[node_def_pb2.NodeDef] = []
        for wrapper in current._functions():  # pylint: disable=protected-access
            graph = wrapper.function.graph.as_graph_def()
            nodes += graph.node
            for function in graph.library.function:
                nodes += function.node_def
        yield current, nodes
        stack.extend(current._inputs())  # pylint: disable=protected-access


ENDLESS_RANGE = 2**40  # a Dataset.range this long stands for "forever" (2**62 in tputrain.data)


def _range_size(stage: tf.data.Dataset) -> int | None:
    """The elements of a `Dataset.range` stage (None: another stage, or not static)."""
    if type(stage).__name__ != "_RangeDataset":
        return None
    bounds = [tf.get_static_value(getattr(stage, name, None)) for name in ("_start", "_stop", "_step")]
    if any(bound is None for bound in bounds) or not bounds[2]:
        return None
    start, stop, step = (int(bound) for bound in bounds)
    return max(0, -(-(stop - start) // step))


def repeats_forever(dataset: tf.data.Dataset) -> bool:
    """Whether reading `dataset` never ends: tf.data says so, or, where it reports the
    length as unknown (a repeat of a filtered pipeline), an endless `repeat()` stage or
    a `Dataset.range` of ENDLESS_RANGE or more (tputrain's epochs), not bounded by a
    `take()` after it."""
    cardinality = int(dataset.cardinality())
    if cardinality != int(tf.data.UNKNOWN_CARDINALITY):
        return cardinality == int(tf.data.INFINITE_CARDINALITY)
    stack = [dataset]
    while stack:
        current = stack.pop()
        count = tf.get_static_value(getattr(current, "_count", None))
        if type(current).__name__ == "_TakeDataset" and count is not None and count >= 0:
            continue  # bounded from here up
        if type(current).__name__ == "_RepeatDataset" and count is not None and count < 0:
            return True
        if (_range_size(current) or 0) >= ENDLESS_RANGE:
            return True
        stack.extend(current._inputs())  # pylint: disable=protected-access
    return False
