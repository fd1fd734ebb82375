"""`cloned`: the user's compiled model rebuilt with its weights, whatever it was compiled with."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tputrain.runtime.keras_clone import cloned


def my_loss(y_true, y_pred):  # a plain custom loss, registered nowhere (as in many projects)
    return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)


def my_metric(y_true, y_pred):
    return tf.reduce_mean(tf.abs(y_true - y_pred), axis=-1)


class MyLoss(keras.losses.Loss):  # a custom loss class, not registered
    def call(self, y_true, y_pred):
        return tf.reduce_mean(tf.abs(y_true - y_pred), axis=-1)


def _sequential():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])


def _functional():
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(2)(inputs)))


@pytest.mark.parametrize("build", [_sequential, _functional])
@pytest.mark.parametrize("loss, metrics", [(my_loss, [my_metric]), (MyLoss(), ["mae"]),
                                           ({"dense_1": my_loss}, None)])
def test_a_model_compiled_with_unregistered_functions_or_classes_is_cloned(build, loss, metrics):
    """Keras's clone_model compiles the copy from the model's compile config, and
    deserializing an unregistered function or class there failed."""
    model = build()
    if isinstance(loss, dict):  # by output name
        loss = {model.layers[-1].name: my_loss}
    model.compile(optimizer="sgd", loss=loss, metrics=metrics)
    copy = cloned(model)
    assert copy is not model
    for ours, theirs in zip(copy.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(ours, theirs)
    x = np.ones((4, 3), "float32")
    np.testing.assert_array_equal(copy.predict(x, verbose=0), model.predict(x, verbose=0))


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_a_model_that_cannot_be_rebuilt_is_refused_in_one_short_line_with_the_fix_first():
    """A subclassed model without a config: Keras's reason ran to 1,853 characters over
    9 lines, the fix ("pass a function") at its very end."""
    model = Subclassed()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    with pytest.raises(TypeError) as raised:
        cloned(model)
    message = str(raised.value)
    assert message.startswith("KerasTask could not rebuild Subclassed: pass a function that "
                              "builds and compiles it"), message
    assert "\n" not in message and len(message) < 400, message


def test_an_adapted_normalization_is_the_models_in_the_copy():
    """`Normalization.adapt` keeps its mean and variance as constants made when the
    layer is built; `set_weights` left the copy's at 0 and 1, so `tputrain.fit` trained
    (and exported) on the raw features: outputs 2e4 apart."""
    x = (np.random.default_rng(0).normal(size=(64, 4)) * 50 + 200).astype(np.float32)
    norm = keras.layers.Normalization()
    norm.adapt(x)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(norm(inputs)))
    np.testing.assert_allclose(cloned(model)(x), model(x), atol=1e-5)


def test_a_weight_frozen_on_its_own_stays_frozen_in_the_copy():
    """`layer.kernel.trainable = False` is in no config: the copy trained that kernel
    (and handed it back into the user's frozen weight)."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8)
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden(inputs)))
    hidden.kernel.trainable = False
    copy = cloned(model)
    assert [v.path for v in copy.trainable_variables] == [
        v.path for v in model.trainable_variables]
    assert len(copy.trainable_variables) == 3
