"""Keras `fit` conventions: `(x, y, sample_weight)` batches and `class_weight` train
exactly as `model.fit` does on the same data, on 1 and 2 replicas."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import strategy_for

BATCH, STEPS, LR = 8, 6, 0.1


def _data(classes: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Two inputs, labels (class ids, or a regression target) and uneven weights."""
    rng = np.random.default_rng(3)
    x = {"signal": rng.normal(size=(BATCH * STEPS, 5)).astype(np.float32),
         "bias": rng.normal(size=(BATCH * STEPS, 1)).astype(np.float32)}
    if classes:
        y = rng.integers(0, classes, size=BATCH * STEPS).astype(np.int64)
    else:
        y = (x["signal"][:, :1] * 3.0 - x["bias"]).astype(np.float32)
    weights = rng.uniform(0.0, 3.0, size=BATCH * STEPS).astype(np.float32)
    weights[::5] = 0.0
    return x, y, weights


class _WeightedTask(tputrain.Task):
    """A two-input model: a 1-unit regression head, or a 3-class softmax classifier."""

    def __init__(self, classes: int = 0, weighted: bool = True):
        self.classes, self.weighted = classes, weighted
        self.x, self.y, self.weights = _data(classes)

    def build_model(self) -> keras.Model:
        signal, bias = keras.Input((5,), name="signal"), keras.Input((1,), name="bias")
        hidden = keras.layers.Dense(4, activation="tanh")(
            keras.layers.Concatenate()([signal, bias]))
        head = keras.layers.Dense(self.classes or 1,
                                  activation="softmax" if self.classes else None)
        return keras.Model({"signal": signal, "bias": bias}, head(hidden))

    def keras_loss(self) -> keras.losses.Loss:
        return (keras.losses.SparseCategoricalCrossentropy() if self.classes
                else keras.losses.MeanSquaredError())

    def elements(self) -> tuple:
        return (self.x, self.y, self.weights) if self.weighted else (self.x, self.y)

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(self.elements())
        return (dataset.repeat() if split == "train" else dataset).batch(
            batch, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        if self.classes:
            return keras.losses.sparse_categorical_crossentropy(labels, outputs)
        return keras.losses.mean_squared_error(labels, outputs)

    def build_metrics(self):
        if self.classes:
            return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
        return [keras.metrics.MeanAbsoluteError(name="mae")]

    def build_optimizer(self):
        return keras.optimizers.SGD(LR)


def _fit(task: _WeightedTask, initial: list[np.ndarray], **fit_kwargs) -> keras.Model:
    """`model.fit` on one device from the same weights, on the global batches in order."""
    model = task.build_model()
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=task.keras_loss(), jit_compile=False)
    dataset = tf.data.Dataset.from_tensor_slices(task.elements()).batch(BATCH)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, **fit_kwargs)
    return model


def _train(task: _WeightedTask, model_dir, replicas: int, **options) -> list[np.ndarray]:
    trainer = tputrain.Trainer(task, str(model_dir), strategy=strategy_for(replicas),
                               train_steps=STEPS, steps_per_loop=3, global_batch_size=BATCH,
                               report_mfu=False, jit_compile=False, **options)
    initial = [np.asarray(w) for w in trainer.model.get_weights()]
    trainer.train()
    return initial, [np.asarray(w) for w in trainer.model.get_weights()]


def _max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.parametrize("replicas", [1, 2])
def test_sample_weights_train_like_keras_fit(tmp_path, replicas):
    task = _WeightedTask()
    initial, trained = _train(task, tmp_path / "run", replicas)
    expected = _fit(task, initial).get_weights()
    assert _max_difference(trained, initial) > 1e-2  # it trained
    assert _max_difference(trained, expected) < 1e-5


@pytest.mark.parametrize("replicas", [1, 2])
def test_class_weight_trains_like_keras_fit(tmp_path, replicas):
    class_weight = {0: 0.5, 1: 3.0, 2: 1.0}
    task = _WeightedTask(classes=3, weighted=False)
    initial, trained = _train(task, tmp_path / "run", replicas, class_weight=class_weight)
    expected = _fit(task, initial, class_weight=class_weight).get_weights()
    unweighted = _fit(task, initial).get_weights()
    assert _max_difference(expected, unweighted) > 1e-3  # the weights matter here
    assert _max_difference(trained, expected) < 1e-5
