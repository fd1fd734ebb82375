"""Precision audit: which layers drift in bf16/fp16, and does the drift change the metrics?

Moving to `mixed_bfloat16` is the biggest speed-up on TPUs (and on CPUs with
AMX/AVX512-BF16), and its first pitfall is silent drift. The audit builds the
task's model once, then runs the same weights three ways on representative
eval batches:

1. every layer in float32 (the reference);
2. under the target policy, as training would run it (including the gin
   `override_layer_dtypes.keep_float32_layers`): each layer's *cumulative*
   relative error, and the eval metrics;
3. once per low-precision layer, with only that layer at the target policy: its
   *local* error, the drift the layer itself adds. Errors propagate, so only the
   local error says which layer to keep in float32.

Layers whose local error exceeds `tolerance` are flagged; the eval-metric delta
(target minus float32) is what decides whether the drift matters
(`AuditReport.metrics_ok`). Keep a flagged layer in float32 with
`PrecisionOptions.keep_float32_layers = ['name']` and rerun.
`tputrain audit-precision` (tputrain/cli/audit_precision.py) runs it on a gin config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.data import InputContext
from tputrain.data.options import without_autotune
from tputrain.checkpointing.model_variables import model_trackables
from tputrain.precision.layers import override_layer_dtypes, sublayers
from tputrain.options import PrecisionOptions, build_part
from tputrain.precision.policy import set_precision_policy, to_float32
from tputrain.task import Task


# The audit of a model never trained: its metrics are chance in both precisions.
UNTRAINED = ("weights: the initial (untrained) weights, no checkpoint given: their metrics say "
             "little about a trained model's drift; audit a trained run with "
             "`tputrain audit-precision --model_dir=DIR` (or --checkpoint=PREFIX)")


@dataclasses.dataclass
class LayerError:
    """One layer's drift: relative L2 error of its output against float32."""

    name: str
    class_name: str
    compute_dtype: str
    cumulative_error: float
    local_error: float | None  # None: in float32 under the policy, or the identity at inference
    flagged: bool


@dataclasses.dataclass
class AuditReport:
    """Per-layer errors and eval metrics in float32 and under `policy`."""

    policy: str
    tolerance: float
    metric_tolerance: float
    layers: list[LayerError]
    metrics_float32: dict[str, float]
    metrics_policy: dict[str, float]
    examples: int
    checkpoint: str | None = None  # the weights audited; None: the initial ones

    @property
    def metric_deltas(self) -> dict[str, float]:
        return {k: self.metrics_policy[k] - self.metrics_float32[k] for k in self.metrics_float32}

    @property
    def flagged_layers(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.flagged]

    @property
    def metrics_ok(self) -> bool:
        """Every metric moved by at most `metric_tolerance`; the loss is judged
        relatively, and only when the task has no other metric."""
        deltas = self.metric_deltas
        judged = [k for k in deltas if k != "loss"] or ["loss"]
        for key in judged:
            scale = max(abs(self.metrics_float32[key]), 1e-12) if key == "loss" else 1.0
            if abs(deltas[key]) / scale > self.metric_tolerance:
                return False
        return True

    def to_dict(self) -> dict[str, Any]:
        return dict(policy=self.policy, tolerance=self.tolerance,
                    metric_tolerance=self.metric_tolerance, examples=self.examples,
                    flagged_layers=self.flagged_layers, metrics_ok=self.metrics_ok,
                    metrics_float32=self.metrics_float32, metrics_policy=self.metrics_policy,
                    metric_deltas=self.metric_deltas, checkpoint=self.checkpoint,
                    layers=[dataclasses.asdict(layer) for layer in self.layers])

    def format(self) -> str:
        """A table for the terminal: one row per layer, then the metrics."""
        rows = [f"precision audit: {self.policy} vs float32 on {self.examples} examples "
                f"(flag: local error > {self.tolerance:g})",
                f"weights: {self.checkpoint}" if self.checkpoint else UNTRAINED,
                f"{'layer':<28} {'class':<22} {'dtype':<9} {'cumulative':>11} {'local':>11}"]
        for layer in self.layers:
            local = "-" if layer.local_error is None else f"{layer.local_error:.3e}"
            mark = "  <-- FLAGGED" if layer.flagged else ""
            rows.append(f"{layer.name:<28} {layer.class_name:<22} {layer.compute_dtype:<9} "
                        f"{layer.cumulative_error:>11.3e} {local:>11}{mark}")
        for key, delta in self.metric_deltas.items():
            rows.append(f"metric {key}: float32 {self.metrics_float32[key]:.6g}, "
                        f"{self.policy} {self.metrics_policy[key]:.6g}, delta {delta:+.4g}")
        verdict = "within" if self.metrics_ok else "OVER"
        rows.append(f"metric delta {verdict} tolerance {self.metric_tolerance:g}")
        if self.flagged_layers:
            names = ", ".join(repr(n) for n in self.flagged_layers)
            rows.append(f"to keep the flagged layers in float32, bind: "
                        f"PrecisionOptions.keep_float32_layers = [{names}]")
        return "\n".join(rows)


def relative_error(reference: Any, value: Any) -> float:
    """||value - reference|| / ||reference|| over all floating tensors of two nests."""
    num = den = 0.0
    for ref, val in zip(tf.nest.flatten(reference), tf.nest.flatten(value)):
        ref = np.asarray(keras.ops.convert_to_numpy(to_float32(ref)))
        if not np.issubdtype(ref.dtype, np.floating):
            continue
        val = np.asarray(keras.ops.convert_to_numpy(to_float32(val)), np.float64)
        ref = ref.astype(np.float64)
        num += float(np.sum((val - ref) ** 2))
        den += float(np.sum(ref ** 2))
    return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


# Layers that compute nothing at inference (dropout, noise): in bf16 their output differs
# from float32's only by the cast of their input, which the layer before reports.
INFERENCE_IDENTITY = (keras.layers.Dropout, keras.layers.GaussianNoise,
                      keras.layers.GaussianDropout, keras.layers.AlphaDropout)


def _auditable_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """Top-level layers whose output is one symbolic tensor nest we can fetch."""
    layers = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        try:
            layer.output  # pylint: disable=pointless-statement
        except (AttributeError, ValueError, RuntimeError):
            continue  # shared layers (several call sites) have no single output
        layers.append(layer)
    return layers


def _activation_model(model: keras.Model, layers: Sequence[keras.layers.Layer]) -> keras.Model:
    try:
        return keras.Model(model.inputs, [layer.output for layer in layers])
    except (AttributeError, ValueError, TypeError) as error:
        raise ValueError(
            f"the audit reads per-layer activations from a functional or Sequential model, "
            f"and {type(model).__name__} {model.name!r} is not one ({error}); build it with "
            "keras.Input(...) and the functional API") from error


def _evaluate(task: Task, model: keras.Model, batches: Sequence[Any]) -> dict[str, float]:
    metrics = list(task.build_metrics())
    losses, weights = [], []
    for features, labels, *weight in batches:  # padded eval batches carry weights
        outputs = to_float32(model(features, training=False))
        losses.append(np.ravel(np.asarray(task.compute_loss(labels, outputs), np.float64)))
        weights.append(np.ravel(weight[0]) if weight else np.ones_like(losses[-1]))
        if weight:
            task.update_metrics(metrics, labels, outputs, sample_weight=weight[0])
        else:
            task.update_metrics(metrics, labels, outputs)
    results = {"loss": float(np.average(np.concatenate(losses), weights=np.concatenate(weights)))}
    results.update({m.name: float(m.result()) for m in metrics})
    return results


def _restore(model: keras.Model, checkpoint: str) -> str:
    path = tf.train.latest_checkpoint(checkpoint) if tf.io.gfile.isdir(checkpoint) else checkpoint
    if not path:
        raise ValueError(f"no checkpoint in {checkpoint!r}: pass a model_dir/checkpoints folder "
                         "or a checkpoint prefix, or omit it to audit the initial weights")
    tf.train.Checkpoint(**model_trackables(model, path)).restore(path).expect_partial()
    return path


def _build_model(task: Task, policy: str) -> keras.Model:
    """The task's model built under `policy`, leaving the global policy as it was."""
    previous = keras.mixed_precision.global_policy().name
    set_precision_policy(policy)
    try:
        return task.build_model()
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _measure(task: Task, model: keras.Model, batches: Sequence[Any],
             tolerance: float) -> tuple[list[LayerError], dict[str, float], dict[str, float]]:
    """(per-layer errors, float32 metrics, target-policy metrics): the three runs of
    the module docstring, switching layer policies in place and restoring them."""
    layers = _auditable_layers(model)
    activations = _activation_model(model, layers)
    every_layer = sublayers(model)
    target = {id(l): l.dtype_policy for l in every_layer}
    features = batches[0][0]

    def run_with(low_precision: Sequence[keras.layers.Layer]) -> list[Any]:
        for layer in every_layer:
            layer.dtype_policy = "float32"
        for layer in low_precision:
            for sub in sublayers(layer):
                sub.dtype_policy = target[id(sub)]
        return activations(features, training=False)

    try:
        reference = run_with([])
        metrics_float32 = _evaluate(task, model, batches)
        cumulative = run_with(every_layer)
        metrics_policy = _evaluate(task, model, batches)
        results = []
        for index, layer in enumerate(layers):
            nested_low = any(target[id(s)].compute_dtype != "float32" for s in sublayers(layer))
            local = None
            if nested_low and not isinstance(layer, INFERENCE_IDENTITY):
                local = relative_error(reference[index], run_with([layer])[index])
            results.append(LayerError(
                name=layer.name, class_name=type(layer).__name__,
                compute_dtype=target[id(layer)].compute_dtype,
                cumulative_error=relative_error(reference[index], cumulative[index]),
                local_error=local, flagged=local is not None and local > tolerance))
    finally:
        for layer in every_layer:
            layer.dtype_policy = target[id(layer)]
    return results, metrics_float32, metrics_policy


def audit_precision(task: Task, policy: str = "mixed_bfloat16", global_batch_size: int = 64,
                    num_batches: int = 4, tolerance: float = 0.05,
                    metric_tolerance: float = 0.01, checkpoint: str | None = None,
                    split: str = "eval") -> AuditReport:
    """Runs the audit described in the module docstring and returns its report.

    Args:
      task: the task whose model and inputs are audited.
      policy: the target policy ("mixed_bfloat16" or "mixed_float16").
      global_batch_size: examples per batch read from `split`.
      num_batches: batches for the metrics; the first one also gives activations.
      tolerance: flag layers whose local relative error exceeds it (bf16 rounding
        alone is ~0.4%; a matmul's accumulated error stays around 1%).
      metric_tolerance: allowed absolute change of each metric (relative for the
        loss when the task has no metric).
      checkpoint: a model_dir/checkpoints folder or checkpoint prefix to load
        weights from; None audits the freshly initialised weights.
      split: the input split to read.
    """
    if policy == "float32":
        raise ValueError("audit_precision.policy is float32: audit a mixed policy, "
                         "e.g. 'mixed_bfloat16'")
    model = _build_model(task, policy)
    context = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1,
                           global_batch_size=global_batch_size)
    batches = list(without_autotune(task.build_inputs(split, context).take(num_batches)))
    if not batches:
        raise ValueError(f"the {split!r} split yielded no batch of {global_batch_size}: use a "
                         "smaller audit_precision.global_batch_size")
    if not (model.built and model.variables):
        model(batches[0][0], training=False)
    # As training would run it: the configured float32 layers (deprecated names included).
    override_layer_dtypes(model, build_part(PrecisionOptions).keep_float32_layers)
    restored = _restore(model, checkpoint) if checkpoint else None
    if restored:
        logging.info("tputrain: audit weights from %s", restored)
    else:
        logging.warning("tputrain: %s", UNTRAINED)
    layers, metrics_float32, metrics_policy = _measure(task, model, batches, tolerance)
    return AuditReport(policy=policy, tolerance=tolerance, metric_tolerance=metric_tolerance,
                       layers=layers, metrics_float32=metrics_float32,
                       metrics_policy=metrics_policy, checkpoint=restored,
                       examples=sum(int(tf.nest.flatten(b[1])[0].shape[0]) for b in batches))
