"""A LoRA run's checkpoint for serving: merged or kept LoRA, SavedModel and `.keras`
files with the trained outputs, int8 quantization measured against float32."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from hub import lora_trainer, token_batch
from tputrain.optim.ema import averaged_weights
from tputrain.serving.keras_saving import (export_for_serving, load_keras_file, lora_layers,
                                   merged_copy, quantized_copy)

pytestmark = pytest.mark.same_worker("keras_saving")
INT8_ACCURACY_TOLERANCE = 0.02  # docs/keras_hub.md states it


@pytest.fixture(scope="module")
def lora_served(tmp_path_factory):
    """(trainer, the trained model's logits for `token_batch()` with its EMA weights, as
    exported): 8 LoRA steps on 2 replicas."""
    trainer = lora_trainer(tmp_path_factory.mktemp("lora"), replicas=2)
    trainer.train()
    with averaged_weights(trainer.ema):
        expected = trainer.model(token_batch(), training=False).numpy()
    yield trainer, expected
    trainer.close()


def _served(path, features):
    return tf.saved_model.load(path).signatures["serving_default"](
        **{k: tf.constant(v) for k, v in features.items()})["outputs"].numpy()


def _saved_keys(path):
    return [name for name, _ in tf.train.list_variables(f"{path}/variables/variables")]


def test_a_merged_copy_has_no_lora_and_the_same_outputs():
    inputs = keras.Input((8,), name="features")
    hidden = keras.layers.Dense(16, name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden))
    model.get_layer("hidden").enable_lora(2)
    model.get_layer("hidden").lora_kernel_b.assign(tf.random.normal((2, 16), seed=1))
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    copy = merged_copy(model)
    assert lora_layers(copy) == [] and len(copy.weights) == 4
    np.testing.assert_allclose(copy(x).numpy(), model(x).numpy(), atol=1e-5)
    assert lora_layers(model)  # the model itself keeps its LoRA


@pytest.mark.slow
def test_a_gemma_backbone_merges_and_quantizes_too():
    """Keras-Hub's Gemma (grouped-query attention, no biases): LoRA leaves exactly the
    factors trainable; its merged copy computes the same logits."""
    from tputrain.serving.keras_saving import lora_variables
    from tputrain.tasks.keras_hub_lm import KerasHubLMTask

    config = {"vocabulary_size": 100, "num_layers": 2, "num_query_heads": 2,
              "num_key_value_heads": 1, "hidden_dim": 16, "intermediate_dim": 32,
              "head_dim": 8, "dropout": 0.0}
    model = KerasHubLMTask(backbone="GemmaBackbone", backbone_config=config,
                           lora_rank=2).build_model()
    assert {v.path for v in model.trainable_variables} == {v.path for v in lora_variables(model)}
    for factor in lora_variables(model):
        factor.assign(np.random.default_rng(0).normal(size=factor.shape) * 0.3)
    expected = np.asarray(model(token_batch()))
    np.testing.assert_allclose(np.asarray(merged_copy(model)(token_batch())), expected,
                               atol=1e-5)
    assert np.abs(np.asarray(quantized_copy(model)(token_batch())) - expected).max() < 0.1


def test_merged_exports_serve_the_trained_outputs(lora_served):
    trainer, expected = lora_served
    result = export_for_serving(trainer, lora="merge", keras_file=True)
    assert result.saved_model.endswith("export_merged/8")
    assert result.keras_file.endswith("keras/8.keras")
    np.testing.assert_allclose(_served(result.saved_model, token_batch()), expected, atol=1e-5)
    loaded = keras.saving.load_model(result.keras_file)
    assert lora_layers(loaded) == []
    np.testing.assert_allclose(loaded(token_batch()).numpy(), expected, atol=1e-5)
    assert not any("lora" in key for key in _saved_keys(result.saved_model))


def test_a_kept_lora_saved_model_serves_the_factors_apart(lora_served):
    trainer, expected = lora_served
    result = export_for_serving(trainer, lora="keep")
    assert result.saved_model.endswith("export/8")
    assert any("lora_kernel_b" in key for key in _saved_keys(result.saved_model))
    np.testing.assert_allclose(_served(result.saved_model, token_batch()), expected, atol=1e-5)


def test_a_kept_lora_keras_file_is_the_base_beside_keras_hubs_factor_file(lora_served, tmp_path):
    """keras_lora="keep": the `.keras` file holds the base (kernels without the factors)
    and Keras-Hub's `.lora.h5` the factors; loading both gives the trained outputs."""
    trainer, expected = lora_served
    result = export_for_serving(trainer, saved_model=False, keras_file=str(tmp_path / "lm.keras"),
                                keras_lora="keep")
    assert result.lora_file == str(tmp_path / "lm.lora.h5")
    loaded = keras.saving.load_model(result.keras_file)
    assert lora_layers(loaded) == []
    loaded.backbone.load_lora_weights(result.lora_file)
    assert len(lora_layers(loaded)) == 4
    np.testing.assert_allclose(loaded(token_batch()).numpy(), expected, atol=1e-5)
    assert any(line.startswith("lora factors: ") for line in result.report())


def test_int8_is_measured_against_float32_and_saved(lora_served, tmp_path):
    trainer, expected = lora_served
    result = export_for_serving(trainer, saved_model=False, quantize="int8",
                                keras_file=str(tmp_path / "lm.keras"))
    assert result.quantized_keras_file == str(tmp_path / "lm-int8.keras")
    assert set(result.float32_metrics) == set(result.quantized_metrics) == {"loss", "accuracy"}
    assert abs(result.quantized_metrics["accuracy"] - result.float32_metrics["accuracy"]) \
        <= INT8_ACCURACY_TOLERANCE
    loaded = load_keras_file(result.quantized_keras_file)
    assert any(getattr(layer, "quantization_mode", None) == "int8"
               for layer in loaded._flatten_layers())
    quantized = loaded(token_batch()).numpy()
    assert np.abs(quantized - expected).max() < 0.05  # int8 kernels: close, not equal
    assert any(line.startswith("eval accuracy: float32") for line in result.report())


def test_quantize_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="int8"):
        quantized_copy(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), "int3")


@pytest.mark.slow
def test_the_export_command_writes_merged_keras_and_int8_and_reports_accuracy(lora_served, tmp_path):
    trainer, expected = lora_served
    config = tmp_path / "lora.gin"
    config.write_text("\n".join([
        "Trainer.task = @KerasHubLMTask()", "Trainer.train_steps = 8",
        "Trainer.global_batch_size = 8", "Trainer.ema_decay = 0.5",
        "KerasHubLMTask.lora_rank = 4", "KerasHubLMTask.train_rows = 64",
        "KerasHubLMTask.eval_rows = 16"]))
    result = subprocess.run(
        [sys.executable, "-m", "tputrain.cli", "export", f"--gin_file={config}",
         f"--model_dir={trainer.model_dir}", "--lora=merge", "--keras", "--quantize=int8",
         f"--export_dir={tmp_path / 'served'}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval accuracy: float32" in result.stdout, result.stdout
    np.testing.assert_allclose(_served(str(tmp_path / "served"), token_batch()), expected,
                               atol=1e-5)
    assert tf.io.gfile.exists(f"{trainer.model_dir}/keras/8-int8.keras")


def test_the_export_command_refuses_an_unknown_quantization_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tputrain.cli", "export",
                             f"--model_dir={tmp_path}", "--quantize=int3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "int8" in result.stderr
