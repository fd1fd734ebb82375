"""`CompiledOutputs`: a compiled model's losses, loss weights and metrics paired with its
outputs as Keras's `compile` pairs them; a pairing Keras could not make is named before
anything trains."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.keras_outputs import CompiledOutputs
from tiny import strategy_for


def heads(outputs: str = "dict", **compile_args) -> keras.Model:
    """A 3-class head ("label") and a 1-unit head ("value"), as a dict or a list."""
    x = keras.Input((5,), name="x")
    hidden = keras.layers.Dense(4)(x)
    label = keras.layers.Dense(3, activation="softmax", name="label")(hidden)
    value = keras.layers.Dense(1, name="value")(hidden)
    model = keras.Model(x, {"value": value, "label": label} if outputs == "dict"
                        else [value, label])
    model.compile(optimizer="sgd", **compile_args)
    return model


def test_outputs_pair_with_losses_and_weights_by_name_and_by_position():
    by_name = CompiledOutputs(heads("dict", loss={"value": "mse"},
                                    loss_weights={"value": 0.5, "label": 2.0}))
    assert by_name.names == ["label", "value"]  # a dict's keys, sorted as Keras flattens
    assert [(o.name, o.loss, o.weight) for o in by_name.outputs] == [
        ("label", None, 2.0), ("value", "mse", 0.5)]
    by_position = CompiledOutputs(heads("list", loss=["mse", "sparse_categorical_crossentropy"],
                                        loss_weights=[0.3, 0.7]))
    assert by_position.names == ["value", "label"]  # the output layers' names
    assert [(o.loss, o.weight) for o in by_position.outputs] == [
        ("mse", 0.3), ("sparse_categorical_crossentropy", 0.7)]


def test_one_sample_weight_weights_every_output_and_a_dict_weights_each():
    compiled = CompiledOutputs(heads("dict", loss={"value": "mse", "label": "mse"},
                                     loss_weights={"value": 1.0, "label": 0.0}))
    labels = {"label": tf.zeros([2, 3]), "value": tf.ones([2, 1])}
    outputs = {"label": tf.zeros([2, 3]), "value": tf.zeros([2, 1])}
    np.testing.assert_allclose(compiled.combined(labels, outputs), [1.0, 1.0])
    np.testing.assert_allclose(compiled.combined(labels, outputs, tf.constant([2.0, 0.0])),
                               [2.0, 0.0])
    per_output = {"label": tf.constant([5.0, 5.0]), "value": tf.constant([0.5, 3.0])}
    np.testing.assert_allclose(compiled.combined(labels, outputs, per_output), [0.5, 3.0])


def test_a_loss_for_no_output_is_named_when_the_task_is_made():
    model = heads("dict", loss={"value": "mse", "labels": "sparse_categorical_crossentropy"})
    with pytest.raises(ValueError, match=r"\['labels'\].*\['label', 'value'\]"):
        tputrain.KerasTask(model, (np.zeros((4, 5), "float32"), np.zeros(4)))


def test_a_list_of_metrics_of_another_length_than_the_outputs_is_named():
    model = heads("list", loss="mse", metrics=["mae", "mse", "accuracy"])
    with pytest.raises(ValueError, match="3 entries for the model's 2 outputs"):
        tputrain.KerasTask(model, (np.zeros((4, 5), "float32"),
                                   (np.zeros((4, 1)), np.zeros(4)))).build_metrics()


def test_a_one_output_model_takes_its_loss_alone_or_in_a_dict_or_list():
    x = keras.Input((5,), name="x")
    model = keras.Model(x, keras.layers.Dense(1, name="out")(x))
    for loss, weights in (("mse", None), ({"out": "mse"}, {"out": 0.5}), (["mse"], [0.5])):
        model.compile(optimizer="sgd", loss=loss, loss_weights=weights)
        (output,) = CompiledOutputs(model).outputs
        assert (output.loss, output.weight) == ("mse", 1.0 if weights is None else 0.5)


# ------------------------------------------------------------ a loss's label rank

LOSSES = [("mse", "linear"), ("mae", "linear"), ("huber", "linear"),
          ("binary_crossentropy", "sigmoid"), (keras.losses.mean_squared_error, "linear"),
          (keras.losses.MeanSquaredError(), "linear")]


def one_unit(loss, activation: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, activation=activation)])
    model.compile(optimizer="sgd", loss=loss, jit_compile=False)
    return model


def one_unit_data(activation: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels of shape (N,) (`rank` 1) or (N, 1), as `fit` takes either."""
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    y = x.sum(1) if activation == "linear" else (x.sum(1) > 0).astype(np.float32)
    return x, (y if rank == 1 else y[:, None])


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("loss,activation", LOSSES)
def test_a_loss_gives_keras_per_example_losses_on_1d_and_2d_labels(loss, activation, rank):
    """Strings and functions, as a Loss object, have the label's rank made the output's
    (Keras's compile wraps them so): each example's loss is the compiled model's loss of
    that example alone."""
    model = one_unit(loss, activation)
    x, y = one_unit_data(activation, rank)
    outputs = model(x[:6])
    expected = [float(model.compute_loss(x[i:i + 1], y[i:i + 1], outputs[i:i + 1]))
                for i in range(6)]
    actual = CompiledOutputs(model).combined(tf.constant(y[:6]), outputs)
    assert actual.shape == (6,)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss,activation,rank", [
    ("mse", "linear", 1), ("binary_crossentropy", "sigmoid", 1),
    (keras.losses.mean_squared_error, "linear", 2)])
def test_a_loss_string_or_function_trains_as_under_keras_fit(tmp_path, loss, activation, rank):
    """1-D labels (N,) beside an (N, 1) output, or (N, 1) labels: fit's weights."""
    x, y = one_unit_data(activation, rank)
    model, expected = one_unit(loss, activation), one_unit(loss, activation)
    tputrain.fit(model, (x, y), (x, y), model_dir=str(tmp_path / "run"), steps=4, batch_size=8,
                 shuffle=False, strategy=strategy_for(1), report_mfu=False, jit_compile=False)
    expected.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for actual, wanted in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(actual, wanted, atol=1e-5)
