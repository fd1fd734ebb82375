"""The eval loop: the same compiled host loop, no weight updates, agreed across hosts.

The eval iterator is created once and reused (freeing tf.data iterators can
block for seconds); each evaluation sees the same `eval_steps` batches, or the
whole finite eval split when eval_steps is None. Every host runs the same number
of steps (the most any host needs); hosts with fewer batches pad with
zero-weight batches, so uneven shards neither hang a pod nor skew the mean.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import keras
import tensorflow as tf
from absl import logging

from tputrain.core import tracing
from tputrain.data.batching import dropped_remainder
from tputrain.data.mixture import without_source_ids
from tputrain.loop.host_loop import HostLoop
from tputrain.loop.inputs import Inputs, is_weighted, padded, replicas_per_pipeline, with_weights
from tputrain.task import EVAL_REGULARIZATION, EVAL_WEIGHT, Task


def eval_means(totals: Mapping[str, Any], steps: int) -> dict[str, float]:
    """Per-step means of the eval logs; with padded batches, the loss is the mean
    over real examples (see `Task.eval_step`)."""
    totals = {name: float(value) for name, value in totals.items()}
    weight = totals.pop(EVAL_WEIGHT, None)
    regularization = totals.pop(EVAL_REGULARIZATION, 0.0)
    logs = {name: value / steps for name, value in totals.items()}
    if weight is not None and "loss" in totals:
        logs["loss"] = (totals["loss"] / weight if weight else float("nan")) + regularization / steps
    return logs


def is_padded(inputs: Inputs, dataset: tf.data.Dataset) -> bool:
    """Whether the eval batches carry weights, so a last step can be topped up with
    zero-weight batches (always with several hosts: `with_weights` adds them)."""
    return inputs.plan.batch.num_hosts > 1 or is_weighted(dataset.element_spec)


def local_steps(inputs: Inputs, split: str, eval_steps: int | None) -> int:
    """Steps this host's eval split fills: `eval_steps`, or all of its batches (the
    last step topped up with zero-weight batches when the split is padded), counted
    by reading the split to its end. The Trainer counts at start-up (a corrupt
    record anywhere in the split fails before training) and hands the count on."""
    if eval_steps is not None:
        return int(eval_steps)
    dataset = inputs.dataset(split)
    padded_split = is_padded(inputs, dataset)
    local = inputs.plan.batch.local_replicas
    count = int(dataset.reduce(tf.constant(0, tf.int64), tracing.graph_helper(lambda n, _: n + 1)))
    steps = -(-count // local) if padded_split else count // local
    if not padded_split:
        _warn_left_out(inputs, split, dataset, count % local)
    elif inputs.plan.batch.num_hosts > 1:  # padded across hosts; a host's own drop is not
        _warn_left_out(inputs, split, dataset, 0)
    if steps < 1 and inputs.plan.batch.num_hosts == 1:
        raise ValueError(
            f"the eval split has {count} per-replica batches, fewer than the "
            f"{local} local replicas (build_inputs({split!r}, ...)): use a smaller "
            "global batch, more eval data, or pad the eval split "
            "(TFRecordInput.pad_remainder)")
    return steps


def _warn_left_out(inputs: Inputs, split: str, dataset: tf.data.Dataset,
                   spare_batches: int) -> None:
    """One warning when a whole-split evaluation leaves examples out: the last partial
    batch a drop_remainder=True split dropped, and batches too few to fill a step's
    local replicas (`spare_batches`): how many, and how to keep them."""
    dropped = dropped_remainder(dataset)  # a second count of the split's records
    total, partial = dropped if dropped is not None else (None, 0)
    left_out = partial + spare_batches * inputs.plan.batch.per_replica
    if not left_out:
        return
    of = f" of the {total} examples" if total is not None else " examples"
    logging.warning(
        "tputrain: eval: the %r split left out %d%s it holds on this host (a last partial "
        "batch dropped by drop_remainder=True, or batches too few for every local "
        "replica): to evaluate them, build it with pad_remainder=True (TFRecordInput, "
        "TFDSInput), or batch without dropping and pad with tputrain.data.pad_to_batch",
        split, left_out, of)


class Evaluator:
    """`evaluate()` -> (metrics, eval steps run) over this host's eval split."""

    def __init__(self, task: Task, model: keras.Model, metrics: Sequence[keras.metrics.Metric],
                 inputs: Inputs, eval_steps: int | None, max_over_hosts: Callable[[int], int],
                 split: str = "eval"):
        self.task, self.model, self.metrics = task, model, list(metrics)
        self.inputs, self.split = inputs, split  # an eval set's name (Trainer.eval_splits)
        self.dataset = inputs.dataset(split)
        self.eval_steps = eval_steps
        self.max_over_hosts = max_over_hosts
        self._loop: Callable | None = None
        self._iterator = None
        self._batches = 0
        self._local: int | None = None  # this host's steps (`local_steps`), once counted

    @tracing.step_code
    def _replica_step(self, batch: Any) -> dict[str, tf.Tensor]:
        return tracing.user_call(self.task.eval_step, batch, self.model, self.metrics,
                                 self.inputs.plan.batch.global_batch_size)

    def count(self) -> None:
        """Counts this host's steps of the split now (`local_steps`), if not counted yet."""
        if self._local is None:
            self._local = local_steps(self.inputs, self.split, self.eval_steps)

    def _build(self) -> None:
        """Agrees on the eval step count across hosts; builds the eval iterator and loop."""
        inputs = self.inputs
        weighted = is_padded(inputs, self.dataset)
        self.count()
        self._batches = batches = self.max_over_hosts(self._local)

        def prepare(dataset: tf.data.Dataset, replicas: int) -> tf.data.Dataset:
            """`replicas` per-replica batches a step, `batches` steps, repeated."""
            return padded(with_weights(dataset) if weighted else dataset).take(
                batches * replicas).repeat()

        if inputs.plan.input_mode == "distributed":
            # As the host mode's dataset (`Inputs.build_dataset`): the model never gets
            # a mixture's source id.
            self._iterator = iter(inputs.strategy.distribute_datasets_from_function(
                lambda c: prepare(without_source_ids(self.task.build_inputs(
                    self.split, inputs.input_context(c))), replicas_per_pipeline(c))))
        else:
            self._iterator = iter(prepare(self.dataset, inputs.plan.batch.local_replicas))
        self._loop = HostLoop(self._replica_step, inputs, count_steps=False).loop

    def close(self) -> None:
        """Frees the eval iterator (and the loop that reads it) now."""
        self._loop, self._iterator = None, None

    def evaluate(self) -> tuple[dict[str, float], int]:
        if self._loop is None:
            self._build()
        for metric in self.metrics:
            metric.reset_state()
        totals, steps, _ = self._loop(self._iterator, tf.constant(self._batches, tf.int32))
        logs = eval_means(totals, int(steps))
        logs.update({m.name: float(m.result()) for m in self.metrics})
        return logs, int(steps)
