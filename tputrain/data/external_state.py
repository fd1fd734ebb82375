"""State an input pipeline keeps outside tf.data, which an iterator checkpoint cannot hold.

Stateful random ops (`tf.random.uniform`, `tf.image.random_*`), Keras random
preprocessing layers (their SeedGenerator is a `tf.Variable`) and Python code
(`tf.py_function`, `Dataset.from_generator`) make tf.data refuse to save the
iterator: `FailedPreconditionError: RandomUniform is stateful [Op:SerializeIterator]`
at the first checkpoint. `checkpointable` finds them before that and, unless
`InputOptions.external_state_policy` chose otherwise, saves the iterator without
them and says once what will not resume exactly. Augmentation that resumes
exactly: `tputrain.data.stateless_augment`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import tensorflow as tf
from absl import logging
from tensorflow.core.framework import node_def_pb2, types_pb2
from tensorflow.python.framework import op_def_registry

from tputrain.data.stages import dataset_stages

_POLICY = tf.data.experimental.ExternalStatePolicy
# Stateful ops tf.data saves anyway (Assert), or whose bodies hold any state and are
# walked instead (control flow, calls).
_ALLOWED = frozenset({"Assert", "If", "While", "StatefulPartitionedCall"})
_RANDOM_OPS = frozenset({"TruncatedNormal", "Multinomial", "ParameterizedTruncatedNormal",
                         "RngSkip", "RngReadAndSkip", "NonDeterministicInts"})
# Datasets whose iterators tf.data cannot save under any policy ("... does not support
# checkpointing"): `Dataset.from_generator` makes a GeneratorDataset in a flat_map.
_UNSAVEABLE_DATASETS = frozenset({"GeneratorDataset"})


class InputStateError(ValueError):
    """The pipeline holds unsaveable state and `external_state_policy` is "fail"."""


@dataclasses.dataclass(frozen=True)
class ExternalState:
    """The ops holding unsaveable state, by kind: {op type: name scopes}."""

    random: dict[str, list[str]]
    variables: dict[str, list[str]]
    python: dict[str, list[str]]

    def __bool__(self) -> bool:
        return bool(self.random or self.variables or self.python)

    def describe(self) -> str:
        """One clause a kind: the ops and the name scopes (layers) they sit in."""
        def ops(found: dict[str, list[str]]) -> str:
            scopes = sorted({scope for names in found.values() for scope in names})
            return f"{', '.join(sorted(found))} (in {', '.join(scopes)})"
        parts = []
        if self.random:
            parts.append(f"stateful random ops {ops(self.random)}")
        if self.variables:
            parts.append(f"variables, such as a Keras random layer's SeedGenerator: "
                         f"{ops(self.variables)}")
        if self.python:
            parts.append(f"Python code (py_function, from_generator): {ops(self.python)}")
        return "; ".join(parts)

    def on_resume(self) -> str:
        """What a run resumed from a checkpoint saved without this state does."""
        if self.python:
            return ("restarts the Python code's state: a generator starts again from its "
                    "first element, so neither the data order nor the draws resume exactly")
        return ("reads the data from the saved position (order and shuffle buffers exact) "
                "but draws other random numbers than an uninterrupted run: the augmentation "
                "does not resume exactly")


def _kind(op: str) -> str:
    """Which clause of the warning an op belongs to: what a resume does not replay."""
    if "Random" in op or op.startswith("Stateful") or op in _RANDOM_OPS:
        return "random"
    if op.endswith("VariableOp") or op.startswith("ResourceGather"):
        return "variables"
    return "python"


def _candidate(op_type: str) -> bool:
    """Stateful as tf.data's check sees it: not datasets (variant outputs), tables,
    asserts or control flow (their branches are looked at instead)."""
    op_def = op_def_registry.get(op_type)
    if op_def is None or not op_def.is_stateful or op_type in _ALLOWED:
        return False
    if op_type.startswith("Lookup"):
        return False
    return not all(arg.type == types_pb2.DT_VARIANT for arg in op_def.output_arg)


def _function_nodes(dataset: tf.data.Dataset) -> Iterator[node_def_pb2.NodeDef]:
    """Every node of every function of `dataset` and its inputs, nested ones included."""
    for _, nodes in dataset_stages(dataset):
        yield from nodes


def _saveable(dataset: tf.data.Dataset) -> bool:
    """tf.data's own verdict (serializes the pipeline's graph, constants included)."""
    try:
        dataset._as_serialized_graph(  # pylint: disable=protected-access
            external_state_policy=_POLICY.FAIL)
    except tf.errors.FailedPreconditionError:
        return False
    return True


def external_state(dataset: tf.data.Dataset,
                   nodes: list[node_def_pb2.NodeDef] | None = None) -> ExternalState:
    """The state an iterator checkpoint of `dataset` cannot hold (empty if none).

    The functions are read first (cheap; `nodes`: their nodes, already read); only if
    they hold a stateful op is tf.data asked, since its check serializes in-memory
    data too.
    """
    found: dict[str, dict[str, list[str]]] = {"random": {}, "variables": {}, "python": {}}
    for node in _function_nodes(dataset) if nodes is None else nodes:
        if _candidate(node.op):
            scope = node.name.split("/")[0]
            scopes = found[_kind(node.op)].setdefault(node.op, [])
            if scope not in scopes:
                scopes.append(scope)
    state = ExternalState(**found)
    if state and _saveable(dataset):
        return ExternalState({}, {}, {})
    return state


def unsaveable_dataset(dataset: tf.data.Dataset,
                       nodes: list[node_def_pb2.NodeDef] | None = None) -> str | None:
    """The first stage of `dataset` whose iterator tf.data cannot save at all (its op
    type, e.g. "GeneratorDataset"), or None; read from the pipeline's functions
    (`nodes`, if already read), no element read."""
    for node in _function_nodes(dataset) if nodes is None else nodes:
        if node.op in _UNSAVEABLE_DATASETS:
            return node.op
    return None


def not_checkpointable(kind: str, split: str = "train") -> InputStateError:
    """The error for a host-mode input whose iterator cannot be saved (`kind`)."""
    return InputStateError(
        f"the {split} input pipeline cannot be checkpointed ({kind}; Dataset.from_generator "
        "makes a GeneratorDataset), so a resumed run could not continue from its data "
        "position: build it from tensors (from_tensor_slices) or files (TFRecordInput), "
        "or use Trainer.input_mode='distributed', which resumes by skipping batches")


def checkpointable(dataset: tf.data.Dataset, split: str = "train") -> tf.data.Dataset:
    """`dataset`, set to be saved without its unsaveable state (one warning saying
    what will not resume), unless `external_state_policy` was set: "warn" and
    "ignore" are kept, "fail" raises `InputStateError` here instead of at the save.
    A stage no policy lets tf.data save (`unsaveable_dataset`) raises it here too."""
    nodes = list(_function_nodes(dataset))  # read once for both checks
    kind = unsaveable_dataset(dataset, nodes)
    if kind is not None:
        raise not_checkpointable(kind, split)
    policy = dataset.options().experimental_external_state_policy
    if policy in (_POLICY.WARN, _POLICY.IGNORE):
        return dataset
    state = external_state(dataset, nodes)
    if not state:
        return dataset
    if policy == _POLICY.FAIL:
        raise InputStateError(
            f"the {split} input pipeline holds state tf.data cannot checkpoint "
            f"({state.describe()}) and InputOptions.external_state_policy is 'fail': "
            "make its random ops stateless with tputrain.data.stateless_augment, or set "
            "external_state_policy to None or 'ignore' to save the iterator without that state")
    logging.warning(
        "tputrain: the %s input pipeline holds state tf.data cannot checkpoint: %s. "
        "Checkpoints save its iterator without that state: a resumed run %s. For "
        "augmentation that "
        "resumes exactly, draw with tf.image.stateless_random_* / tf.random.stateless_* "
        "under tputrain.data.stateless_augment (docs/input_pipeline.md).",
        split, state.describe(), state.on_resume())
    options = tf.data.Options()
    options.experimental_external_state_policy = _POLICY.IGNORE
    return dataset.with_options(options)
