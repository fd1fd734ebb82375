"""LoRA merging, `.keras` files and int8 quantization of a trained checkpoint.

The SavedModel export (`tputrain.serving.export`) serves the model as it trains: a model
with LoRA enabled (`layer.enable_lora(rank)`, Keras-Hub's
`backbone.enable_lora(rank)`) computes its frozen kernels and its
`lora_kernel_a`/`lora_kernel_b` factors apart. This module adds, for serving:

* `merged_copy(model)`: a copy whose kernels hold `kernel + (alpha / rank) * a @ b`
  and which has no LoRA left (no factors, no `lora_rank` in its config): the base
  model's size and cost. Made by Keras's own `.keras` format, which writes merged
  kernels; the copy is read back from it without the LoRA settings.
* `save_base_and_factors(model, path)`: a Keras-Hub LoRA model's base as a `.keras`
  file and its factors in Keras-Hub's `.lora.h5` beside it (Keras's format itself
  writes merged kernels and no factors).
* `save_keras_file(model, path)`: a `.keras` file (written whole, then renamed)
  that `keras.saving.load_model` reads back (Keras-Hub models need `import
  keras_hub` first; a custom layer needs `keras.saving.register_keras_serializable`).
* `quantized_copy(model, "int8")`: the merged copy after Keras's
  `model.quantize("int8")` (int8 kernels with per-channel scales; the inputs are
  quantized per call), and `evaluate_model` to measure what it costs: the eval
  split through `Task.eval_step` on one device, for float32 and int8 alike.

`export_for_serving(trainer, ...)` runs them on a checkpoint (the EMA weights
when the run keeps them); `tputrain export --lora=merge --keras --quantize=int8`
is its command line. See docs/keras_hub.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings
import zipfile
from typing import Any, Mapping

import keras
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.atomic import atomic_path
from tputrain.checkpointing.files import step_of
from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.serving.export import (VERTEX_MODEL_DIR, checkpoint_to_export, export_destination,
                             feature_spec_of, read_for_export, serving_inputs,
                             write_saved_model)
from tputrain.runtime.run_view import RunView, view_of
from tputrain.task import EVAL_WEIGHT


LORA_CHOICES = ("keep", "merge")
QUANTIZE_CHOICES = ("int8",)
KERAS_DIR = RunDirectory.KERAS  # model_dir/keras/<step>.keras, <step>-int8.keras
_LORA_CONFIG_KEYS = ("lora_rank", "lora_alpha")


def lora_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers of `model` with LoRA enabled."""
    return [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if getattr(layer, "lora_enabled", False)]


def lora_variables(model: keras.Model) -> list[tf.Variable]:
    """The LoRA factors of `model` (`lora_kernel_a`, `lora_kernel_b` of each layer)."""
    return [variable for layer in lora_layers(model)
            for variable in (layer.lora_kernel_a, layer.lora_kernel_b)]


def _without_lora(config: Any) -> Any:
    """A Keras config with every layer's `lora_rank`/`lora_alpha` removed."""
    if isinstance(config, dict):
        return {key: _without_lora(value) for key, value in config.items()
                if key not in _LORA_CONFIG_KEYS}
    if isinstance(config, list):
        return [_without_lora(value) for value in config]
    return config


def save_keras_file(model: keras.Model, path: str) -> str:
    """Writes `model` as a `.keras` file at `path` (a temp file renamed into place, so
    a reader never sees half a file); LoRA layers are written merged (Keras's format)."""
    if not path.endswith(".keras"):
        raise ValueError(f"a Keras model file must end in .keras, got {path}")
    with atomic_path(path, keep_suffix=True) as temp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "compile() was not called"
        model.save(temp)
    return path


def load_keras_file(path: str, without_lora: bool = False) -> keras.Model:
    """`keras.saving.load_model(path, compile=False)`; `without_lora`: its layers'
    LoRA settings dropped first, so merged kernels load into plain layers."""
    if not without_lora:
        return keras.saving.load_model(path, compile=False)
    with tempfile.TemporaryDirectory(prefix="tputrain-keras-") as folder:
        plain = os.path.join(folder, "plain.keras")
        with zipfile.ZipFile(path) as source, zipfile.ZipFile(plain, "w") as target:
            for item in source.infolist():
                data = source.read(item)
                if item.filename == "config.json":
                    data = json.dumps(_without_lora(json.loads(data))).encode()
                target.writestr(item, data)
        return keras.saving.load_model(plain, compile=False)


def merged_copy(model: keras.Model) -> keras.Model:
    """A copy of `model` with each LoRA layer's factors merged into its kernel and
    LoRA gone (see the module docstring); `model` itself is unchanged."""
    with tempfile.TemporaryDirectory(prefix="tputrain-merge-") as folder:
        path = save_keras_file(model, os.path.join(folder, "model.keras"))
        return load_keras_file(path, without_lora=True)


def save_base_and_factors(model: keras.Model, path: str) -> tuple[str, str]:
    """A Keras-Hub LoRA model as two files: `path`, the `.keras` file of its base (each
    LoRA layer's kernel without its factors: the factor b is zero while it is written),
    and `<path minus .keras>.lora.h5`, Keras-Hub's file of the factors
    (`backbone.save_lora_weights`). `load_model(path)`, then
    `model.backbone.load_lora_weights(factors)` gives the trained model back, factors
    trainable."""
    backbone = getattr(model, "backbone", None)
    if not hasattr(backbone, "save_lora_weights") or not getattr(
            backbone, "_lora_enabled_layers", None):
        raise ValueError("a .keras file with the LoRA factors kept needs a Keras-Hub model with "
                         "backbone.enable_lora(rank): use keras_lora='merge' (--lora=merge)")
    factors = [layer.lora_kernel_b for layer in lora_layers(model)]
    values = [tf.identity(tf.convert_to_tensor(b)) for b in factors]
    try:
        for factor in factors:
            factor.assign(tf.zeros(factor.shape, factor.dtype))
        save_keras_file(model, path)
    finally:
        for factor, value in zip(factors, values):
            factor.assign(value)
    lora_path = path[:-len(".keras")] + ".lora.h5"
    with tempfile.TemporaryDirectory(prefix="tputrain-lora-") as folder, \
            atomic_path(lora_path) as temp:  # Keras-Hub wants the name to end in .lora.h5
        local = os.path.join(folder, "factors.lora.h5")
        backbone.save_lora_weights(local)
        tf.io.gfile.copy(local, temp, overwrite=True)
    return path, lora_path


def quantized_copy(model: keras.Model, mode: str = "int8") -> keras.Model:
    """The merged copy of `model`, quantized by Keras (`model.quantize(mode)`)."""
    if mode not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {mode!r}")
    copy = merged_copy(model)
    with warnings.catch_warnings():  # one per layer without weights to quantize
        warnings.filterwarnings("ignore", message=".*does not have a `quantize` method.*")
        copy.quantize(mode)
    return copy


def evaluate_model(view: RunView, model: keras.Model) -> dict[str, float]:
    """The eval split's loss and metrics for `model` (any copy: merged, quantized), on
    one device: each of this host's per-replica batches through `Task.eval_step`,
    at most `Trainer.eval_steps` global batches; the loss is the mean over real
    examples (padding rows, weight 0, count for nothing)."""
    view = view_of(view)  # a Trainer, an action's context or a view
    task = view.task
    dataset = view.inputs.eval_dataset
    if view.plan.options.eval_steps is not None:
        dataset = dataset.take(view.plan.options.eval_steps * view.local_replicas)
    metrics = list(task.build_metrics())

    @tf.function
    def step(batch):
        rows = tf.shape(tf.nest.flatten(batch[0])[0])[0]
        logs = task.eval_step(batch, model, metrics, rows)
        share = logs.get(EVAL_WEIGHT, tf.constant(1.0))
        rows = tf.cast(rows, tf.float32)
        return tf.cast(logs["loss"], tf.float32) * rows, tf.cast(share, tf.float32) * rows

    loss, weight = 0.0, 0.0
    for batch in dataset:
        batch_loss, batch_weight = step(batch)
        loss, weight = loss + float(batch_loss), weight + float(batch_weight)
    if weight == 0:
        raise ValueError("the eval split is empty: nothing to evaluate the model on")
    return {"loss": loss / weight, **{m.name: float(m.result()) for m in metrics}}


@dataclasses.dataclass
class ServingExport:
    """What `export_for_serving` wrote (None: not asked for) and measured."""

    step: int
    checkpoint: str
    saved_model: str | None = None
    keras_file: str | None = None
    lora_file: str | None = None
    quantized_saved_model: str | None = None
    quantized_keras_file: str | None = None
    float32_metrics: dict[str, float] | None = None
    quantized_metrics: dict[str, float] | None = None

    def report(self) -> list[str]:
        """Human lines: the paths, and float32 against quantized metrics."""
        lines = [f"{name}: {path}" for name, path in (
            ("saved_model", self.saved_model), ("keras", self.keras_file),
            ("lora factors", self.lora_file),
            ("quantized saved_model", self.quantized_saved_model),
            ("quantized keras", self.quantized_keras_file)) if path]
        if self.float32_metrics and self.quantized_metrics:
            for name, value in self.float32_metrics.items():
                quantized = self.quantized_metrics[name]
                lines.append(f"eval {name}: float32 {value:.6g}, quantized {quantized:.6g} "
                             f"(difference {quantized - value:+.3g})")
        return lines


def _examples_spec(view: RunView, inputs: Any, examples: bool) -> Any:
    """The `serving_examples` feature spec for `inputs`, or None (as `export_checkpoint`)."""
    spec = feature_spec_of(view.task) if examples else None
    if spec is None or not (isinstance(inputs, Mapping) and set(inputs) <= set(spec)):
        return None
    return {name: spec[name] for name in inputs}


def _saved_model(view: RunView, model: keras.Model, path: str, reusable: bool,
                 examples: bool) -> str:
    inputs = serving_inputs(view, model)
    write_saved_model(model, inputs, _examples_spec(view, inputs, examples), path, reusable)
    return path


def export_for_serving(view: RunView, step: int | None = None, best: bool | None = None,
                       lora: str = "merge", saved_model: bool = True,
                       export_dir: str | None = None, keras_file: str | bool | None = None,
                       quantize: str | None = None, examples: bool = True,
                       keras_lora: str = "merge") -> ServingExport:
    """Exports a checkpoint of `view` (a Trainer or its view) for serving: a
    SavedModel, a `.keras` file, and their int8 versions with the eval metrics of
    both, as asked.

    Args:
      step, best: which checkpoint (`tputrain.serving.export.checkpoint_to_export`).
        lora: "merge": LoRA factors merged into the kernels; "keep": the SavedModel
        computes them apart, as trained (the `.keras` file: `keras_lora`).
      saved_model: write the SavedModel: to `export_dir`; else a merged LoRA model to
        model_dir/export_merged/<step>, any other as `tputrain.Export` does
        (model_dir/export/<step>, or $AIP_MODEL_DIR).
      keras_file: a `.keras` path, True for model_dir/keras/<step>.keras, None: none.
      keras_lora: "merge": the `.keras` file holds the merged model; "keep": a Keras-Hub
        LoRA model's base, with Keras-Hub's `.lora.h5` of the factors beside it
        (`save_base_and_factors`).
      quantize: "int8": also the quantized model (SavedModel to
        `model_dir/export_int8/<step>`, `.keras` beside the float one with
        `-int8`), and the eval split's metrics for float32 and int8.
      examples: the `serving_examples` signature when the Task has a feature spec.
    """
    view = view_of(view)  # a Trainer, an action's context or a view
    for name, value in (("lora", lora), ("keras_lora", keras_lora)):
        if value not in LORA_CHOICES:
            raise ValueError(f"{name} must be one of {LORA_CHOICES}, got {value!r}")
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    view.checkpointer.sync()
    checkpoint, step, which = checkpoint_to_export(view, step, best)
    model, checkpoint = read_for_export(view, checkpoint, which == "latest")
    step = step_of(checkpoint)
    result = ServingExport(step=step, checkpoint=checkpoint)
    serving = merged_copy(model) if lora == "merge" and lora_layers(model) else model
    if saved_model:
        result.saved_model = _saved_model(view, serving, *_saved_model_path(
            view, step, export_dir, merged=serving is not model), examples)
    if keras_file:
        path = keras_file if isinstance(keras_file, str) else _keras_path(view, step, "")
        if keras_lora == "keep" and lora_layers(model):
            result.keras_file, result.lora_file = save_base_and_factors(model, path)
        else:
            result.keras_file = save_keras_file(serving, path)
    if quantize:
        _export_quantized(view, serving, result, quantize, saved_model, keras_file, examples)
    logging.info("tputrain: exported step %d (%s) of %s", step, which, checkpoint)
    return result


def _saved_model_path(view: RunView, step: int, export_dir: str | None,
                      merged: bool) -> tuple[str, bool]:
    """(folder, reusable): `export_dir`; else a merged model's model_dir/export_merged/<step>
    (model_dir/export/<step> holds the model as trained, `tputrain.Export`'s), else
    `export_destination`'s. Reusable: a numbered folder of model_dir holding this export."""
    if export_dir is None and merged:
        return RunDirectory(view.model_dir).export_version(step, "merged"), True
    path = export_destination(view, step, export_dir)
    return path, export_dir is None and not os.environ.get(VERTEX_MODEL_DIR)


def _keras_path(view: RunView, step: int, suffix: str) -> str:
    return RunDirectory(view.model_dir).keras_file(step, suffix)


def _export_quantized(view: RunView, model: keras.Model, result: ServingExport,
                      mode: str, saved_model: bool, keras_file: str | bool | None,
                      examples: bool) -> None:
    """The quantized copy's files and the float32 and quantized eval metrics."""
    quantized = quantized_copy(model, mode)
    result.float32_metrics = evaluate_model(view, model)
    result.quantized_metrics = evaluate_model(view, quantized)
    if saved_model:
        path = RunDirectory(view.model_dir).export_version(result.step, mode)
        result.quantized_saved_model = _saved_model(view, quantized, path, True, examples)
    if keras_file:
        path = (keras_file[:-len(".keras")] + f"-{mode}.keras" if isinstance(keras_file, str)
                else _keras_path(view, result.step, f"-{mode}"))
        result.quantized_keras_file = save_keras_file(quantized, path)
