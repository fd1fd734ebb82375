"""Precision audit: flags the bf16-sensitive layer; keeping it float32 fixes the metric."""

import json
import os
import subprocess
import sys

import gin
import keras
import numpy as np
import pytest

import tputrain
from sensitive import SensitiveTask
from tiny import strategy_for

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


def test_audit_flags_only_the_sensitive_layer():
    report = tputrain.audit_precision(SensitiveTask(), policy="mixed_bfloat16")
    by_name = {layer.name: layer for layer in report.layers}
    assert report.flagged_layers == ["offset_cancel"]
    assert by_name["offset_cancel"].local_error > 0.1
    assert by_name["features"].local_error < 0.01  # an ordinary bf16 matmul
    assert by_name["logits"].compute_dtype == "float32" and by_name["logits"].local_error is None
    # Errors propagate: the layer after the culprit drifts too, but adds almost nothing.
    assert by_name["identity"].cumulative_error > 0.1 > by_name["identity"].local_error
    assert report.metrics_float32["accuracy"] == 1.0
    assert report.metric_deltas["accuracy"] < -0.05
    assert not report.metrics_ok
    assert "keep_float32_layers = ['offset_cancel']" in report.format()


def test_keeping_the_flagged_layer_float32_brings_the_metric_back():
    gin.parse_config("override_layer_dtypes.keep_float32_layers = ['offset_cancel']")
    report = tputrain.audit_precision(SensitiveTask(), policy="mixed_bfloat16")
    assert report.flagged_layers == []
    assert {l.name: l.compute_dtype for l in report.layers}["offset_cancel"] == "float32"
    assert abs(report.metric_deltas["accuracy"]) <= report.metric_tolerance
    assert report.metrics_ok


def test_trainer_applies_the_override_when_building(tmp_path):
    gin.parse_config("override_layer_dtypes.keep_float32_layers = ['offset_*']")
    trainer = tputrain.Trainer(SensitiveTask(), str(tmp_path / "run"), strategy=strategy_for(2),
                               precision="mixed_bfloat16", train_steps=2, steps_per_loop=2,
                               global_batch_size=16, report_mfu=False)
    dtypes = {l.name: l.compute_dtype for l in trainer.model.layers[1:]}
    assert dtypes == {"features": "bfloat16", "offset_cancel": "float32",
                      "identity": "bfloat16", "logits": "float32"}
    logs = trainer.train()
    assert logs["accuracy"] > 0.99  # ~0.65 with offset_cancel in bf16 (see the audit test)


def test_override_reaches_nested_layers_and_rejects_unknown_names():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    x = keras.Input((4, 8))
    y = keras.layers.MultiHeadAttention(2, 4, name="attention")(x, x)
    model = keras.Model(x, keras.layers.Dense(2, name="out")(y))
    tputrain.override_layer_dtypes(model, keep_float32_layers=["attention"])
    attention = model.get_layer("attention")
    assert {l.compute_dtype for l in attention._flatten_layers()} == {"float32"}
    assert model.get_layer("out").compute_dtype == "bfloat16"
    assert model(np.ones((1, 4, 8), np.float32)).dtype == "bfloat16"
    with pytest.raises(ValueError, match="no layer .* named 'atention'.*attention, out"):
        tputrain.override_layer_dtypes(model, keep_float32_layers=["atention"])


def run_cli(tmp_path, *extra):
    output = tmp_path / f"report{len(extra)}.json"
    env = dict(os.environ, PYTHONPATH=SUPPORT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    command = [sys.executable, "-m", "tputrain.run", "audit-precision", "--gin_import=sensitive",
               "--gin_param=audit_precision.task = @SensitiveTask()", f"--output={output}", *extra]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    return result, json.loads(output.read_text()) if output.exists() else None

@pytest.mark.slow

def test_cli_flags_the_layer_and_gin_override_passes(tmp_path):
    result, report = run_cli(tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "offset_cancel" in result.stdout and "FLAGGED" in result.stdout
    assert report["flagged_layers"] == ["offset_cancel"] and not report["metrics_ok"]
    result, report = run_cli(
        tmp_path, "--gin_param=override_layer_dtypes.keep_float32_layers = ['offset_cancel']")
    assert result.returncode == 0, result.stderr[-2000:]
    assert report["flagged_layers"] == [] and report["metrics_ok"]


def test_untrained_weights_are_named_untrained():
    """No checkpoint: the audit says it ran on initial weights, whose metrics (chance
    accuracy in both precisions) tell little, and how to audit a trained run."""
    report = tputrain.audit_precision(SensitiveTask(), policy="mixed_bfloat16", num_batches=1)
    assert report.checkpoint is None and report.to_dict()["checkpoint"] is None
    text = report.format()
    assert "initial (untrained) weights" in text.splitlines()[1]
    assert "--model_dir" in text


def test_cli_model_dir_without_a_checkpoint_audits_initial_weights(tmp_path):
    result, report = run_cli(tmp_path, f"--model_dir={tmp_path / 'never_trained'}")
    assert result.returncode in (0, 1), result.stderr[-2000:]
    assert f"no checkpoint in {tmp_path / 'never_trained'}/checkpoints" in result.stdout
    assert "initial (untrained) weights" in result.stdout and report["checkpoint"] is None


def test_a_dropout_layer_has_no_local_error_at_inference(tmp_path, monkeypatch):
    """Dropout is the identity at inference: its only 'error' in bf16 was the cast of its
    input, which the layer before already reports (issue 52)."""
    from tputrain.tasks.digits import DigitsTask

    monkeypatch.setenv("TPUTRAIN_CACHE_DIR", str(tmp_path))
    report = tputrain.audit_precision(DigitsTask(dropout=0.1), policy="mixed_bfloat16")
    dropouts = [layer for layer in report.layers if layer.class_name == "Dropout"]
    assert dropouts and all(layer.local_error is None for layer in dropouts), dropouts
    assert all(layer.name not in report.flagged_layers for layer in dropouts)
    hidden = [layer for layer in report.layers if layer.name.startswith("hidden_")]
    assert hidden and all(layer.local_error is not None for layer in hidden)


def test_the_audits_batches_are_read_without_autotuning(monkeypatch):
    # Its iterator is freed after num_batches (see tputrain.data.options.without_autotune).
    from iterators import autotune_of_iterators

    seen = autotune_of_iterators(monkeypatch)
    tputrain.audit_precision(SensitiveTask(), policy="mixed_bfloat16", num_batches=1)
    assert seen and all(enabled is False for enabled in seen), seen
