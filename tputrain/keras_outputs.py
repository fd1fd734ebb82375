"""A compiled Keras model's losses, loss weights and metrics, paired with its outputs as
Keras's `compile` pairs them, for `KerasTask`.

One output: the loss, and every metric, are that output's. Several outputs (a
functional model returning a list or a dict): `loss` is one loss for every output, a
list (by position) or a dict (by output name, an output without a loss left out);
`loss_weights` a list or dict the same way; `metrics` and `weighted_metrics` a list
with one entry per output or a dict by output name, each entry a metric or a list of
them. Labels and sample weights come as a list (by position) or a dict (by name), or
one sample weight for every output. Metrics are named as `fit` logs them:
`<output>_<metric>` (`<output>_weighted_<metric>` for a weighted metric of a name
already taken), and `<output>_loss` for each output's loss when there are several.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import keras
import tensorflow as tf

from tputrain.task import per_example_weights


class Output(NamedTuple):
    name: str | None  # None: the one output of a single-output model
    index: int  # its position in the model's outputs
    loss: Any  # a keras.losses.Loss, a function or identifier, or None: not trained
    weight: float  # its loss weight


def _same_rank(labels: tf.Tensor, outputs: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Keras's rule for a loss given as a string or function (compile wraps it in a
    `LossFunctionWrapper`): when the ranks differ by one and the higher has a trailing
    axis of 1, the lower is expanded if it is 1-D (labels (N,) beside outputs (N, 1)),
    else the higher squeezed, so the loss keeps one value per example."""
    true_rank, pred_rank = labels.shape.rank, outputs.shape.rank
    if true_rank == pred_rank + 1 and labels.shape[-1] == 1:
        if pred_rank == 1:
            outputs = tf.expand_dims(outputs, -1)
        else:
            labels = tf.squeeze(labels, -1)
    elif pred_rank == true_rank + 1 and outputs.shape[-1] == 1:
        if true_rank == 1:
            labels = tf.expand_dims(labels, -1)
        else:
            outputs = tf.squeeze(outputs, -1)
    return labels, outputs


def per_example_loss(loss: Any, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    """The loss of each example, such that their mean over the replica's batch is the
    loss Keras's `Loss.__call__` gives for it: axes past the batch averaged ("sum_over_batch_size"),
    or summed and scaled by the batch for reduction "sum"; masked elements (the output's
    Keras mask, a loss's `ignore_class`) weigh 0 and the others total/valid, as Keras's
    `apply_mask` weighs them."""
    in_mask = getattr(outputs, "_keras_mask", None)  # read before any op drops it
    labels = tf.cast(labels, outputs.dtype)
    if isinstance(loss, keras.losses.Loss):
        per_element = loss.call(labels, outputs)  # no reduction
    else:
        per_element = keras.losses.get(loss)(*_same_rank(labels, outputs))
    summed = reduction_of(loss) in ("sum", None, "none")  # compile sums an unreduced loss
    mask = _combined(in_mask, getattr(per_element, "_keras_mask", None), per_element)
    if mask is not None:
        valid = tf.reduce_sum(mask)
        total = tf.cast(tf.size(mask), per_element.dtype)
        per_element *= mask if summed else mask * tf.math.divide_no_nan(total, valid)
    rank = per_element.shape.rank
    if rank == 0:  # a loss function that reduced the batch itself: Keras takes it as is
        return tf.fill(tf.shape(outputs)[:1], per_element)
    reduce = tf.reduce_sum if summed else tf.reduce_mean
    per_example = reduce(per_element, axis=list(range(1, rank))) if rank > 1 else per_element
    if summed:  # the batch's sum, as a mean over it
        per_example *= tf.cast(tf.shape(per_example)[0], per_example.dtype)
    return per_example


def reduction_of(loss: Any) -> str | None:
    """A `keras.losses.Loss`'s reduction; a loss function's: Keras's default."""
    return loss.reduction if isinstance(loss, keras.losses.Loss) else "sum_over_batch_size"


def weight_sum_scale(weight: tf.Tensor, like: tf.Tensor, global_batch_size: Any,
                     micro_batches: int) -> tf.Tensor:
    """What turns a loss summed over the global batch and divided by its size into one
    divided by the sum of its sample weights (reduction "mean_with_sample_weight"): the
    sum over every replica, per micro-batch (Keras averages those)."""
    total = tf.reduce_sum(per_example_weights(weight, like))
    total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, total)
    return tf.math.divide_no_nan(tf.cast(global_batch_size, tf.float32),
                                 total * float(micro_batches))


def _combined(first: Any, second: Any, like: tf.Tensor) -> tf.Tensor | None:
    """The two Keras masks (either may be None) as one float mask shaped as `like`."""
    masks = [tf.cast(m, like.dtype) for m in (first, second) if m is not None]
    if not masks:
        return None
    return shaped_like(masks[0] if len(masks) == 1 else masks[0] * masks[1], like)


def shaped_like(value: tf.Tensor, like: Any) -> tf.Tensor:
    """`value` with trailing axes dropped or added to `like`'s rank, broadcast to its
    shape: a mask beside its loss's elements, an example's weight beside a mask."""
    while value.shape.rank > like.shape.rank:
        value = tf.squeeze(value, -1)
    while value.shape.rank < like.shape.rank:
        value = tf.expand_dims(value, -1)
    return tf.broadcast_to(value, tf.shape(like))


def _plain(value: Any) -> Any:
    """A compile argument as a plain dict or list (a model keeps its `loss` in Keras's
    tracking wrappers, which are no `Mapping`)."""
    if isinstance(value, (str, bytes, keras.losses.Loss, keras.metrics.Metric)) or value is None:
        return value
    if hasattr(value, "items"):
        return dict(value.items())
    return list(value) if isinstance(value, (list, tuple)) else value


def _serialized(value: Any) -> bool:
    """A Keras object's config (as `get_compile_config` gives it), not a dict by name."""
    return isinstance(value, Mapping) and "class_name" in value


def _per_output(value: Any, names: Sequence[str], what: str, default: Any) -> list[Any]:
    """`value` (a list by position, a dict by output name, or one for all) for each
    output, in the model's order; a ValueError names a key that is no output."""
    if isinstance(value, Mapping) and not _serialized(value):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"KerasTask: {what} names {unknown}, which are not outputs of the "
                             f"model (its outputs: {list(names)})")
        return [value.get(name, default) for name in names]
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise ValueError(f"KerasTask: {what} has {len(value)} entries for the model's "
                             f"{len(names)} outputs {list(names)}: give one per output, or a "
                             "dict by output name")
        return list(value)
    return [value if value is not None else default] * len(names)


def _output_names(model: keras.Model) -> list[str]:
    """The names Keras's compile pairs losses and metrics with: a dict output's keys
    (sorted, the order of `model.outputs`), else the output layers' names."""
    try:
        structure = model.output
    except (AttributeError, ValueError):
        structure = None
    if isinstance(structure, Mapping):
        return sorted(structure)
    return list(model.output_names)


def _only(value: Any, model: keras.Model) -> Any:
    """The one entry of a one-output model's list or dict of losses (or weights)."""
    if isinstance(value, Mapping) and not _serialized(value) or isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{type(model).__name__} has one output (or declares none: a "
                             "subclassed model) but several losses: KerasTask pairs several "
                             "losses with the outputs of a functional model")
        return next(iter(value.values())) if isinstance(value, Mapping) else value[0]
    return value


class CompiledOutputs:
    """The outputs of a compiled model with their losses and loss weights; `flat` puts
    a model's outputs, labels or sample weights in the same order."""

    def __init__(self, model: keras.Model):
        outputs = getattr(model, "outputs", None) or []
        loss = _plain(model.loss)
        weights = _plain(model.get_compile_config().get("loss_weights"))
        if len(outputs) <= 1:
            loss, weight = _only(loss, model), _only(weights, model)
            self.names: list[str] = []
            self.outputs = [Output(None, 0, loss, 1.0 if weight is None else float(weight))]
            return
        self.names = _output_names(model)
        losses = _per_output(loss, self.names, "loss", None)
        weights = _per_output(weights, self.names, "loss_weights", 1.0)
        self.outputs = [Output(name, i, l, float(w)) for i, (name, l, w)
                        in enumerate(zip(self.names, losses, weights))]

    @property
    def divides_by_weights(self) -> bool:
        """Whether an output's loss has reduction "mean_with_sample_weight"."""
        return any(reduction_of(out.loss) == "mean_with_sample_weight" for out in self.outputs
                   if out.loss is not None)

    @property
    def several(self) -> bool:
        return bool(self.names)

    def flat(self, value: Any, repeat: bool = False) -> list[Any]:
        """The outputs', labels' or sample weights' tensors in the model's output order
        (a dict by name, a list by position); `repeat`: one tensor (a sample weight) is
        every output's."""
        if not self.several:
            return [value]
        if isinstance(value, Mapping):
            return [value[name] for name in self.names]
        if isinstance(value, (list, tuple)):
            return list(value)
        if repeat:
            return [value] * len(self.names)
        raise ValueError(f"KerasTask: the model has outputs {self.names}, so labels must be a "
                         f"list or a dict by output name, got one tensor")

    def losses(self, labels: Any, outputs: Any) -> list[tf.Tensor | None]:
        """Each output's per-example loss (None for an output without a loss)."""
        return [None if out.loss is None else per_example_loss(out.loss, label, output)
                for out, label, output in zip(self.outputs, self.flat(labels), self.flat(outputs))]

    def combined(self, labels: Any, outputs: Any, sample_weight: Any = None,
                 global_batch_size: Any = None, micro_batches: int = 1) -> tf.Tensor:
        """The per-example total: the sum over outputs of loss weight * sample weight *
        loss (what Keras's compiled loss sums, before its division by the batch). With
        `global_batch_size` (training), an output whose loss divides by the weights' sum
        ("mean_with_sample_weight") is scaled so that the division by the batch does."""
        weights = self.flat(sample_weight, repeat=True) if sample_weight is not None \
            else [None] * len(self.outputs)
        total = None
        for out, loss, weight in zip(self.outputs, self.losses(labels, outputs), weights):
            if loss is None:
                continue
            term = tf.cast(loss, tf.float32) * out.weight
            if weight is not None:
                if global_batch_size is not None and \
                        reduction_of(out.loss) == "mean_with_sample_weight":
                    term *= weight_sum_scale(weight, term, global_batch_size, micro_batches)
                term *= per_example_weights(weight, term)
            total = term if total is None else total + term
        if total is None:
            raise ValueError("KerasTask: no output of the model has a loss")
        return total


def resolve_metrics(config: Any, names: Sequence[str], make: Callable[[Any, int], Any]
                    ) -> list[tuple[int, Any]]:
    """`(output index, metric)` for each compiled metric (`metrics` or
    `weighted_metrics` of the compile config): all of them the one output's, or per
    output by position or name; `make(identifier, index)` builds each metric."""
    config = _plain(config)
    if not config:
        return []
    if not names:
        entries = [config] if _serialized(config) or not isinstance(config, (list, tuple)) \
            else config
        return [(0, make(entry, 0)) for entry in entries]
    resolved = []
    for index, entry in enumerate(_per_output(config, names, "metrics", None)):
        if entry is None:
            continue
        for identifier in entry if isinstance(entry, (list, tuple)) else [entry]:
            resolved.append((index, make(identifier, index)))
    return resolved
