"""Host-side eval metrics: every eval example's outputs gathered on each host.

Metrics that are not a running Keras metric (F1 over the whole split, exact AUC,
BLEU, retrieval recall) need every example's outputs in one place. A Task that
overrides `Task.aggregate_eval` gets them: after the Keras-metrics eval, a second
pass runs `Task.eval_outputs` (by default the model's outputs, the labels and
the weights of a weighted split) over the eval split, through
`predict.gathered_steps`, the machinery of `Trainer.predict`:

* each example exactly once: padding rows (weight 0 in every position, e.g.
  `TFRecordInput(pad_remainder=True)`) are dropped before batching, the last
  step is topped up with masked rows, and every host runs the same (agreed)
  number of steps;
* in input order: one host's rows in its order; with several hosts, host 0's
  rows, then host 1's... (`predict.in_input_order`);
* on every host: each step's rows are gathered over all replicas of all hosts
  (`strategy.gather`), so every host holds the same arrays and calls
  `aggregate_eval` on them; it must be deterministic in them (no broadcast
  is needed for every host to log, select and stop on the same values).

With `Trainer.eval_steps` set, the pass reads the batches the Keras metrics read
(each host's first `eval_steps * local replicas`). A separate pass, not the eval
loop itself: the eval loop sums per-replica logs inside one compiled program,
whereas gathering rows needs a host round trip per step; the pass costs one more
forward over the split, paid only by a Task that overrides the hook.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import tensorflow as tf

from tputrain.data.stages import repeats_forever
from tputrain.loop.inputs import is_weighted
from tputrain.jobs.predict import gathered_steps, in_input_order
from tputrain.runtime.run_view import RunView
from tputrain.task import overrides



def with_aggregates(view: RunView, logs: dict[str, float], steps: int,
                    split: str = "eval") -> tuple[dict[str, float], int]:
    """The eval set `split`'s `logs` plus `Task.aggregate_eval`'s metrics over it
    (unchanged, and nothing gathered, when the Task does not override it); `steps`
    passes through."""
    task = view.task
    if not overrides(task, "aggregate_eval"):
        return logs, steps
    metrics = task.aggregate_eval(gather_eval(view, split))
    return {**logs, **checked_metrics(metrics, logs)}, steps


def gather_eval(view: RunView, split: str = "eval") -> dict[str, Any]:
    """`Task.eval_outputs` of every example of the eval set `split`, once, in order, as
    NumPy arrays with one row per example (floating ones float32; a nest keeps its
    structure)."""
    task, model = view.task, view.model
    dataset = view.inputs.dataset(split)
    if view.plan.options.eval_steps is not None:
        dataset = dataset.take(int(view.plan.options.eval_steps) * view.local_replicas)
    gathered, masks = gathered_steps(
        view, eval_examples(dataset),
        lambda example: task.eval_outputs(example["batch"], model),
        log_every=100, what="aggregate_eval", source="the eval split")
    structure = gathered[0]
    leaves = [in_input_order([tf.nest.flatten(step)[i] for step in gathered], masks,
                             view.num_hosts, dtype=None)
              for i in range(len(tf.nest.flatten(structure)))]
    return tf.nest.pack_sequence_as(structure, leaves)


def eval_examples(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Per-replica eval batches -> single examples `{"batch": (features, labels[,
    weights])}` (a dict, which tf.data passes whole), padding rows (weight 0 in
    every position) dropped."""
    if repeats_forever(dataset):
        raise ValueError("aggregate_eval: the eval split repeats forever: make it finite "
                         "or set Trainer.eval_steps")
    examples = dataset.unbatch()
    spec = dataset.element_spec
    if is_weighted(spec):
        examples = examples.filter(lambda f, l, w: tf.reduce_any(tf.not_equal(w, 0)))
    return examples.map(lambda *example: {"batch": example})


def checked_metrics(metrics: Any, logs: Mapping[str, float]) -> dict[str, float]:
    """`aggregate_eval`'s return as {name: float}, refusing names the eval has."""
    if not isinstance(metrics, Mapping):
        raise ValueError("Task.aggregate_eval must return a dict of metric names to "
                         f"numbers, got {type(metrics).__name__}")
    checked = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name or name.startswith("_"):
            raise ValueError(f"Task.aggregate_eval returned the metric name {name!r}: "
                             "use a non-empty string not starting with '_'")
        if name in logs:
            raise ValueError(f"Task.aggregate_eval returned {name!r}, which the eval "
                             "already reports (a loss or Keras metric): rename it")
        if np.size(value) != 1:
            raise ValueError(f"Task.aggregate_eval returned {name!r} = {value!r}: "
                             "a metric is one number")
        checked[name] = float(np.asarray(value).reshape(()))
    return checked
