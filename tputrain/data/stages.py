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
