"""Is it the right state, and is it sound: another model's checkpoint named as
such (not taken for a corrupt one), and NaN/Inf never saved."""

from __future__ import annotations

import re
from typing import Any, Iterable

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.core.protobuf import trackable_object_graph_pb2

from tputrain.core import tracing
from tputrain.checkpointing.input_layout import KEY as LAYOUT_KEY

# Keys every TF2 checkpoint has besides the objects it saves (the input layout:
# older checkpoints lack it, and it describes the run, it is not restored).
GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"  # a TF2 checkpoint's object graph
# The actions' own state (Action.checkpoint_state): restored where both the run and the
# checkpoint have it, never a reason to call a checkpoint another model's.
ACTION_STATE = "action_state"
_BOOKKEEPING_KEYS = (GRAPH_KEY, "save_counter/", f"{LAYOUT_KEY}/", f"{ACTION_STATE}/")
VARIABLE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
SHOW = 6  # mismatches listed in an error message


class CheckpointMismatchError(ValueError):
    """The checkpoint in model_dir was written by a different model or pipeline."""


class InputLayoutError(CheckpointMismatchError):
    """The checkpoint's data position has no equivalent under this run's input layout."""


class NonFiniteStateError(FloatingPointError):
    """Refusing to checkpoint variables that hold NaN or Inf."""


def object_graph(reader: Any) -> trackable_object_graph_pb2.TrackableObjectGraph:
    """The object graph of the checkpoint `reader` reads (a TF2 checkpoint's)."""
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(GRAPH_KEY))
    return graph


def root_names(reader: Any) -> set[str]:
    """The names of the objects a checkpoint's root holds (model, optimizer, step...)."""
    return {child.local_name for child in object_graph(reader).nodes[0].children}


def _is_variable(obj: Any) -> bool:
    return isinstance(obj, (tf.Variable, keras.Variable))


def _fits(saved: tuple[int, ...], shape: tuple[int | None, ...]) -> bool:
    """A saved shape fits a variable's (a None dimension takes any size: a positional
    input's per-host row sums, whatever the host count that wrote them)."""
    return len(saved) == len(shape) and all(d is None or d == s for s, d in zip(saved, shape))


def _expected_entries(checkpoint: tf.train.Checkpoint) -> dict[str, tuple[Any, str]] | None:
    """{checkpoint key: (shape or None, readable name)} of what `checkpoint` saves.

    Variables get their exact key; other saveables (the data iterator) a key
    prefix ending in "/.ATTRIBUTES/". Uses TF's object-graph traversal (the one
    `save` uses); returns None if that private API changes, which only loses the
    friendly mismatch message.
    """
    try:
        from tensorflow.python.checkpoint import graph_view
        from tensorflow.python.trackable import base as trackable_base

        objects, paths = graph_view.ObjectGraphView(checkpoint).breadth_first_traversal()
    except Exception as error:  # noqa: BLE001 - a private API; degrade gracefully
        logging.debug("tputrain: cannot list checkpoint keys (%s)", error)
        return None
    entries: dict[str, tuple[Any, str]] = {}
    for obj in objects:
        path = "/".join(ref.name for ref in paths[obj])
        if not path:
            continue
        if _is_variable(obj):
            name = getattr(obj, "path", None) or getattr(obj, "name", path)
            entries[path + VARIABLE_SUFFIX] = (tuple(obj.shape), str(name).removesuffix(":0"))
        elif (type(obj)._serialize_to_tensors
              is not trackable_base.Trackable._serialize_to_tensors):
            entries[path + "/.ATTRIBUTES/"] = (None, path)
    return entries


def describe_mismatch(checkpoint: tf.train.Checkpoint, path: str,
                      ignore: tuple[str, ...] = ()) -> str:
    """'' if `path` holds what `checkpoint` saves, else the differences in words
    (keys starting with `ignore`, data state left out on a layout change, aside)."""
    expected = _expected_entries(checkpoint)
    if expected is None:
        return ""
    # save_counter exists once this object has saved: bookkeeping, not state to match.
    skip = _BOOKKEEPING_KEYS + ignore
    expected = {k: v for k, v in expected.items() if not k.startswith(skip)}
    reader = tf.train.load_checkpoint(path)
    shapes = reader.get_variable_to_shape_map()
    saved = {k: tuple(v) for k, v in shapes.items() if not k.startswith(skip)}
    problems, matched = [], set()
    for key, (shape, name) in expected.items():
        if shape is None:  # a non-variable saveable: any key under its prefix
            hits = [k for k in saved if k.startswith(key)]
            matched.update(hits)
            if not hits:
                problems.append(f"{name} is not in the checkpoint")
            continue
        if key not in saved:
            problems.append(f"{name} {list(shape)} is not in the checkpoint")
            continue
        matched.add(key)
        if not _fits(saved[key], shape):
            problems.append(f"{name}: checkpoint has shape {list(saved[key])}, "
                            f"this model {list(shape)}")
    extra = [k for k in saved if k not in matched]
    problems += [f"{k.removesuffix(VARIABLE_SUFFIX)} {list(saved[k])} is in the checkpoint "
                 "but not in this model" for k in extra]
    if not problems:  # the same shapes: another optimizer with the same slots?
        return _optimizer_renamed(checkpoint, reader)
    more = f" (and {len(problems) - SHOW} more)" if len(problems) > SHOW else ""
    return _optimizer_change(expected, saved) + "; ".join(problems[:SHOW]) + more


_OPTIMIZER_SLOTS = "optimizer/_variables/"


def _optimizer_change(expected: dict[str, Any], saved: dict[str, Any]) -> str:
    """A clause saying the optimizer itself differs, where its state variables do not
    number the same: its slots pair by position, so the shapes listed after it would
    read as a change of the model."""
    ours = sum(key.startswith(_OPTIMIZER_SLOTS) for key in expected)
    theirs = sum(key.startswith(_OPTIMIZER_SLOTS) for key in saved)
    # Everything else, the optimizer's own references to the weights included.
    model = {k: v for k, v in expected.items() if not k.startswith(_OPTIMIZER_SLOTS)}
    rest = [k for k in saved if not k.startswith(_OPTIMIZER_SLOTS)]
    model_matches = (
        all(any(k == e or (shape is None and k.startswith(e)) for e, (shape, _) in model.items())
            for k in rest)
        and all(any(k.startswith(e) for k in rest) if shape is None
                else e in saved and _fits(saved[e], shape) for e, (shape, _) in model.items()))
    if ours == theirs or not model_matches:  # (a changed model changes the slots too)
        return ""
    return (f"the optimizer differs from the checkpoint's: the checkpoint's holds {theirs} "
            f"variables, this one {ours} (another optimizer, or other options: momentum, "
            "EMA, ...): resume with the optimizer the run trained with, or use a new "
            "model_dir. In detail: ")


def _optimizer_renamed(checkpoint: tf.train.Checkpoint, reader: Any) -> str:
    """The optimizer's change where its slots match (Adam and LAMB both keep two a
    weight): Keras names its variables after it (`adam/iteration`), and the
    checkpoint keeps those names. '' when they agree, or either is unknown."""
    optimizer = getattr(checkpoint, "optimizer", None)
    ours = _optimizer_names(v.path for v in getattr(optimizer, "variables", ())
                            if isinstance(getattr(v, "path", None), str))
    theirs = _optimizer_names(attribute.full_name for node in object_graph(reader).nodes
                              for attribute in node.attributes
                              if attribute.checkpoint_key.startswith("optimizer/"))
    if not ours or not theirs or ours == theirs:
        return ""
    return (f"the optimizer differs from the checkpoint's: it was {', '.join(map(repr, theirs))}, "
            f"this run's is {', '.join(map(repr, ours))}: resume with the optimizer the run "
            "trained with, or use a new model_dir (tputrain.InitCheckpoint starts a new run "
            "from these weights)")


def _optimizer_names(paths: Iterable[str]) -> list[str]:
    """The optimizers' names in their step counters' paths ("adam/iteration"), less
    the "_1" Keras adds to a second one of a kind in a process."""
    return sorted({re.sub(r"_\d+$", "", path.rsplit("/", 1)[0]) for path in paths
                   if path.endswith("/iteration")})


def _float_variables(trackables: Iterable[Any]) -> list[Any]:
    """The floating-point variables of the saved objects (for the finite check)."""
    found, seen = [], set()

    def add(variable):
        if id(variable) not in seen and variable.dtype in (tf.float16, tf.bfloat16,
                                                           tf.float32, tf.float64):
            seen.add(id(variable))
            found.append(variable)

    for obj in trackables:
        if _is_variable(obj):
            add(obj)
        elif isinstance(obj, (list, tuple)):
            found_inner = _float_variables(obj)
            for variable in found_inner:
                add(variable)
        elif hasattr(obj, "variables") and not callable(obj.variables):
            for variable in obj.variables:
                if _is_variable(variable):
                    add(variable)
    return found


@tracing.graph_helper
def _every_value_finite(variables: list[Any]) -> tf.Tensor:
    """Whether every value of every variable is finite, element by element.

    Not the guard's checks (`tputrain.fault_tolerance.guard`), whose float32 sums (of squares)
    overflow for large finite weights (or one float64 weight above 3.4e38),
    which for a gradient is as bad, but here would refuse to save a good state.
    """
    if not variables:
        return tf.constant(True)
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(v)))
                          for v in variables])


class FiniteCheck:
    """Whether the float variables of what is saved are all finite (one compiled check)."""

    def __init__(self, trackables: Iterable[Any]):
        self.variables = _float_variables(trackables)
        self._finite_fn = tf.function(
            tracing.graph_helper(lambda: _every_value_finite(self.variables)))

    def __call__(self) -> bool:
        return bool(self._finite_fn())

    def non_finite(self) -> list[str]:
        """The names of the variables that hold NaN/Inf (read on the host)."""
        return [str(getattr(v, "path", v.name)) for v in self.variables
                if not np.all(np.isfinite(np.asarray(v)))]
