"""The user's side of training: model, inputs, loss, metrics and optimizer.

Subclass `Task` and override the `build_*` methods and `compute_loss`. The
`Trainer` owns everything else (strategy, compiled loops, checkpoints, logs).

Where each method runs:

* `build_model`, `build_metrics`, `build_optimizer`: once per host, in
  cross-replica context inside `strategy.scope()`, so variables are mirrored.
* `build_inputs`: once per host (per input pipeline), outside any replica
  context; it returns per-replica batches of `(features, labels)`.
* `compute_loss`, `train_step`, `eval_step`: inside `strategy.run`, i.e. in
  replica context, once per replica per step, traced into a `tf.function`.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import keras
import tensorflow as tf

from tputrain.optim import optimizers
from tputrain.core import tracing
from tputrain.core.builders import configured
from tputrain.data import InputContext
from tputrain.precision import to_float32

# Keys an eval step returns for padded batches (see `Task.eval_step`): summed like
# the loss, then used by the Trainer to average over real examples only.
EVAL_WEIGHT = "_eval_weight"
EVAL_REGULARIZATION = "_eval_regularization"


@tracing.graph_helper
def unpack_batch(batch: Any) -> tuple[Any, Any, tf.Tensor | None]:
    """`(features, labels)` or Keras `fit`'s `(features, labels, sample_weight)` ->
    `(features, labels, sample_weight or None)`."""
    features, labels, *weights = batch
    if len(weights) > 1:
        raise ValueError(f"a batch must be (features, labels) or (features, labels, "
                         f"sample_weight), got a tuple of {len(batch)}")
    return features, labels, (weights[0] if weights else None)


@tracing.graph_helper
def per_example_weights(weight: tf.Tensor, per_example: tf.Tensor) -> tf.Tensor:
    """`weight` as float32 of the per-example loss's rank: a `[batch, 1]` weight is
    squeezed (as Keras does), so that it never broadcasts to `[batch, batch]`."""
    weight = tf.cast(weight, tf.float32)
    if weight.shape.rank == per_example.shape.rank + 1 and weight.shape[-1] == 1:
        weight = tf.squeeze(weight, -1)
    return weight


@tracing.graph_helper
def average_loss(per_example: tf.Tensor, sample_weight: tf.Tensor | None,
                 global_batch_size: int | tf.Tensor) -> tf.Tensor:
    """sum(weight * loss) / global_batch_size: `tf.nn.compute_average_loss`'s sum and
    division, with its checks made here while tracing: its graph checks are Assert ops,
    which XLA drops with a TensorFlow warning line on every compile. A counted
    denominator (`Task.loss_denominator`, a tensor) divides the same sum."""
    if per_example.shape.rank == 0:  # compute_average_loss's own check, and message
        raise ValueError("Invalid value passed for `per_example_loss`. Expected a tensor with "
                         f"at least rank 1. Received per_example_loss={per_example} with rank 0")
    if not isinstance(global_batch_size, tf.Tensor) and (
            not isinstance(global_batch_size, numbers.Integral) or global_batch_size < 0):
        raise ValueError(f"global_batch_size must be a non-negative int, got {global_batch_size!r}")
    if sample_weight is not None:
        per_example = per_example * tf.cast(sample_weight, per_example.dtype)
    return tf.math.divide_no_nan(tf.reduce_sum(per_example),
                                 tf.cast(global_batch_size, per_example.dtype))


def overrides_train_step(task: "Task") -> bool:
    """Whether `task` replaces `Task.train_step`, in its class or on the instance: the
    one definition the step, the options' checks and the actions use."""
    return overrides(task, "train_step")


def overrides(task: "Task", name: str, base: type | None = None) -> bool:
    """Whether `task` replaces `<base>.<name>` (default `Task`), in its class or on the
    instance."""
    return getattr(type(task), name) is not getattr(base or Task, name) or name in vars(task)


class Task:
    """Base class for a training task; see the module docstring for contexts.

    `probe_train_inputs`: whether the Trainer may open throwaway iterators on the
    train split at start-up (one batch read to fail early on unreadable records, one
    to size the checkpointed iterator state). `KerasTask` sets False: every iterator
    of a user's dataset that reshuffles each iteration draws the next shuffle, so a
    probe would make training read other batches than `model.fit` does.

    `check_labels`: whether the labels of each split's first batch are checked at
    start-up (`tputrain.loop.labels`: finite, and class ids within the model's
    classes); False for a loss that masks such labels itself (an ignored class -1).
    """

    probe_train_inputs = True
    check_labels = True

    # The split names `build_inputs` knows ("train", "eval", named eval sets), when the
    # Task can list them: `Trainer.eval_splits` is checked against them at start-up and
    # an unknown name is refused listing them. None: not listed (a KeyError from
    # `build_inputs` naming an eval set is still one line).
    splits: tuple[str, ...] | None = None

    def build_model(self) -> keras.Model:
        """Returns the Keras model (strategy scope, precision policy already set)."""
        raise NotImplementedError("Task.build_model must return a keras.Model")

    def build_inputs(self, split: str, input_context: InputContext) -> tf.data.Dataset:
        """Returns this host's dataset of per-replica `(features, labels)` batches.

        `split` is "train" or "eval". `input_context.global_batch_size` is the
        Trainer's global batch; batch with `drop_remainder=True` so shapes stay
        static (TPUs need them; a ragged last batch also leaves replicas empty).
        For an eval split whose size is not a multiple of the batch, yield
        `(features, labels, weights)` with the last batch padded and weight 0 on
        the padding (`TFRecordInput(pad_remainder=True)` does this) so no
        example is dropped.
        A train split may yield `(features, labels, sample_weight)` batches, as
        Keras `fit` takes them: each example's loss and metrics are weighted.
        The train split should repeat forever; the eval split should be finite.
        """
        raise NotImplementedError("Task.build_inputs must return a tf.data.Dataset")

    def compute_loss(self, labels: Any, outputs: Any) -> tf.Tensor:
        """Returns the per-example loss, shape [per_replica_batch] (replica context).

        `outputs` arrive in float32 whatever the precision policy. Do not average:
        the Trainer divides by the *global* batch so gradients summed across
        replicas equal a single-device step.
        """
        raise NotImplementedError("Task.compute_loss must return a per-example loss")

    def loss_denominator(self, batch: Any) -> tf.Tensor | None:
        """What a summed loss is divided by, counted on this replica's batch; None
        (the default): examples, i.e. the global batch size.

        For a per-token loss over padded or packed rows, return this batch's real
        tokens, e.g. `tf.reduce_sum(loss_weights)` (an integer count): the Trainer
        sums it over replicas and micro-batches and passes the total to
        `compute_gradients` as `global_batch_size`, so the loss is the mean over the
        global batch's real tokens on 1 or N replicas, and the progress line shows
        real tokens/s and the padding share.
        """
        return None

    def build_metrics(self) -> Sequence[keras.metrics.Metric]:
        """Returns metrics updated with `(labels, outputs)` each step (strategy scope)."""
        return []

    def build_optimizer(self) -> keras.optimizers.Optimizer:
        """Returns the optimizer; by default `tputrain.build_optimizer()` (which takes
        gin's `build_optimizer.*` bindings when a config binds them)."""
        return configured("build_optimizer", optimizers.build_optimizer)()

    # Steps. Override these only for unusual training (GANs, several optimizers).

    def total_loss(self, labels: Any, outputs: Any, model: keras.Model,
                   global_batch_size: int, micro_batches: int = 1,
                   sample_weight: tf.Tensor | None = None) -> tf.Tensor:
        """Replica context: this replica's share of the global mean loss.

        With a `sample_weight` (a `(features, labels, sample_weight)` batch, or
        `Trainer.class_weight`) it is sum(weight * loss) / global batch, what Keras
        `fit` computes (reduction "sum_over_batch_size"). `compute_average_loss`
        divides by the global batch and
        `scale_regularization_loss` divides `model.losses` by the replica count, so
        summing over replicas gives exactly the single-device loss and gradients.
        Under gradient accumulation `micro_batches` > 1 also divides the
        regularization, which the step then sums once per micro-batch.
        """
        per_example = tf.cast(self.compute_loss(labels, outputs), tf.float32)
        _check_not_every_pair(per_example, labels, outputs)
        if sample_weight is not None:
            sample_weight = per_example_weights(sample_weight, per_example)
        loss = average_loss(per_example, sample_weight, global_batch_size)
        if model.losses:
            regularization = tf.add_n([tf.cast(l, tf.float32) for l in model.losses])
            loss += tf.nn.scale_regularization_loss(regularization) / micro_batches
        return loss

    def update_metrics(self, metrics: Sequence[keras.metrics.Metric], labels: Any,
                       outputs: Any, sample_weight: tf.Tensor | None = None) -> None:
        """Replica context: updates every metric with this replica's batch.

        `sample_weight` is the batch's weights when it has them (training sample
        weights or class weights; 0 on the padding rows of padded eval batches).
        """
        if sample_weight is not None:
            labels, outputs = _per_example_rows(labels, outputs, sample_weight)
        for metric in metrics:
            if sample_weight is None:
                metric.update_state(labels, outputs)
            else:
                metric.update_state(labels, outputs, sample_weight=sample_weight)

    def compute_gradients(self, batch: Any, model: keras.Model,
                          optimizer: keras.optimizers.Optimizer,
                          global_batch_size: int,
                          micro_batches: int = 1) -> tuple[list[Any], tf.Tensor, Any]:
        """Replica context: forward and backward on this replica's (micro-)batch.

        Returns `(gradients, loss, outputs)`: gradients of `optimizer.scale_loss(loss)`
        for `model.trainable_variables`. `scale_loss` is the Keras 3 loss scaling used
        by mixed_float16 (identity otherwise). Keep weight updates out of it: the
        Trainer may compile it alone with XLA (`jit_compile`), calls it once per
        micro-batch under gradient accumulation (passing `micro_batches`, the count,
        on to `total_loss`), and traces it to count FLOPs.
        """
        features, labels, weight = unpack_batch(batch)
        # Passed only when set, so a total_loss override without it still works.
        extra = {} if weight is None else {"sample_weight": weight}
        with tf.GradientTape() as tape:
            outputs = to_float32(model(features, training=True))
            loss = self.total_loss(labels, outputs, model, global_batch_size, micro_batches,
                                   **extra)
            scaled_loss = optimizer.scale_loss(loss)
        return tape.gradient(scaled_loss, model.trainable_variables), loss, outputs

    def flops_per_example(self) -> float | None:
        """Optional analytic training FLOPs (forward + backward) per example, for MFU.

        None (the default) lets the Trainer count them on the traced step.
        """
        return None

    def train_step(self, batch: Any, model: keras.Model,
                   optimizer: keras.optimizers.Optimizer,
                   metrics: Sequence[keras.metrics.Metric],
                   global_batch_size: int) -> dict[str, tf.Tensor]:
        """Replica context: forward, backward and update on this replica's batch.

        Returns per-replica values that the Trainer *sums* across replicas (the
        loss is already divided by the global batch, so the sum is the mean).
        `optimizer` is the Trainer's update pipeline around the Task's optimizer
        (`tputrain.loop.pipeline`): its `apply_gradients` sums the gradients over
        replicas, skips a non-finite update, unscales loss-scaled gradients and
        skips overflow steps; its other attributes are the optimizer's.
        Overriding this disables gradient accumulation and multi-replica XLA; to
        keep them, override `compute_gradients` instead.
        """
        gradients, loss, outputs = self.compute_gradients(batch, model, optimizer,
                                                          global_batch_size)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        _, labels, weight = unpack_batch(batch)
        self.update_metrics(metrics, labels, outputs,
                            **({} if weight is None else {"sample_weight": weight}))
        return {"loss": loss}

    def predict_step(self, features: Any, model: keras.Model) -> Any:
        """Replica context: what `Trainer.predict` returns for a batch of features;
        by default `model(features, training=False)`. Override to return probabilities,
        embeddings or a dict of several; floating outputs are then cast to float32."""
        return model(features, training=False)

    def eval_outputs(self, batch: Any, model: keras.Model) -> dict[str, Any]:
        """Replica context: what `aggregate_eval` receives of an eval batch, by default
        `{"outputs": model(features, training=False), "labels": labels}` plus
        `"weights"` for a `(features, labels, weights)` batch. Override to gather
        something else (probabilities, ids, features); floating values are cast to
        float32. Runs only when `aggregate_eval` is overridden."""
        features, labels, weight = unpack_batch(batch)
        gathered = {"outputs": model(features, training=False), "labels": labels}
        return gathered if weight is None else {**gathered, "weights": weight}

    def aggregate_eval(self, outputs: dict[str, Any]) -> dict[str, float]:
        """Host side, after each evaluation: metrics over the whole eval split, such as
        F1, exact AUC or BLEU, that running Keras metrics cannot compute.

        `outputs` holds `eval_outputs` of every eval example exactly once, in input
        order (host by host with several), padding removed, gathered across replicas
        and hosts: NumPy arrays, one row per example. Every host calls it on the same
        arrays, so keep it deterministic. Return {name: number}: reported with the
        eval logs (progress line, TensorBoard eval/, `Trainer.evaluate()`, actions'
        `on_eval_end`, `BestCheckpoint(metric=name)`). Not overridden (the default):
        nothing is gathered (tputrain/jobs/aggregation.py).
        """
        return {}

    def eval_step(self, batch: Any, model: keras.Model,
                  metrics: Sequence[keras.metrics.Metric],
                  global_batch_size: int) -> dict[str, tf.Tensor]:
        """Replica context: forward pass and metric updates, no weight change.

        A batch `(features, labels, weights)` (padded eval, see
        `TFRecordInput.pad_remainder`) is weighted: padding rows count for nothing.
        Then the data loss and `EVAL_WEIGHT`, the batch's share of real examples,
        are returned apart, and the Trainer reports the mean over real examples.
        """
        features, labels, *weights = batch
        outputs = to_float32(model(features, training=False))
        if not weights:
            loss = self.total_loss(labels, outputs, model, global_batch_size)
            self.update_metrics(metrics, labels, outputs)
            return {"loss": loss}
        (weight,) = weights
        per_example = tf.cast(self.compute_loss(labels, outputs), tf.float32)
        weight = per_example_weights(weight, per_example)
        data_loss = average_loss(per_example, weight, global_batch_size)
        logs = {"loss": data_loss,
                EVAL_WEIGHT: tf.reduce_sum(weight) / global_batch_size}
        if model.losses:
            regularization = tf.add_n([tf.cast(l, tf.float32) for l in model.losses])
            logs[EVAL_REGULARIZATION] = tf.nn.scale_regularization_loss(regularization)
        self.update_metrics(metrics, labels, outputs, sample_weight=weight)
        return logs


def _per_example_rows(labels: Any, outputs: Any, sample_weight: tf.Tensor) -> tuple[Any, Any]:
    """Labels and outputs with a last axis of 1 when they have the weights' rank (a
    head squeezed to [batch], per-token outputs [batch, T]): Keras's metric functions
    reduce the last axis, which would then be the batch (or the tokens) the weights
    are of, so a weighted update fails to broadcast, or averages over the padding."""
    if not all(isinstance(t, tf.Tensor) for t in (labels, outputs, sample_weight)):
        return labels, outputs
    rank = sample_weight.shape.rank
    if rank is None or outputs.shape.rank != rank or labels.shape.rank != rank:
        return labels, outputs
    return labels[..., tf.newaxis], outputs[..., tf.newaxis]


def _check_not_every_pair(per_example: tf.Tensor, labels: Any, outputs: Any) -> None:
    """Refuses the common slip of a 1-unit head: outputs [b, 1] and labels [b] broadcast
    to a [b, b] loss of every pair, which trains, silently, on the wrong loss."""
    tensors = (per_example, labels, outputs)
    if not all(isinstance(t, tf.Tensor) and t.shape.rank is not None for t in tensors):
        return  # nested, or of unknown rank (e.g. a py_function's)
    shapes = [t.shape.as_list() for t in tensors]
    loss, label, output = shapes
    if len(label) == 1 and label[0] and label[0] > 1 and output == [label[0], 1] and (
            loss == [label[0], label[0]]):
        raise ValueError(
            f"compute_loss returned a loss of shape {loss} from labels {label} and outputs "
            f"{output}: they broadcast to every pair of the batch; give each example one loss "
            "(squeeze the outputs, tf.squeeze(outputs, -1), or expand the labels, "
            "labels[:, None]): it must be of shape [batch]")
