"""Every weight of the model in its checkpoints, those TensorFlow's object graph misses.

Why: Keras 3 on TensorFlow keeps a layer's list and dict attributes in its own
`TrackedList`/`TrackedDict`, which TensorFlow's checkpoints do not traverse. A
subclassed model's `self.blocks = [Block(), ...]` then saved none of its blocks'
weights under "model": their trainable weights were saved only as the optimizer's
references (a resume got them back, an export, the eval side-car and fine-tuning,
which read the model alone, did not), and their non-trainable ones (BatchNorm's
moving statistics) not at all, so a resumed run reset them silently.

`model_trackables` adds a second root, "model_variables", holding the weights the
object graph does not reach from the model, each named by its place in
`model.variables` (the order the model's code builds them in, which a rebuilt model
repeats; Keras's paths are not stable: a second instance is "model_1/...").
A model whose weights are all reached keeps every checkpoint key it had. (Keras's
seed generators, hidden the same way, have their own root: `seeds.py`.)
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.integrity import VARIABLE_SUFFIX, object_graph
from tputrain.checkpointing.seeds import seed_generator_states

ROOT = "model_variables"


def model_trackables(model: keras.Model, reading: str | None = None) -> dict[str, Any]:
    """{"model": model, ROOT: the weights the object graph misses}: what every
    checkpoint that holds the model saves or reads.

    ROOT is there even when it holds nothing: a node without values, which changes
    no checkpoint key and which TensorFlow's restores pass over either way, but
    which tells a checkpoint that had nothing to hold from one written before ROOT
    existed (`has_root`). `reading`: a checkpoint to read the model alone from
    (export, side-car, audit); one without ROOT is read without it
    (`_read_without_root`).
    """
    reached = {id(obj) for obj in tf.train.TrackableView(model).descendants()}
    reached.update(id(state) for state in seed_generator_states(model))  # saved as "seeds"
    missed = {f"variable_{index}": variable for index, variable in enumerate(model.variables)
              if id(variable) not in reached}
    if missed and reading is not None:
        reader = tf.train.load_checkpoint(reading)
        if not has_root(reader):
            _read_without_root(model, list(missed.values()), reader, reading)
            return {"model": model}
    holder = tf.Module(name=ROOT)
    for name, variable in missed.items():
        setattr(holder, name, variable)
    return {"model": model, ROOT: holder}


def has_root(reader: Any) -> bool:
    """Whether the checkpoint `reader` reads was written with ROOT (held weights or not)."""
    return any(child.local_name == ROOT for child in object_graph(reader).nodes[0].children)


def _read_without_root(model: keras.Model, missed: list[Any], reader: Any, path: str) -> None:
    """A checkpoint without ROOT (written before it existed): the missed trainable
    weights are read from the optimizer's references to the model's trainable
    variables, where it has them with their shapes; the others keep their values,
    with a warning naming them."""
    shapes = reader.get_variable_to_shape_map()
    place = {id(v): n for n, v in enumerate(model.trainable_variables)}
    kept = []
    for variable in missed:
        key = f"optimizer/_trainable_variables/{place.get(id(variable))}{VARIABLE_SUFFIX}"
        if id(variable) in place and tuple(shapes.get(key, ())) == tuple(variable.shape):
            variable.assign(reader.get_tensor(key))
        else:
            kept.append(variable.path)
    if kept:
        logging.warning(
            "tputrain: %s holds no value for %s (weights of layers a subclassed model keeps "
            "in a list or dict: it was written before tputrain saved them); they keep their "
            "current values", path, ", ".join(kept))


def model_paths(model: keras.Model) -> dict[int, str]:
    """{id(variable): its path from the model's checkpoint roots ("model/conv/_kernel")}:
    where a checkpoint of this architecture holds each weight, whatever its name."""
    from tensorflow.python.checkpoint import graph_view  # pylint: disable=import-outside-toplevel
    root = tf.train.Checkpoint(**model_trackables(model))
    objects, paths = graph_view.ObjectGraphView(root).breadth_first_traversal()
    return {id(obj): "/".join(ref.name for ref in paths[obj]) for obj in objects
            if isinstance(obj, (tf.Variable, keras.Variable))}
