"""`KerasTask`: users' Keras models as they are. A model class that overrides Keras's
`train_step` trains once its step is ported to the Task (docs/tasks.md, "Port a
model's train_step"), and is refused, with that port, only where its step would be
dropped."""

from __future__ import annotations

import inspect

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


# ------------------------------------------------------------ several outputs

EPOCH_STEPS, LR = 6, 0.1


def two_output_data(examples: int, seed: int, weighted: bool) -> tuple:
    """One input; a 3-class label and a 1-unit value; uneven sample weights per output."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 5)).astype(np.float32)
    y = {"label": np.argmax(x[:, :3], -1).astype(np.int64),
         "value": (x[:, 3:4] * 2.0 - x[:, 4:5]).astype(np.float32)}
    if not weighted:
        return x, y
    weights = {"label": rng.uniform(0.0, 2.0, size=examples).astype(np.float32),
               "value": rng.uniform(0.5, 1.5, size=examples).astype(np.float32)}
    weights["label"][::4] = 0.0
    return x, y, weights


def as_list(data: tuple, kind: type = list) -> tuple:
    """`two_output_data` with labels and sample weights as lists (or tuples, for
    `from_tensor_slices`), in the outputs' order."""
    return tuple(part if i == 0 else kind([part["label"], part["value"]])
                 for i, part in enumerate(data))


def list_output_model() -> keras.Model:
    """The same heads as a list of outputs (named by their layers), compiled with lists:
    one loss function object, weights, metrics (one with its own name) by position."""
    keras.utils.set_random_seed(0)
    x = keras.Input((5,), name="x")
    hidden = keras.layers.Dense(8, activation="tanh")(x)
    model = keras.Model(x, [keras.layers.Dense(3, activation="softmax", name="label")(hidden),
                            keras.layers.Dense(1, name="value")(hidden)])
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.5),
                  loss=[keras.losses.SparseCategoricalCrossentropy(), "mse"],
                  loss_weights=[0.7, 0.3],
                  metrics=["acc", [keras.metrics.MeanSquaredError(name="mse_of_value")]],
                  weighted_metrics=["acc", None], jit_compile=False)
    return model


def two_output_model() -> keras.Model:
    """A classification head and a 1-unit regression head, compiled as Keras users do:
    a dict of losses, `loss_weights`, per-output metrics and a weighted metric."""
    keras.utils.set_random_seed(0)
    x = keras.Input((5,), name="x")
    hidden = keras.layers.Dense(8, activation="tanh")(x)
    model = keras.Model(x, {"label": keras.layers.Dense(3, activation="softmax")(hidden),
                            "value": keras.layers.Dense(1)(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.5),
                  loss={"label": "sparse_categorical_crossentropy", "value": "mse"},
                  loss_weights={"label": 1.0, "value": 0.5},
                  metrics={"label": ["accuracy"], "value": ["mae"]},
                  weighted_metrics={"value": ["mae"]}, jit_compile=False)
    return model


def two_output_train() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(
        two_output_data(BATCH * EPOCH_STEPS, 1, True)).batch(BATCH)


TWO_OUTPUT_EVAL = two_output_data(20, 2, False)  # a padded last batch on 2 replicas


class EpochLogs(keras.callbacks.Callback):
    """Keeps each epoch's logs (train and val_ metrics), as `fit`'s history has them."""

    def on_train_begin(self, logs=None):
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_a_two_output_model_trains_as_under_keras_fit(tmp_path, replicas):
    """Losses, loss weights, per-output metrics (named as Keras names them) and per-output
    sample weights: the weights, and every train and eval metric of every epoch, equal
    `model.fit`'s within 1e-5."""
    model, epochs = two_output_model(), EpochLogs()
    tputrain.fit(model, two_output_train(), TWO_OUTPUT_EVAL, model_dir=str(tmp_path / "run"),
                 steps=2 * EPOCH_STEPS, eval_every=EPOCH_STEPS, steps_per_loop=EPOCH_STEPS,
                 callbacks=[epochs], strategy=strategy_for(replicas), report_mfu=False,
                 jit_compile=False)
    expected = two_output_model()
    history = expected.fit(two_output_train(), epochs=2, steps_per_epoch=EPOCH_STEPS,
                           validation_data=TWO_OUTPUT_EVAL, shuffle=False, verbose=0).history
    assert {"label_loss", "value_loss", "label_accuracy", "value_mae", "value_weighted_mae",
            "val_value_weighted_mae"} <= set(history)
    for epoch, logs in enumerate(epochs.epochs):
        print(epoch, {name: (logs.get(name), history[name][epoch]) for name in sorted(history)})
        for name in history:
            assert logs[name] == pytest.approx(history[name][epoch], abs=1e-5), (epoch, name)
    assert len(epochs.epochs) == 2
    for actual, wanted in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(actual, wanted, atol=1e-5)


@pytest.mark.slow
def test_a_list_of_outputs_trains_as_under_keras_fit(tmp_path):
    """Outputs, losses, loss weights, metrics, labels and sample weights as lists (the
    pairing by position is checked fast in tests/test_keras_outputs.py)."""
    train = tf.data.Dataset.from_tensor_slices(
        as_list(two_output_data(BATCH * EPOCH_STEPS, 1, True), tuple)).batch(BATCH)
    model, epochs = list_output_model(), EpochLogs()
    tputrain.fit(model, train, as_list(TWO_OUTPUT_EVAL), model_dir=str(tmp_path / "run"),
                 steps=EPOCH_STEPS, eval_every=EPOCH_STEPS, steps_per_loop=EPOCH_STEPS,
                 callbacks=[epochs], strategy=strategy_for(1), report_mfu=False,
                 jit_compile=False)
    expected = list_output_model()
    history = expected.fit(train, epochs=1, validation_data=as_list(TWO_OUTPUT_EVAL),
                           shuffle=False, verbose=0).history
    assert {"label_acc", "label_weighted_acc", "value_mse_of_value"} <= set(history)
    (logs,) = epochs.epochs
    print({name: (logs.get(name), history[name][0]) for name in sorted(history)})
    for name in history:
        assert logs[name] == pytest.approx(history[name][0], abs=1e-5), name
    for actual, wanted in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(actual, wanted, atol=1e-5)


def test_eval_data_with_sample_weights_per_output_is_refused_in_one_line(tmp_path):
    """The eval loss weighs each example once (sum(weight * loss) / sum(weight)), so eval
    data takes one sample weight per example: one per output is named, not mis-read."""
    with pytest.raises(ValueError,
                       match="one sample weight per example, not one per output") as caught:
        tputrain.fit(two_output_model(), two_output_train(), two_output_data(8, 2, True),
                     model_dir=str(tmp_path / "run"), steps=1, strategy=strategy_for(1),
                     report_mfu=False, jit_compile=False)
    assert "\n" not in str(caught.value)


def test_without_eval_data_per_output_sample_weights_still_train(tmp_path):
    """No eval data: the eval split is the train data's first batch, without its
    per-output sample weights."""
    logs = tputrain.fit(two_output_model(), two_output_train(), model_dir=str(tmp_path / "run"),
                        steps=2, strategy=strategy_for(1), report_mfu=False, jit_compile=False)
    assert np.isfinite(logs["label_loss"]) and np.isfinite(logs["value_loss"])



# ------------------------------------------------------------ eval data beside arrays

def small_classifier() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"], jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("eval_batch", [16, 12])
def test_a_batched_eval_dataset_keeps_its_batches_beside_arrays_with_batch_size(
        tmp_path, eval_batch):
    """`batch_size` is the arrays' batch, not the eval dataset's: a batched eval dataset
    (of the train batch or another, its last batch short) evaluates as `fit`'s
    `validation_data` does."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    evaluation = tf.data.Dataset.from_tensor_slices((x[:30], y[:30])).batch(eval_batch)
    model, expected = small_classifier(), small_classifier()
    logs = tputrain.fit(model, (x, y), evaluation, model_dir=str(tmp_path / "run"), steps=2,
                        batch_size=16, shuffle=False, strategy=strategy_for(1),
                        report_mfu=False, jit_compile=False)
    history = expected.fit(x[:32], y[:32], batch_size=16, epochs=1, shuffle=False, verbose=0,
                           validation_data=evaluation).history
    assert logs["loss"] == pytest.approx(history["val_loss"][-1], abs=1e-5)
    assert logs["accuracy"] == pytest.approx(history["val_accuracy"][-1], abs=1e-6)


# ------------------------------------------------------------ optimizer settings

def ema_classifier() -> keras.Model:
    model = small_classifier()
    model.compile(optimizer=keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9,
                                                 ema_overwrite_frequency=4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("given", ["model", "function"])
def test_an_optimizer_with_use_ema_ends_on_fits_averages(tmp_path, given):
    """Keras's `use_ema` (with `ema_overwrite_frequency`) is carried over, a model
    given or built by a function alike: the run's returned metrics are those of the
    model `fit` leaves (its averaged weights); a model given gets those weights
    (tests/test_keras_fit_ema.py has the rest)."""
    x = np.random.default_rng(0).normal(size=(48, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = ema_classifier()
    logs = tputrain.fit(model if given == "model" else ema_classifier, (x, y), (x, y),
                        model_dir=str(tmp_path / "run"), steps=6, batch_size=8,
                        shuffle=False, strategy=strategy_for(1), report_mfu=False,
                        jit_compile=False)
    expected = ema_classifier()
    expected.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert logs["loss"] == pytest.approx(expected.evaluate(x, y, verbose=0)[0], abs=1e-5)
    if given == "model":
        assert max(float(np.max(np.abs(a - b))) for a, b in
                   zip(model.get_weights(), expected.get_weights())) < 1e-5


# ------------------------------------------------------------ a short last batch

@pytest.mark.parametrize("examples,drop_remainder,warned", [
    (50, False, True), (50, True, False), (48, False, False)])
def test_a_train_dataset_with_a_short_last_batch_is_warned_of_once(
        caplog, examples, drop_remainder, warned):
    """`fit` trains on the short batch; tputrain's global batch is fixed, so it rebatches
    across passes: other batches than `fit`'s, said once with the fix."""
    x = np.zeros((examples, 4), np.float32)
    train = tf.data.Dataset.from_tensor_slices((x, x[:, 0])).shuffle(examples, seed=1).batch(
        16, drop_remainder=drop_remainder)
    with caplog.at_level("WARNING"):
        tputrain.KerasTask(small_classifier(), train, epoch_steps=int(train.cardinality()))
    assert caplog.text.count("last batch") == (1 if warned else 0)
    if warned:
        assert "drop_remainder=True" in caplog.text and "50 examples" in caplog.text


# ------------------------------------------------------------ a batched train dataset

def _ops(dataset: tf.data.Dataset) -> set[str]:
    """The tf.data ops of `dataset`'s pipeline (its graph's node ops)."""
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())  # pylint: disable=protected-access
    return {node.op for node in graph.node}


@pytest.mark.parametrize("examples,drop_remainder,replicas", [
    (48, True, 1), (48, True, 2), (50, True, 2), (50, False, 1), (50, False, 2)])
def test_a_batched_train_dataset_is_read_in_its_batches_not_example_by_example(
        examples, drop_remainder, replicas):
    """`fit` reads a batched dataset batch by batch; tputrain unbatched it and batched
    the examples again (per replica), a per-example cost on every step (the input
    threads' CPU time beside a small model's step). The batches each replica gets are
    the same examples, in order, across passes (a short last batch included)."""
    from tputrain.data import InputContext

    x = np.arange(examples * 3, dtype=np.float32).reshape(examples, 3)
    train = tf.data.Dataset.from_tensor_slices((x, x[:, 0].astype(np.int64))).batch(
        16, drop_remainder=drop_remainder)
    task = tputrain.KerasTask(small_classifier(), train, shuffle=False)
    context = InputContext(num_input_pipelines=1, input_pipeline_id=0,
                           num_replicas_in_sync=replicas, global_batch_size=16)
    batches = task.build_inputs("train", context)
    assert "UnbatchDataset" not in _ops(batches)
    read = np.concatenate([features[:, 0] for features, _ in batches.take(3 * replicas * 4)])
    passes = (examples // 16 * 16) if drop_remainder else examples
    assert np.array_equal(read, np.resize(np.arange(passes, dtype=np.float32) * 3, read.size))
    assert batches.element_spec[0].shape.as_list() == [16 // replicas, 3]


class Penalized(keras.Model):
    """A Keras 3 model whose loss is its own `compute_loss` (a penalty on the logits)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.logits = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.logits(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + keras.ops.mean(keras.ops.abs(y_pred))


class Evaluated(Penalized):
    compute_loss = keras.Model.compute_loss

    def test_step(self, data):
        return super().test_step(data)


@pytest.mark.parametrize("model_class, method, port", [
    (Penalized, "compute_loss", "def total_loss(self, labels, outputs, model, global_batch_size"),
    (Evaluated, "test_step", "def eval_step(self, batch, model, metrics")])
def test_a_model_loss_or_eval_step_the_task_would_drop_is_refused_with_the_port(
        tmp_path, model_class, method, port):
    """A `compute_loss` override was silently dropped: the run trained without the
    penalty, as if the model had none. Like `train_step`, it is refused with the port."""
    def build():
        model = model_class()
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
        return model

    with pytest.raises(TypeError) as caught:
        tputrain.fit(build, noisy_data(BATCH * 2, 1), model_dir=str(tmp_path / "run"), steps=2,
                     batch_size=BATCH, strategy=strategy_for(1), report_mfu=False)
    message = str(caught.value)
    assert f"{model_class.__name__}.{method}" in message and port in message, message
    assert "task=Ported" in message and "\n" not in message


# ------------------------------------------------------------ the user's objects, rebuilt

class ScaledSGD(keras.optimizers.SGD):
    """A user's optimizer as often written: an argument kept as an attribute, and no
    `get_config` that carries it."""

    def __init__(self, learning_rate=0.01, scale=1.0, **kwargs):
        super().__init__(learning_rate, **kwargs)
        self.scale = scale

    def update_step(self, gradient, variable, learning_rate):
        return super().update_step(gradient * self.scale, variable, learning_rate)


class ConfiguredScaledSGD(ScaledSGD):
    def get_config(self):
        return {**super().get_config(), "scale": self.scale}


class AboveThreshold(keras.metrics.Metric):
    """A user's metric whose threshold its config does not carry."""

    def __init__(self, threshold=0.5, name="above", **kwargs):
        super().__init__(name=name, **kwargs)
        self.threshold = threshold
        self.hits = self.add_weight(name="hits", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.hits.assign_add(keras.ops.sum(keras.ops.cast(y_pred[:, 1] > self.threshold,
                                                          "float32")))

    def result(self):
        return self.hits


def rebuilt_task(optimizer="sgd", metrics=()) -> tputrain.KerasTask:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=list(metrics), jit_compile=False)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    return tputrain.KerasTask(model, (x, (x[:, 0] > 0).astype(np.int64)), batch_size=8)


def test_an_optimizer_argument_its_config_lacks_is_refused_in_one_line():
    """ScaledSGD(scale=10) was rebuilt from its config as scale=1, and trained so
    silently: the copy's attributes that differ from the user's are named, with the fix."""
    with pytest.raises(ValueError) as caught:
        rebuilt_task(ScaledSGD(0.05, scale=10.0)).build_optimizer()
    message = str(caught.value)
    assert "ScaledSGD" in message and "scale" in message and "get_config" in message, message
    assert "\n" not in message
    fresh = rebuilt_task(ConfiguredScaledSGD(0.05, scale=10.0)).build_optimizer()
    assert fresh.scale == 10.0


class WarmupAdam(keras.optimizers.Adam):
    """A user's optimizer that keeps its peak rate: the copy's comes from the config's
    learning_rate, read back from its float32 variable (0.05000000074505806)."""

    def __init__(self, learning_rate=0.001, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.peak_learning_rate = learning_rate


def test_an_attribute_equal_at_the_rates_float32_precision_is_not_refused():
    """`peak_learning_rate=0.05 (copy: 0.05000000074505806)` was refused: a float equal
    at float32 precision is the same value (the copy trains the same)."""
    fresh = rebuilt_task(WarmupAdam(learning_rate=0.05)).build_optimizer()
    assert fresh.peak_learning_rate == pytest.approx(0.05)
    with pytest.raises(ValueError, match="peak_learning_rate"):  # a real difference still is
        optimizer = WarmupAdam(learning_rate=0.05)
        optimizer.peak_learning_rate = 0.5
        rebuilt_task(optimizer).build_optimizer()


def test_a_metric_argument_its_config_lacks_is_refused_in_one_line():
    """AboveThreshold(threshold=0.9) was evaluated as threshold=0.5 under its own name."""
    with pytest.raises(ValueError) as caught:
        rebuilt_task(metrics=[AboveThreshold(threshold=0.9)]).build_metrics()
    message = str(caught.value)
    assert "AboveThreshold" in message and "threshold" in message and "get_config" in message
    assert "\n" not in message


def keras_optimizers() -> list[type]:
    """keras.optimizers' optimizers (not the wrappers of others, which take none), and
    tputrain's LARS."""
    return [cls for cls in vars(keras.optimizers).values()
            if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)
            and "learning_rate" in inspect.signature(cls).parameters
            and cls is not keras.optimizers.Optimizer] + [tputrain.LARS]


@pytest.mark.parametrize("options", [
    {}, {"clipnorm": 1.0, "weight_decay": 0.01}, {"global_clipnorm": 2.0, "use_ema": True,
                                                  "ema_momentum": 0.9},
    {"clipvalue": 0.5, "gradient_accumulation_steps": 2, "loss_scale_factor": 4.0},
    {"learning_rate": keras.optimizers.schedules.CosineDecay(0.1, 100, warmup_steps=5,
                                                             warmup_target=0.2)}])
def test_no_keras_optimizer_trips_the_rebuilt_check(options):
    """Every optimizer of keras.optimizers, built or not, with the common options (a
    tuple its config gives back as a list, LARS's exclusions, is the same value)."""
    for cls in keras_optimizers():
        for built in (False, True):
            extra = {"exclude_from_adaptation": ("bias",)} if cls is tputrain.LARS else {}
            optimizer = cls(**{"learning_rate": 0.01, **options, **extra})
            task = rebuilt_task(optimizer)
            if built:
                optimizer.build(task._source.trainable_variables)  # pylint: disable=protected-access
            assert type(task.build_optimizer()) is cls


def test_no_common_keras_metric_trips_the_rebuilt_check():
    metrics = [cls() for cls in vars(keras.metrics).values()
               if isinstance(cls, type) and issubclass(cls, keras.metrics.Metric)
               and _constructs_alone(cls)]
    metrics += [keras.metrics.AUC(num_thresholds=50, curve="PR", multi_label=False),
                keras.metrics.Precision(thresholds=0.3, top_k=None, class_id=1),
                keras.metrics.Recall(thresholds=[0.2, 0.6]),
                keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"),
                keras.metrics.MeanIoU(num_classes=3), keras.metrics.IoU(3, target_class_ids=[0]),
                keras.metrics.FBetaScore(beta=2.0, threshold=0.4, average="macro"),
                keras.metrics.PrecisionAtRecall(0.5, num_thresholds=20),
                keras.metrics.MeanMetricWrapper(keras.metrics.mean_squared_error, name="m"),
                keras.metrics.SparseCategoricalAccuracy(name="acc", dtype="float32")]
    assert len(metrics) > 30
    assert len(rebuilt_task(metrics=metrics).build_metrics()) == len(metrics)


def _constructs_alone(cls: type) -> bool:
    try:
        cls()
    except Exception:  # pylint: disable=broad-except  (one that takes arguments)
        return False
    return cls is not keras.metrics.Metric


# ------------------------------------------------------------ data without labels

@pytest.mark.parametrize("eval_data", ["none", "arrays", "features only"])
def test_a_dataset_of_features_only_is_refused_in_one_line(eval_data):
    """A train (or eval) dataset of features only crashed inside KerasTask or the Trainer
    (`'TensorSpec' object is not subscriptable`): it is named, as other data is."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    labelled = (x, (x[:, 0] > 0).astype(np.int64))
    features = tf.data.Dataset.from_tensor_slices(x).batch(8)
    train, evaluation = {"none": (features, None), "arrays": (features, labelled),
                         "features only": (labelled, features)}[eval_data]
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    with pytest.raises(TypeError, match=r"must yield .*\(x, y\) or \(x, y, sample_weight\)") \
            as caught:
        tputrain.KerasTask(model, train, evaluation, batch_size=8 if train is labelled else None)
    split = "eval" if eval_data == "features only" else "train"
    assert f"the {split} dataset" in str(caught.value) and "\n" not in str(caught.value)


def test_a_trainer_trains_a_clone_and_leaves_the_model_passed_as_it_was(tmp_path):
    """docs/tasks.md: with `Trainer(KerasTask(model))` the trained model is
    `trainer.model`; only tputrain.fit copies the weights back into the one passed."""
    model = small_classifier()
    before = model.get_weights()
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    trainer = tputrain.Trainer(tputrain.KerasTask(model, (x, (x[:, 0] > 0).astype(np.int64)),
                                                  batch_size=8),
                               str(tmp_path / "run"), train_steps=2, steps_per_loop=2,
                               strategy=strategy_for(1), report_mfu=False, jit_compile=False)
    trainer.train()
    assert trainer.model is not model
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    assert int(model.optimizer.iterations.numpy()) == 0
    assert any(not np.array_equal(a, b) for a, b in zip(trainer.model.get_weights(), before))
