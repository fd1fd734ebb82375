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
