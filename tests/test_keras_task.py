"""`KerasTask`: users' Keras models as they are. A model class that overrides Keras's
`train_step` trains once its step is ported to the Task (docs/tasks.md, "Port a
model's train_step"), and is refused, with that port, only where its step would be
dropped."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import final_weights
from tiny import strategy_for

BATCH, STEPS, NOISE = 8, 6, 0.1


class Noisy(keras.Model):
    """A Keras subclass as users write it for `model.fit`: its own `train_step` (noise on
    the inputs) and its own state (`seen`, the examples trained on, summed over replicas)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.logits = keras.layers.Dense(3)
        self.seen = self.add_weight(shape=(), dtype="int64", initializer="zeros",
                                    trainable=False, aggregation="sum", name="seen")
        self.noise = keras.random.SeedGenerator(0)

    def call(self, x, training=False):
        return self.logits(self.hidden(x))

    def train_step(self, data):
        x, y = data
        noisy = x + NOISE * keras.random.normal(tf.shape(x), seed=self.noise)
        with tf.GradientTape() as tape:
            outputs = self(noisy, training=True)
            loss = self.compute_loss(noisy, y, outputs)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.seen.assign_add(tf.cast(tf.shape(y)[0], "int64"))
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, outputs)
        return {metric.name: metric.result() for metric in self.metrics}


class Ported(tputrain.KerasTask):
    """Noisy's step, ported as docs/tasks.md shows: per-replica noise, the loss over the
    global batch, the model's own state updated."""

    def train_step(self, batch, model, optimizer, metrics, global_batch_size):
        x, y = batch
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        seed = tf.stack([tf.cast(optimizer.iterations, tf.int32), tf.cast(replica, tf.int32)])
        noisy = x + NOISE * tf.random.stateless_normal(tf.shape(x), seed)
        with tf.GradientTape() as tape:
            outputs = model(noisy, training=True)
            loss = tf.nn.compute_average_loss(self.compute_loss(y, outputs),
                                              global_batch_size=global_batch_size)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        model.seen.assign_add(tf.cast(tf.shape(y)[0], "int64"))
        self.update_metrics(metrics, y, outputs)
        return {"loss": loss}


def build_noisy() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = Noisy()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def noisy_data(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 5)).astype(np.float32)
    return x, (np.argmax(x[:, :3], -1)).astype(np.int64)


def fit_noisy(model_dir, replicas: int, steps: int, task=Ported) -> dict[str, float]:
    return tputrain.fit(build_noisy, noisy_data(BATCH * STEPS, 1), noisy_data(16, 2),
                        task=task, model_dir=str(model_dir), steps=steps, batch_size=BATCH,
                        shuffle=False, steps_per_loop=2, checkpoint_every=2,
                        strategy=strategy_for(replicas), report_mfu=False, jit_compile=False)


def test_the_model_class_still_trains_under_keras_fit():
    """The port keeps the class as it is: `model.fit` still runs its own step."""
    model = build_noisy()
    model.fit(*noisy_data(BATCH * 2, 1), batch_size=BATCH, epochs=1, verbose=0)
    assert int(model.seen.numpy()) == 2 * BATCH


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_a_ported_train_step_trains_the_model_and_resumes_bitwise(tmp_path, replicas):
    """The model class still overrides `train_step`; the Task's step trains it (with its
    own state: `seen` counts every replica's examples once), and a run resumed halfway
    ends bitwise where the uninterrupted one does."""
    logs = fit_noisy(tmp_path / "reference", replicas, STEPS)
    assert np.isfinite(logs["loss"])
    reference = final_weights(str(tmp_path / "reference"))
    seen = [value for key, value in reference.items() if "seen" in key]
    assert seen == [STEPS * BATCH]
    fit_noisy(tmp_path / "resumed", replicas, STEPS // 2)
    fit_noisy(tmp_path / "resumed", replicas, STEPS)
    resumed = final_weights(str(tmp_path / "resumed"))
    assert resumed.keys() == reference.keys()
    for key in reference:
        np.testing.assert_array_equal(resumed[key], reference[key], err_msg=key)


def test_a_model_train_step_the_task_would_drop_is_refused_with_the_port(tmp_path):
    """Through `tputrain.fit` with the plain KerasTask the model's step would be dropped:
    the error shows the port for fit's users (a KerasTask subclass passed as `task=`), on
    one line without gin's note (no gin is in use), before anything is written."""
    with pytest.raises(TypeError) as caught:
        fit_noisy(tmp_path / "run", 1, STEPS, task=tputrain.KerasTask)
    message = str(caught.value)
    assert "Noisy.train_step" in message
    assert "class Ported(tputrain.KerasTask)" in message
    assert "def train_step(self, batch, model, optimizer, metrics, global_batch_size)" in message
    assert "task=Ported" in message
    assert "In call to configurable" not in message and "\n" not in message
    assert not (tmp_path / "run" / "checkpoints").exists()
