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
A model whose weights are all reached keeps its checkpoint exactly as before. (Keras's
seed generators, hidden the same way, have their own root: `seeds.py`.)
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.integrity import VARIABLE_SUFFIX
from tputrain.checkpointing.seeds import seed_generator_states

ROOT = "model_variables"


def model_trackables(model: keras.Model, reading: str | None = None) -> dict[str, Any]:
    """{"model": model}, and ROOT with the weights the object graph misses, if any:
    what every checkpoint that holds the model saves or reads.

    `reading`: a checkpoint to read the model alone from (export, side-car, audit).
    One without ROOT is read without it (`_read_without_root`).
    """
    reached = {id(obj) for obj in tf.train.TrackableView(model).descendants()}
    reached.update(id(state) for state in seed_generator_states(model))  # saved as "seeds"
    missed = {f"variable_{index}": variable for index, variable in enumerate(model.variables)
              if id(variable) not in reached}
    if missed and reading is not None:
        reader = tf.train.load_checkpoint(reading)
        if not any(key.startswith(f"{ROOT}/") for key in reader.get_variable_to_shape_map()):
            _read_without_root(model, list(missed.values()), reader, reading)
            missed = {}
    if not missed:
        return {"model": model}
    holder = tf.Module(name=ROOT)
    for name, variable in missed.items():
        setattr(holder, name, variable)
    return {"model": model, ROOT: holder}


def _read_without_root(model: keras.Model, missed: list[Any], reader: Any, path: str) -> None:
    """A checkpoint without ROOT (written before it existed, or by a model without such
    layers): the missed trainable weights are read from the optimizer's references to
    the model's trainable variables, where it has them with their shapes; the others
    keep their values, with a warning naming them."""
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
            "in a list or dict: it was written before tputrain saved them, or by a model "
            "without them); they keep their current values", path, ", ".join(kept))
