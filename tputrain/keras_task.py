"""A Task made of a compiled `keras.Model` and its data, as `model.fit` takes them.

The model is rebuilt inside the strategy scope (variables must be created there
to be mirrored): a compiled model is cloned with `keras.models.clone_model` (or
its own class's `from_config`, Keras-Hub's) and its weights copied, its LoRA layers
and frozen weights as the user left them (tputrain/runtime/keras_clone.py); a model-building function is called there instead (the way
for subclassed models). Its compile config gives the rest: the loss (made per
example; with several outputs, each output's as `compile` pairs them,
tputrain/keras_outputs.py), metrics and weighted metrics (fresh copies per build) and the optimizer
(a fresh copy of its config: Keras's `use_ema` included, its averages kept in the
optimizer). See docs/tasks.md, "Bring a Keras model".
"""

from __future__ import annotations

import enum
import numbers
from typing import Any, Callable, Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.data.ops import dataset_ops, map_op

from tputrain.data import InputContext
from tputrain.data.batching import pad_to_batch
from tputrain.runtime.keras_clone import cloned
from tputrain.keras_outputs import CompiledOutputs, resolve_metrics, shaped_like
from tputrain.task import Task, average_loss, per_example_weights

DEFAULT_BATCH_SIZE = 32  # as `model.fit` for arrays
_BATCHES = ("_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset")


def _examples(data: Any, batch_size: int | None, split: str) -> tuple[tf.data.Dataset, int]:
    """`(dataset of single examples, global batch)` of `fit`-style data: a dataset of
    batches (`batch_size` None: the global batch is its first batch's size), a dataset
    of single examples with `batch_size`, or a tuple `(x, y[, sample_weight])` of arrays."""
    if isinstance(data, tf.data.Dataset):
        spec = data.element_spec
        if not (isinstance(spec, (tuple, list)) and len(spec) in (2, 3)):
            raise TypeError(f"the {split} dataset must yield tuples (x, y) or (x, y, "
                            f"sample_weight), as model.fit takes them; it yields "
                            f"{_spec_kind(spec)}: pair the features with their labels, e.g. "
                            "tf.data.Dataset.zip((features, labels))")
        if batch_size is not None:
            return data, int(batch_size)
        if any(spec.shape.rank == 0 for spec in tf.nest.flatten(data.element_spec)
               if isinstance(spec, tf.TensorSpec)):
            raise ValueError(f"the {split} dataset yields single examples (a scalar "
                             "component), and fit takes batches: batch it (.batch(n)) or "
                             "pass batch_size=n")
        return data.unbatch(), _first_batch_size(data, split)
    if not (isinstance(data, (tuple, list)) and len(data) in (2, 3)):
        raise TypeError(f"the {split} data must be a tf.data.Dataset or a tuple (x, y) or "
                        f"(x, y, sample_weight) of arrays, got {type(data).__name__}")
    arrays = tuple(tuple(part) if isinstance(part, list) else part for part in data)
    return tf.data.Dataset.from_tensor_slices(arrays), int(batch_size or DEFAULT_BATCH_SIZE)


def _spec_kind(spec: Any) -> str:
    """What a dataset yields, in a word or two: "a TensorSpec", "a tuple of 1"..."""
    if isinstance(spec, (tuple, list)):
        return f"a {type(spec).__name__} of {len(spec)}"
    return f"a {type(spec).__name__}"


def _batches(data: Any, batch_size: int | None) -> tf.data.Dataset | None:
    """`data` when it is a dataset of batches of dense tensors (which `rebatch` splits
    and joins as `unbatch().batch()` would, one copy a batch), else None."""
    if not isinstance(data, tf.data.Dataset) or batch_size is not None:
        return None
    specs = tf.nest.flatten(data.element_spec)
    if all(type(spec) is tf.TensorSpec and spec.shape.rank for spec in specs):
        return data
    return None


def _first_batch_size(dataset: tf.data.Dataset, split: str) -> int:
    """The batch size of a batched dataset: static if known, else read from the
    dataset's own `batch` (`_batch_size_of`), else its first batch's. Only the last
    opens an iterator: `fit` opens its dataset only to train, and each iterator
    of a dataset that reshuffles each iteration draws the next shuffle."""
    spec = tf.nest.flatten(dataset.element_spec)[0]
    if spec.shape.rank and spec.shape[0] is not None:
        return int(spec.shape[0])
    size = _batch_size_of(dataset)
    if size is None and int(dataset.cardinality()) != 0:
        logging.warning("tputrain: read the first batch of the %s dataset for its batch size: "
                        "a dataset that reshuffles each iteration now gives other batches than "
                        "model.fit; end it with .batch(n) (then map/prefetch), or pass "
                        "batch_size with a dataset of single examples", split)
        size = next((int(tf.shape(tf.nest.flatten(element)[0])[0])
                     for element in dataset.take(1)), None)
    if size is None or int(dataset.cardinality()) == 0:
        raise ValueError(f"the {split} dataset is empty")
    return size


def _batch_size_of(dataset: tf.data.Dataset) -> int | None:
    """The `batch_size` of the last `batch` of `dataset` (`_last_batch`), or None."""
    batch = _last_batch(dataset)
    size = getattr(batch, "_batch_size", None)
    return int(size) if size is not None else None


def _last_batch(dataset: tf.data.Dataset) -> tf.data.Dataset | None:
    """The last `batch` of `dataset`, found through the transformations after it
    that keep each element's batch (prefetch, shuffle, repeat, take, cache, map...),
    without reading the dataset; None if another transformation (unbatch, rebatch,
    interleave, zip...) or none is in the way."""
    # pylint: disable=protected-access  (tf.data's own record of its transformations)
    keeps_batch = (dataset_ops.UnaryUnchangedStructureDataset, map_op._MapDataset,
                   map_op._ParallelMapDataset)
    while dataset is not None:
        if type(dataset).__name__ in _BATCHES:
            return dataset
        if not isinstance(dataset, keeps_batch):
            return None
        dataset = getattr(dataset, "_input_dataset", None)
    return None


def _warn_short_last_batch(dataset: tf.data.Dataset) -> None:
    """`fit` trains on a batched dataset's short last batch; the Trainer's global
    batch is fixed, so the examples are rebatched across passes: said once, with
    the fix, when the dataset's own `batch` leaves a short one."""
    # pylint: disable=protected-access  (tf.data's own record of its transformations)
    batch = _last_batch(dataset)
    if batch is None or bool(getattr(batch, "_drop_remainder", True)):
        return
    size, examples = int(batch._batch_size), int(batch._input_dataset.cardinality())
    if examples > 0 and examples % size:
        logging.warning("tputrain: the train dataset's last batch is short (%d examples in "
                        "batches of %d): tputrain trains on full batches of %d across passes, "
                        "so on other batches than model.fit; batch with drop_remainder=True "
                        "or give a number of examples the batch divides", examples, size, size)


def _eval_examples(train: tf.data.Dataset, eval_data: Any, batch_size: int | None,
                   global_batch_size: int) -> tf.data.Dataset:
    """The eval split's examples: `eval_data`'s, or the train data's first global batch
    (without its sample weights when they are per output: the eval loss weighs each
    example once, so eval data takes one sample weight per example)."""
    if eval_data is None:
        examples = train.take(global_batch_size)
        if len(examples.element_spec) == 3 and tf.nest.is_nested(examples.element_spec[2]):
            examples = examples.map(lambda features, labels, _: (features, labels))
        return examples
    if isinstance(eval_data, tf.data.Dataset) and _batched(eval_data, train):
        batch_size = None  # the arrays' (and single examples') batch, not this one's
    examples = _examples(eval_data, batch_size, "eval")[0]
    if len(examples.element_spec) == 3 and tf.nest.is_nested(examples.element_spec[2]):
        raise ValueError("KerasTask: eval data takes one sample weight per example, not one "
                         "per output: evaluate with (x, y) or (x, y, sample_weight)")
    return examples


def _batched(dataset: tf.data.Dataset, examples: tf.data.Dataset) -> bool:
    """Whether `dataset` holds batches, as `fit`'s `validation_data` does: it ends with
    a `.batch(n)` (`_batch_size_of`), or its features have one axis more than the
    single train `examples`' features."""
    if _batch_size_of(dataset) is not None:
        return True
    ranks = [tf.nest.flatten(data.element_spec)[0].shape.rank
             for data in (dataset, examples)]
    return None not in ranks and ranks[0] == ranks[1] + 1


def _padded(batch: tuple, rows: int) -> tuple:
    """An eval batch of up to `rows` examples, padded to `rows` with weight-0 examples
    (a user's sample weights are kept on the real ones)."""
    if len(batch) == 2:
        return pad_to_batch(batch, rows)
    features, labels, weights = batch
    features, labels, mask = pad_to_batch((features, labels), rows)
    weights = tf.cast(weights, tf.float32)
    weights = tf.pad(weights, [[0, rows - tf.shape(weights)[0]]]
                     + [[0, 0]] * (weights.shape.rank - 1))
    return features, labels, tf.reshape(mask, [rows] + [1] * (weights.shape.rank - 1)) * weights


def _accuracy(name: str, label_spec: tf.TensorSpec, output_shape: tuple | None
              ) -> keras.metrics.Metric:
    """"accuracy" resolved as Keras's compile does, from the label and output shapes
    (both with the batch axis): sparse where the labels' rank is lower, or their last
    axis is 1 beside several classes."""
    label_rank = label_spec.shape.rank + 1  # with the batch axis
    label_last = label_spec.shape[-1] if label_spec.shape.rank else 1
    output_last = output_shape[-1] if output_shape else None
    output_rank = len(output_shape) if output_shape else 2
    if output_last == 1:
        return keras.metrics.BinaryAccuracy(name=name)
    if label_rank < output_rank or label_last == 1:
        return keras.metrics.SparseCategoricalAccuracy(name=name)
    return keras.metrics.CategoricalAccuracy(name=name)


def built_precision(model: keras.Model) -> str | None:
    """The mixed policy a built model's layers compute in ("mixed_float16" when any
    layer with weights does, then "mixed_bfloat16"), or None: float32 throughout."""
    names = {layer.dtype_policy.name for layer in model._flatten_layers(include_self=False)
             if layer.weights}  # pylint: disable=protected-access
    return next((name for name in ("mixed_float16", "mixed_bfloat16") if name in names), None)


class KerasTask(Task):
    """A `Task` from a compiled Keras model and `fit`-style data.

    Args:
      model: a compiled `keras.Model` (functional or Sequential; cloned into the
        strategy scope with its weights), or a function of no arguments that builds
        and compiles one (called inside the scope: subclassed models need this).
      train_data: a `tf.data.Dataset` of `(x, y)` or `(x, y, sample_weight)` batches,
        as `fit` takes it (read in order, repeated); or a tuple of arrays.
      eval_data: the same for evaluation (every example, the last batch padded), or
        None: the train data's first `global_batch_size` examples, to have a split.
      batch_size: None for a batched dataset (its batch size is the global batch);
        the global batch for arrays (default 32) or a dataset of single examples.
        A batched eval dataset keeps its batches (as `fit`'s `validation_data`).
      shuffle: arrays only: reshuffle the train examples every pass (seeded), as fit.
      seed: the shuffle's seed.
      epoch_steps: the steps between two evaluations (a Keras epoch). When it is the
        number of batches of a batched train dataset, each pass opens the dataset as
        `model.fit(dataset, epochs=...)` does: a spare iterator at each epoch's end
        (Keras's epoch iterator makes one), so a dataset that reshuffles each
        iteration gives fit's batches. Otherwise passes follow each other, as under
        `fit(..., steps_per_epoch=epoch_steps)`.
    """

    # The user's dataset is read only by training, as by fit (Task.probe_train_inputs).
    probe_train_inputs = False

    def __init__(self, model: keras.Model | Callable[[], keras.Model], train_data: Any,
                 eval_data: Any = None, batch_size: int | None = None, shuffle: bool = True,
                 seed: int = 0, epoch_steps: int | None = None):
        self._source = model if isinstance(model, keras.Model) else None
        self._factory = None if self._source is not None else model
        if self._source is not None:
            _check_compiled(self._source)
        elif not callable(model):
            raise TypeError(f"KerasTask.model must be a keras.Model or a function returning "
                            f"one, got {type(model).__name__}")
        self._train, self.global_batch_size = _examples(train_data, batch_size, "train")
        if self._source is not None and not self._source.built:
            _build_from(self._source, self._train.element_spec)
        self._train_batches = _batches(train_data, batch_size)
        if isinstance(train_data, tf.data.Dataset) and batch_size is None:
            _warn_short_last_batch(train_data)
        self._shuffle = bool(shuffle) and not isinstance(train_data, tf.data.Dataset)
        self._fit_epochs = (isinstance(train_data, tf.data.Dataset) and batch_size is None
                            and epoch_steps is not None
                            and int(train_data.cardinality()) == epoch_steps)
        self._seed = seed
        self._eval = _eval_examples(self._train, eval_data, batch_size, self.global_batch_size)
        self._compiled: keras.Model | None = self._source
        self._built: keras.Model | None = None  # the model build_model gave the Trainer
        self._resolved: CompiledOutputs | None = None
        self._resolved_for: keras.Model | None = None
        self._evaluating = False
        self._said_precision = False  # the warning that precision misses a built model

    # ------------------------------------------------------------ Task

    def build_model(self) -> keras.Model:
        if self._factory is not None:
            model = self._factory()
            if not isinstance(model, keras.Model):
                raise TypeError(f"KerasTask's model function returned "
                                f"{type(model).__name__}, not a keras.Model")
            self._compiled = self._built = _check_compiled(model)
            return model
        self._built = cloned(self._source)  # LoRA and frozen layers as the user left them
        policy, built = keras.mixed_precision.global_policy().name, built_precision(self._source)
        if policy.startswith("mixed_") and built != policy and not self._said_precision:
            self._said_precision = True
            logging.warning(
                "tputrain.fit: precision %s does not reach the layers of a model passed "
                "built: they keep the policies they were built with (%s) and compute as "
                "built; pass a function that builds and compiles the model "
                "(tputrain.fit(build, ...)) to build them under %s", policy,
                built or "float32", policy)
        return self._built

    def build_inputs(self, split: str, input_context: InputContext) -> tf.data.Dataset:
        """Single examples, sharded by host, in per-replica batches: consecutive
        replicas take consecutive slices of the user's global batch."""
        rows = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        if (split == "train" and self._train_batches is not None
                and input_context.num_input_pipelines == 1):
            # As unbatch().batch(rows), without a per-example pass on every step.
            return self._passes(self._train_batches).rebatch(rows, drop_remainder=True)
        examples = self._train if split == "train" else self._eval
        if input_context.num_input_pipelines > 1:
            examples = examples.shard(input_context.num_input_pipelines,
                                      input_context.input_pipeline_id)
        if split == "train":
            if self._shuffle:
                examples = examples.shuffle(10_000, seed=self._seed,
                                            reshuffle_each_iteration=True)
            return self._passes(examples).batch(rows, drop_remainder=True)
        return examples.batch(rows).map(lambda *batch: _padded(batch, rows))

    @property
    def check_labels(self) -> bool:  # type: ignore[override]
        """False where a compiled loss ignores a class (`ignore_class`): its labels hold
        that id, which may be no class of the model (-1), and the loss masks it."""
        return not any(_ignores_a_class(out.loss) for out in self._outputs.outputs)

    def compute_loss(self, labels: Any, outputs: Any) -> tf.Tensor:
        """The compiled loss of each example: over the outputs, the sum of loss weight *
        loss (axes past the batch averaged, as Keras's "sum_over_batch_size" does)."""
        return self._outputs.combined(labels, outputs)

    def total_loss(self, labels: Any, outputs: Any, model: keras.Model,
                   global_batch_size: int, micro_batches: int = 1,
                   sample_weight: Any = None) -> tf.Tensor:
        """Sample weights per output (a list or dict, as `fit` takes them) weight each
        output's loss; one sample weight weights them all (the Task's own rule). A loss
        with reduction "mean_with_sample_weight" is divided by the weights' sum."""
        if sample_weight is None or not (tf.nest.is_nested(sample_weight)
                                         or self._outputs.divides_by_weights):
            return super().total_loss(labels, outputs, model, global_batch_size,
                                      micro_batches, sample_weight=sample_weight)
        weighted = self._outputs.combined(labels, outputs, sample_weight, global_batch_size,
                                          micro_batches)
        loss = average_loss(weighted, None, global_batch_size)
        if model.losses:
            regularization = tf.add_n([tf.cast(l, tf.float32) for l in model.losses])
            loss += tf.nn.scale_regularization_loss(regularization) / micro_batches
        return loss

    def build_metrics(self) -> Sequence[keras.metrics.Metric]:
        """Fresh copies of the compiled `metrics` and `weighted_metrics`, named as `fit`
        names them (per output: `<output>_<metric>`), and with several losses a mean of
        each output's (`<output>_loss`). Only the weighted ones get training sample
        weights, as under `fit`."""
        config, names = _compiled_arguments(self._compiled), self._outputs.names
        plain = resolve_metrics(config.get("metrics"), names, self._metric)
        weighted = resolve_metrics(config.get("weighted_metrics"), names, self._metric)
        counts: dict[str, int] = {}
        tagged = [(m, False) for m in plain] + [(m, True) for m in weighted]
        for (index, metric), is_weighted in tagged:
            metric.name = _keras_name(metric.name, names[index] if names else None,
                                      is_weighted, counts)
            metric._tputrain_output = index  # pylint: disable=protected-access
            metric._tputrain_weighted = is_weighted  # pylint: disable=protected-access
        return [metric for _, metric in plain + weighted] + self._loss_means()

    def build_optimizer(self) -> keras.optimizers.Optimizer:
        optimizer = self._compiled.optimizer
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # the Trainer wraps
        fresh = rebuilt(optimizer, "optimizer")
        _carry_weight_decay_exclusions(optimizer, fresh, self._compiled, self._built)
        return fresh

    def update_metrics(self, metrics: Sequence[keras.metrics.Metric], labels: Any,
                       outputs: Any, sample_weight: Any = None) -> None:
        """Each metric on its output. Training: sample weights go to the weighted metrics
        only (Keras's rule). Eval: to every metric, since they also mark the padding of
        the last batch."""
        compiled = self._outputs
        labels_of, outputs_of = compiled.flat(labels), compiled.flat(outputs)
        weights = ([None] * len(labels_of) if sample_weight is None
                   else compiled.flat(sample_weight, repeat=True))
        losses = None
        for metric in metrics:
            index = getattr(metric, "_tputrain_output", 0)
            weight = weights[index]
            if getattr(metric, "_tputrain_loss_mean", False):
                losses = losses or compiled.losses(labels, outputs)
                self._update_loss_mean(metric, losses[index], weight)
            elif weight is not None and (self._evaluating
                                         or getattr(metric, "_tputrain_weighted", False)):
                metric.update_state(labels_of[index], outputs_of[index],
                                    sample_weight=_as_mask_shaped(weight, outputs_of[index]))
            else:
                metric.update_state(labels_of[index], outputs_of[index])

    def eval_step(self, batch: Any, model: keras.Model, metrics: Sequence[keras.metrics.Metric],
                  global_batch_size: int) -> dict[str, tf.Tensor]:
        self._evaluating = True  # read by update_metrics while this traces
        try:
            return super().eval_step(batch, model, metrics, global_batch_size)
        finally:
            self._evaluating = False

    # ------------------------------------------------------------ helpers

    def _passes(self, examples: tf.data.Dataset) -> tf.data.Dataset:
        """The train examples pass after pass. Every iterator of the user's dataset
        draws its next shuffle (`reshuffle_each_iteration`): under `_fit_epochs` one
        is opened and left unread (one batch read) between two passes, as Keras's
        epoch iterator opens one at an epoch's end and another at the next's start."""
        if not self._fit_epochs:
            return examples.repeat()
        spare = examples.take(1).filter(lambda *_: False)
        return examples.concatenate(spare.concatenate(examples).repeat())

    def _metric(self, identifier: Any, index: int = 0) -> keras.metrics.Metric:
        """A compiled metric of output `index`, resolved and named as `compile` does."""
        if isinstance(identifier, str) and identifier.lower() in ("accuracy", "acc"):
            label_spec = self._outputs.flat(self._train.element_spec[1])[index]
            return _accuracy(identifier, label_spec, _output_shape(self._compiled, index))
        if isinstance(identifier, keras.metrics.Metric):  # the user's object: a fresh copy
            return rebuilt(identifier, "metric")
        metric = identifier if callable(identifier) else keras.metrics.get(identifier)
        if not isinstance(metric, keras.metrics.Metric):  # a function
            name = identifier if isinstance(identifier, str) else getattr(metric, "__name__", None)
            metric = keras.metrics.MeanMetricWrapper(metric, name=name or str(identifier))
        elif isinstance(identifier, str):
            metric.name = identifier
        return metric

    def _loss_means(self) -> list[keras.metrics.Metric]:
        """With several outputs' losses, a mean of each (`<output>_loss`), as `fit` logs."""
        compiled = self._outputs
        trained = [out for out in compiled.outputs if out.loss is not None]
        if len(trained) < 2:
            return []
        means = []
        for out in trained:
            mean = keras.metrics.Mean(name=f"{out.name}_loss")
            mean._tputrain_output = out.index  # pylint: disable=protected-access
            mean._tputrain_loss_mean = True  # pylint: disable=protected-access
            means.append(mean)
        return means

    def _update_loss_mean(self, mean: keras.metrics.Metric, loss: tf.Tensor,
                          weight: tf.Tensor | None) -> None:
        """Training: the mean of weight * loss over the examples (`fit`'s batch loss
        averaged over batches); eval: the weighted mean, as the eval loss."""
        if weight is None:
            mean.update_state(loss)
        elif self._evaluating:
            mean.update_state(loss, sample_weight=per_example_weights(weight, loss))
        else:
            mean.update_state(loss * per_example_weights(weight, loss))

    @property
    def _outputs(self) -> CompiledOutputs:
        """The compiled model's outputs with their losses (read once it is built)."""
        if self._resolved is None or self._resolved_for is not self._compiled:
            self._resolved, self._resolved_for = CompiledOutputs(self._compiled), self._compiled
        return self._resolved


def _keras_name(name: str, output: str | None, weighted: bool, counts: dict[str, int]) -> str:
    """A metric's name in `fit`'s logs: prefixed by its output's name when the model has
    several; a weighted metric of a name already taken is `weighted_<name>`; a name
    taken again gets `_1`, `_2`..."""
    def prefixed(base: str) -> str:
        return f"{output}_{base}" if output else base

    full = prefixed(name)
    if full not in counts:
        counts[full] = 1
        return full
    if weighted:
        full = prefixed(f"weighted_{name}")
        if full not in counts:
            counts[full] = 1
            return full
    index = counts[full]
    counts[full] += 1
    return f"{full}_{index}"


def _output_shape(model: keras.Model, index: int = 0) -> tuple | None:
    try:
        return tuple(model.outputs[index].shape)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def rebuilt(original: Any, kind: str) -> Any:
    """A fresh copy of the user's optimizer or metric, from its config (its variables
    made in the strategy's scope); a ValueError naming the attributes the copy lost (a
    constructor argument kept as an attribute and missing from `get_config`), which it
    would otherwise run without, silently."""
    fresh = type(original).from_config(original.get_config())
    given, copied = _plain_attributes(original), _plain_attributes(fresh)
    # Both constructors set an attribute alike, or the config lost an argument (one only
    # the user's holds was set later, e.g. by `build`: not compared).
    lost = sorted(name for name, value in given.items()
                  if name in copied and not _equal(copied[name], value))
    if lost:
        name = type(original).__name__
        shown = ", ".join(f"{key}={given[key]!r} (copy: {copied[key]!r})"
                          for key in lost)
        raise ValueError(f"KerasTask: the {kind} {name} rebuilt from its config differs "
                         f"from the one compiled: {shown}; tputrain runs a fresh copy, "
                         f"{name}.from_config(<its get_config()>): return {', '.join(lost)} "
                         f"from {name}.get_config() (and take {'them' if len(lost) > 1 else 'it'} "
                         f"in {name}.__init__), or set {'them' if len(lost) > 1 else 'it'} "
                         "from the arguments __init__ takes")
    return fresh


_STATE = ("built",)  # set by building, not by the constructor


def _plain_attributes(obj: Any) -> dict[str, Any]:
    """`obj`'s public attributes holding plain values (numbers, strings, enums, None,
    and containers of them): what a constructor sets, not variables or Keras objects."""
    return {name: value for name, value in vars(obj).items()
            if not name.startswith("_") and name not in _STATE and _is_plain(value)}


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, str, enum.Enum)):
        return True
    if isinstance(value, numbers.Number):
        return not isinstance(value, (tf.Tensor, tf.Variable, np.ndarray))
    if isinstance(value, (list, tuple)):
        return all(_is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(_is_plain(k) and _is_plain(v) for k, v in value.items())
    return False


def _equal(a: Any, b: Any) -> bool:
    """Plain values alike: a tuple equals the list a config gives back, a float NaN
    equals NaN (a default some configs hold), and floats equal at float32 precision
    are equal (a config's learning_rate is read back from its float32 variable: an
    attribute set from the rate given is 0.05, the copy's 0.05000000074505806)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (a != a and b != b) or bool(np.float32(a) == np.float32(b))
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _carry_weight_decay_exclusions(source: keras.optimizers.Optimizer,
                                   fresh: keras.optimizers.Optimizer,
                                   compiled: keras.Model | None, built: keras.Model | None) -> None:
    """Keras keeps `exclude_from_weight_decay` outside an optimizer's config: the names'
    pattern is carried over as it is, the variables as the built model's in the same
    places of `weights` (its clone of the compiled model, or that model itself)."""
    pattern = getattr(source, "_exclude_from_weight_decay_pattern", None)
    keys = getattr(source, "_exclude_from_weight_decay", set())
    if pattern is None and not keys:
        return
    fresh._exclude_from_weight_decay_pattern = pattern  # pylint: disable=protected-access
    places = ({source._var_key(v): i for i, v in enumerate(compiled.weights)}  # pylint: disable=protected-access
              if compiled is not None and built is not None else {})
    fresh._exclude_from_weight_decay = {  # pylint: disable=protected-access
        fresh._var_key(built.weights[places[key]]) for key in keys if key in places}  # pylint: disable=protected-access
    fresh._exclude_from_weight_decay_cache = {}  # pylint: disable=protected-access


def _build_from(model: keras.Model, example_spec: Any) -> None:
    """Builds a model that has no input yet (a Sequential without `keras.Input`) from one
    example's features, as `fit` builds it on its first batch: the trained weights go
    back to it at the end."""
    features = example_spec[0] if isinstance(example_spec, tuple) else example_spec
    if not isinstance(features, tf.TensorSpec):
        raise ValueError(f"{type(model).__name__} is not built and its features are a "
                         f"{type(features).__name__}: give it a keras.Input (or call "
                         "model.build) before tputrain.fit")
    model.build((None, *features.shape))


def _as_mask_shaped(weight: Any, output: Any) -> Any:
    """An example's weight (the eval padding's, or the user's) repeated over the time
    steps of an output that carries a Keras mask, which Keras's metrics multiply it by
    (a (batch,) weight beside a (batch, steps) mask does not broadcast)."""
    mask = getattr(output, "_keras_mask", None)
    if weight is None or mask is None or weight.shape.rank is None:
        return weight
    return shaped_like(tf.cast(weight, tf.float32), mask)


def _compiled_arguments(model: keras.Model) -> Mapping[str, Any]:
    """`model.compile`'s arguments as the user passed them (their own metric functions and
    classes, registered with Keras or not), else its serialized compile config."""
    raw = getattr(model, "_compile_config", None)  # Keras keeps them until serialized
    return dict(raw.config) if hasattr(raw, "config") else model.get_compile_config()


def _ignores_a_class(loss: Any) -> bool:
    """A Keras loss object configured with an `ignore_class` (sparse cross-entropy)."""
    return (isinstance(loss, keras.losses.Loss)
            and loss.get_config().get("ignore_class") is not None)


def _check_compiled(model: keras.Model) -> keras.Model:
    """A compiled model with a loss, its losses pairing with its outputs; else a
    ValueError naming the fix. (An optimizer with Keras's `use_ema` is carried over:
    its averages are updated in its step and checkpointed with it; `tputrain.fit` ends
    on them as `fit` does, tputrain/optim/ema.py `finalize_keras_averages`.)"""
    if not getattr(model, "compiled", False) or model.loss is None:
        raise ValueError(f"{type(model).__name__} is not compiled with a loss: call "
                         "model.compile(optimizer=..., loss=..., metrics=...) first")
    CompiledOutputs(model)  # a loss or metric of no output is named now
    return model
