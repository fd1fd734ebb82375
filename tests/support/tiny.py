"""A tiny Task on in-memory data, shared by the trainer and checkpoint tests."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tputrain


def devices(n: int) -> list[str]:
    return [f"/cpu:{i}" for i in range(n)]


def strategy_for(replicas: int) -> tf.distribute.Strategy:
    if replicas == 1:
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    # CPU-only MirroredStrategy defaults to collective all-reduce, whose group keys
    # restart at 1 for every strategy: a 4-replica strategy after a 2-replica one in
    # the same process then aborts. Reducing on one device avoids that (same maths).
    return tf.distribute.MirroredStrategy(
        devices(replicas), cross_device_ops=tf.distribute.ReductionToOneDevice())


class TinyTask(tputrain.Task):
    """Linear-ish classifier with L2 regularisation (and optional dropout)."""

    def __init__(self, num_examples: int = 256, dropout: float = 0.0, l2: float = 1e-2,
                 finite_train: bool = False, learning_rate: float = 0.05):
        rng = np.random.RandomState(0)
        self.x = rng.randn(num_examples, 8).astype(np.float32)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).astype(np.int64)
        self.dropout = dropout
        self.l2 = l2
        self.finite_train = finite_train
        self.learning_rate = learning_rate

    def build_model(self) -> keras.Model:
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(16, activation="relu",
                               kernel_regularizer=keras.regularizers.L2(self.l2))(inputs)
        if self.dropout:
            h = keras.layers.Dropout(self.dropout, seed=1)(h)
        logits = keras.layers.Dense(2, dtype="float32")(h)
        return keras.Model({"x": inputs}, logits)

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": self.x}, self.y))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        if split == "train" and not self.finite_train:
            dataset = dataset.repeat()
        return dataset.batch(batch, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self):
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]

    def build_optimizer(self):
        return keras.optimizers.SGD(self.learning_rate, momentum=0.9)


def model_bytes(task, bytes_per_value: int = 4) -> int:
    """Bytes of the task's model's trainable weights."""
    return sum(int(np.prod(w.shape)) for w in task.build_model().trainable_weights) \
        * bytes_per_value


def weights(trainer: tputrain.Trainer) -> list[np.ndarray]:
    return [np.asarray(w) for w in trainer.model.get_weights()]


def spy_calls(monkeypatch, module, keys: dict[str, str]) -> dict[str, int]:
    """Counts the calls (in a step: the traces) of `module`'s functions, as
    `{function name: key}` asks: the counts by key, updated as they happen."""
    calls = {key: 0 for key in keys.values()}
    for name, key in keys.items():
        original = getattr(module, name)

        def spy(*args, original=original, key=key, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    return calls


class TraceCountingTask(TinyTask):
    """TinyTask that counts the traces of its gradient computation (each trace calls it
    once): how many times a loop traced its step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.traces = 0

    def compute_gradients(self, *args, **kwargs):
        self.traces += 1
        return super().compute_gradients(*args, **kwargs)
