"""tputrain/checkpointing/model_variables.py: every weight of a user's model is in
its checkpoints, those of layers a subclassed model keeps in a list included.

Keras 3 on TensorFlow keeps a layer's list attributes in its own TrackedList, which
TensorFlow's checkpoints do not traverse: before the fix a resumed run reset such a
layer's BatchNorm statistics, and an export, the eval side-car and a fine-tuning run
read none of its weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import strategy_for
from tputrain.checkpointing.model_variables import has_root, model_trackables
from tputrain.serving.export import export_checkpoint, restored_model
from tputrain.actions.init_checkpoint import read_tf_checkpoint
from tputrain.jobs.sidecar import ReadOnlyTrainer, read_checkpoint


class ListedBlocks(keras.Model):
    """Conv, then blocks kept in a list (a BatchNorm and a Dense), then a head."""

    def __init__(self):  # named: the same paths in every instance (fine-tuning matches them)
        super().__init__(name="listed")
        self.conv = keras.layers.Conv2D(4, 3, padding="same", name="conv")
        self.blocks = [keras.layers.BatchNormalization(momentum=0.5, name="norm"),
                       keras.layers.Dense(6, activation="relu", name="hidden")]
        self.head = keras.layers.Dense(3, dtype="float32", name="head")

    def call(self, inputs, training=None):
        x = self.blocks[0](self.conv(inputs["image"]), training=training)
        return self.head(self.blocks[1](tf.reduce_mean(x, [1, 2])))


class ListedTask(tputrain.Task):
    def build_model(self):
        return ListedBlocks()

    def build_inputs(self, split, input_context):
        images = tf.random.stateless_normal([32, 6, 6, 2], [1, 2]) * 2.0 + 1.0
        labels = tf.random.stateless_uniform([32], [3, 4], 0, 3, tf.int32)
        dataset = tf.data.Dataset.from_tensor_slices(({"image": images}, labels))
        return dataset.repeat().batch(input_context.get_per_replica_batch_size(8),
                                      drop_remainder=True)

    def build_optimizer(self):
        return tputrain.build_optimizer("sgd", learning_rate=0.1)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)


def _trainer(model_dir, replicas=1, steps=3, cls=tputrain.Trainer, task=None, **kwargs):
    return cls(task or ListedTask(), str(model_dir), strategy=strategy_for(replicas),
               train_steps=steps, steps_per_loop=steps, global_batch_size=8,
               checkpoint_every=10**9, eval_steps=1, seed=0, **kwargs)


def _assert_same_weights(model, trained, count=10):
    assert len(model.variables) == len(trained) == count
    for variable, value in zip(model.variables, trained):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)


@pytest.fixture(name="trained")
def _trained(tmp_path):
    trainer = _trainer(tmp_path / "run")
    trainer.train()
    values = [v.numpy() for v in trainer.model.variables]
    moving = [w for v, w in zip(trainer.model.variables, values) if "moving" in v.path]
    assert not np.allclose(moving[0], 0.0) and not np.allclose(moving[1], 1.0)  # they moved
    return trainer, values


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_resumed_run_gets_back_the_listed_layers_statistics(tmp_path, replicas):
    first = _trainer(tmp_path / "run", replicas)
    first.train()
    trained = [v.numpy() for v in first.model.variables]
    resumed = _trainer(tmp_path / "run", replicas, steps=3)
    resumed.train()  # restores step 3: nothing left to train
    _assert_same_weights(resumed.model, trained)


def test_an_export_serves_the_listed_layers_weights(tmp_path, trained):
    trainer, values = trained
    _assert_same_weights(restored_model(trainer, trainer.checkpointer.latest), values)
    served = tf.saved_model.load(export_checkpoint(trainer, export_dir=str(tmp_path / "export")))
    images = tf.random.stateless_normal([4, 6, 6, 2], [7, 8])
    outputs = list(served.signatures["serving_default"](image=images).values())[0]
    np.testing.assert_allclose(outputs, trainer.model({"image": images}, training=False),
                               rtol=1e-6, atol=1e-6)


def test_the_eval_side_car_reads_the_listed_layers_weights(trained):
    trainer, values = trained
    reader = _trainer(trainer.model_dir, cls=ReadOnlyTrainer)
    read_checkpoint(reader, trainer.checkpointer.latest)
    _assert_same_weights(reader.model, values)


def test_fine_tuning_loads_a_subclassed_models_weights_listed_or_not(trained):
    """InitCheckpoint into the same architecture takes every weight: a subclassed
    model saves its weights as "listed/<weight>" (the three kernels share a name), so
    they are taken from the same place in the checkpoint's model, the listed layers'
    from the second root; before, it refused ("no variable of this model is in")."""
    trainer, values = trained
    source = read_tf_checkpoint(trainer.checkpointer.latest)
    assert {"listed/gamma", "listed/moving_mean"} <= set(source.weights)  # unambiguous
    model = ListedBlocks()
    model({"image": tf.zeros([1, 6, 6, 2])})
    report = tputrain.InitCheckpoint(trainer.model_dir).load(model)
    assert len(report.loaded) == 10 and not report.missing and not report.unused
    _assert_same_weights(model, values)


def test_only_a_model_with_weights_out_of_the_object_graph_gets_weights_in_a_second_root(
        tmp_path):
    """A model whose weights TensorFlow's object graph reaches keeps its checkpoint
    keys as before (the second root is empty); a listed layer's weights are named by
    their place in `model.variables`."""
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.BatchNormalization()(inputs)))
    path = tf.train.Checkpoint(**model_trackables(model)).write(str(tmp_path / "tracked"))
    assert all(key.startswith(("model/", "_CHECKPOINTABLE")) for key, _ in
               tf.train.list_variables(path))
    assert has_root(tf.train.load_checkpoint(path))
    listed = ListedBlocks()
    listed({"image": tf.zeros([1, 6, 6, 2])})
    trackables = model_trackables(listed)
    assert list(trackables) == ["model", "model_variables"]
    held = {name: v.path for name, v in vars(trackables["model_variables"]).items()
            if isinstance(v, keras.Variable)}
    listed_paths = [v.path for v in listed.variables[2:8]]  # the BatchNorm's 4, the Dense's 2
    assert sorted(held.values()) == sorted(listed_paths)
    assert sorted(held) == [f"variable_{i}" for i in range(2, 8)]


def test_a_checkpoint_from_before_the_second_root_resumes_with_a_warning(
        tmp_path, monkeypatch, caplog):
    """An older tputrain saved such a model without `model_variables`: the run resumes
    from it (the optimizer's references give back the listed trainable weights) and
    names the statistics it cannot give back, instead of refusing the checkpoint."""
    from tputrain import trainer as trainer_module
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "model_trackables", lambda model: {"model": model})
        old = _trainer(tmp_path / "run")
        old.train()
    trained = {v.path: v.numpy() for v in old.model.variables}
    resumed = _trainer(tmp_path / "run", steps=4)
    exported = restored_model(resumed, resumed.checkpointer.latest)  # as an export reads it
    for variable in exported.variables:  # trainable from the optimizer's references
        if "moving" not in variable.path:
            np.testing.assert_array_equal(variable.numpy(), trained[variable.path])
    resumed.checkpointer.check_compatible()  # the pre-flight accepts it too
    with caplog.at_level("WARNING"):
        assert resumed.checkpointer.restore_latest().endswith("ckpt-3")
    assert "listed/norm/moving_mean, listed/norm/moving_variance keep their current" in caplog.text
    assert "was written before tputrain saved the weights of layers" in caplog.text
    for variable in resumed.model.variables:
        if "moving" not in variable.path:
            np.testing.assert_array_equal(variable.numpy(), trained[variable.path])
    resumed.train()
    assert resumed.current_step == 4
    assert any(key.startswith("model_variables/") for key, _ in
               tf.train.list_variables(resumed.checkpointer.latest))


def test_dropout_seed_states_stay_under_their_own_root():
    """Keras hides seed generators from TensorFlow's object graph too; they are saved
    as "seeds" (checkpointing/seeds.py), not again here: a model with Dropout keeps
    its checkpoint keys."""
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dropout(0.5)(inputs)))
    assert any("seed" in v.path for v in model.variables)
    assert not vars_held(model_trackables(model)["model_variables"])


def vars_held(holder) -> list:
    return [v for v in vars(holder).values() if isinstance(v, keras.Variable)]


def test_a_frozen_layer_added_to_a_list_is_another_model(tmp_path):
    """A run whose model had nothing in the second root, resumed by a model that adds a
    frozen layer in a list (no optimizer key changes): refused as another model's
    checkpoint, not restored half (review finding)."""
    _trainer(tmp_path / "run", steps=2, task=TrackedTask()).train()

    class Grown(TrackedTask):
        def build_model(self):
            return FrozenListed()
    with pytest.raises(tputrain.CheckpointMismatchError, match="model_variables|norm"):
        _trainer(tmp_path / "run", steps=3, task=Grown()).train()


class TrackedTask(ListedTask):
    def build_model(self):
        return Tracked()


class Tracked(keras.Model):
    def __init__(self):
        super().__init__(name="listed")
        self.conv = keras.layers.Conv2D(4, 3, padding="same", name="conv")
        self.head = keras.layers.Dense(3, dtype="float32", name="head")

    def call(self, inputs, training=None):
        return self.head(tf.reduce_mean(self.conv(inputs["image"]), [1, 2]))


class FrozenListed(Tracked):
    def __init__(self):
        super().__init__()
        self.extra = [keras.layers.BatchNormalization(trainable=False, name="norm")]

    def call(self, inputs, training=None):
        x = self.extra[0](self.conv(inputs["image"]), training=training)
        return self.head(tf.reduce_mean(x, [1, 2]))


def test_an_older_checkpoint_of_a_fully_tracked_model_resumes_silently(
        tmp_path, monkeypatch, caplog):
    """Written before the second root existed, by a model it holds nothing for: this
    run's empty root is passed over, with no warning."""
    from tputrain import trainer as trainer_module
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "model_trackables", lambda model: {"model": model})
        old = _trainer(tmp_path / "run", steps=2, task=TrackedTask())
        old.train()
    trained = [v.numpy() for v in old.model.variables]
    resumed = _trainer(tmp_path / "run", steps=2, task=TrackedTask())
    with caplog.at_level("WARNING"):
        assert resumed.checkpointer.restore_latest().endswith("ckpt-2")
    assert "was written before" not in caplog.text
    _assert_same_weights(resumed.model, trained, count=4)
