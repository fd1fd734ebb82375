"""Labels checked at the first batch: a non-finite or out-of-range class id is one line.

A float label column with a NaN trained without a word: sparse cross-entropy casts
labels to integers, so the NaN became some class; an id past the model's classes
fails on a CPU but gathers garbage on accelerators. The pre-flight already reads
the first batch of each split (`tputrain.runtime.validate.probe_inputs`); its labels are
checked here on the host, once the model says how many classes it has: the cost
is a NumPy pass over one batch of labels, nothing per step.

What is checked, for labels paired with a model output (one label tensor and one
output, or a dict of each by name):

* a float label must be finite, whatever the loss (a NaN or inf label makes the
  loss NaN, or a class of its own);
* labels shaped as class ids of an output with C >= 2 classes on its last axis
  (the output's shape without that axis, or with 1 there), integers or floats that
  are all whole numbers, must lie in [0, C) (other floats are targets of a loss of
  the Task's own, e.g. weights or regression values).

The error names the feature (the builder's `label_key`, or the label's key) and,
for data read by `TFRecordInput`, the first record in file order holding such a
value (`tputrain.data.feature_check.locate_value`). A Task whose loss masks such
labels (an ignored class of -1, NaN for "missing") sets `check_labels = False`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import tensorflow as tf

from tputrain.data.feature_check import locate_value


class LabelError(ValueError):
    """A label of the first batch cannot be what the model's loss reads."""


def check_first_labels(first_batches: Mapping[str, Any], model: Any, task: Any,
                       inputs: Any) -> None:
    """Checks the labels of each split's first batch (`first_batches`, what the
    pre-flight read) against `model`'s outputs; raises `LabelError`. `inputs`: the
    Trainer's `Inputs` (the splits' label keys; the train split's stacked
    micro-batches with gradient accumulation)."""
    if not getattr(task, "check_labels", True):
        return
    outputs = _output_shapes(model)
    for split, batch in first_batches.items():
        if not (isinstance(batch, tuple) and len(batch) >= 2):
            continue  # no labels
        lead = 2 if split == "train" and inputs.plan.batch.accumulation_steps > 1 else 1
        for name, label, shape in _pairs(batch[1], outputs, inputs.label_keys.get(split)):
            _check(split, name, np.asarray(label), _classes(np.shape(label), shape, lead))


def _output_shapes(model: Any) -> Any:
    """The model's output shapes (batch first), as a list or dict; None if unknown
    (a subclassed model before it is called)."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    if not outputs:
        return None
    names = getattr(model, "output_names", None)
    shapes = [tuple(output.shape) for output in outputs]
    return dict(zip(names, shapes)) if names and len(names) == len(shapes) else shapes


def _pairs(labels: Any, outputs: Any, label_key: str | None) -> list[tuple[str, Any, Any]]:
    """(the name an error gives, label values, the paired output's shape or None)."""
    if isinstance(labels, Mapping):
        shapes = outputs if isinstance(outputs, Mapping) else {}
        return [(repr(name), value, shapes.get(name)) for name, value in labels.items()]
    if not isinstance(labels, (tf.Tensor, np.ndarray)):
        return [(repr(label_key or "labels"), value, None) for value in tf.nest.flatten(labels)]
    single = (list(outputs.values()) if isinstance(outputs, Mapping) else outputs or [])
    shape = single[0] if len(single) == 1 else None
    return [(repr(label_key) if label_key else "'labels'", labels, shape)]


def _classes(label_shape: tuple, output_shape: Any, lead: int) -> int | None:
    """The class count when labels of `label_shape` (`lead` batch dimensions: 2 for
    stacked micro-batches) are class ids of an output of `output_shape`, else None."""
    if output_shape is None or len(output_shape) < 2:
        return None
    classes, per_example = output_shape[-1], list(output_shape[1:-1])
    if classes is None or classes < 2:
        return None
    shape = list(label_shape)
    if shape and shape[-1] == 1 and (not per_example or per_example[-1] != 1):
        shape = shape[:-1]
    return classes if shape[lead:] == per_example and len(shape) == lead + len(per_example) \
        else None


def _check(split: str, name: str, values: np.ndarray, classes: int | None) -> None:
    """Raises `LabelError` for the first bad value of one label tensor."""
    if values.dtype.kind not in "fiu":
        return
    checks: list[tuple[Callable[[np.ndarray], np.ndarray], str]] = []
    if values.dtype.kind == "f":
        checks.append((lambda v: ~np.isfinite(v),
                       "a non-finite label: the loss becomes NaN or casts it to some class"))
    if classes is not None and (values.dtype.kind != "f" or _whole(values)):
        checks.append((lambda v: ~np.isfinite(v) | (v < 0) | (v >= classes) | (v != np.floor(v)),
                       f"not a class id of the model's {classes} outputs (0 to {classes - 1})"))
    for is_bad, why in checks:
        bad = np.flatnonzero(is_bad(values))
        if bad.size:
            value = values.reshape(-1)[bad[0]].item()
            raise LabelError(_message(split, name, value, why, is_bad))


def _whole(values: np.ndarray) -> bool:
    """Whether float labels are all whole numbers (or non-finite), as class ids are:
    other floats are the targets of a loss of the Task's own, not class ids."""
    finite = values[np.isfinite(values)]
    return bool(np.all(finite == np.floor(finite)))


def _message(split: str, name: str, value: Any, why: str,
             is_bad: Callable[[np.ndarray], np.ndarray]) -> str:
    found = locate_value(name.strip("'"), is_bad) if name != "'labels'" else None
    where = (f" (first such record: {found[0]}, record {found[1]})" if found else "")
    return (f"the {split} data's label feature {name} holds {value} in its first batch"
            f"{where}: {why}: fix the data, or set check_labels = False on the Task if its "
            "loss masks such labels")
