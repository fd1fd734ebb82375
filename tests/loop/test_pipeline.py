"""One update pipeline: a Task's own train_step with a user's optimizer is reduced,
clipped and guarded as the default step is, and the optimizer is never patched."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.fault_tolerance.guard import NonFiniteGuard
from tputrain.loop.pipeline import UpdatePipeline
from tputrain.task import overrides_train_step
from tiny import TinyTask, strategy_for

BAD_EXAMPLE = 40  # in the third global batch of 16 (step 3), on the first replica


class UserSGD(keras.optimizers.SGD):
    """A user's own optimizer class (not Keras's, not tputrain's)."""


class OwnStepTask(TinyTask):
    """Overrides train_step with its own loop body; the optimizer is the user's class,
    clipping the global norm low enough that every step clips."""

    def __init__(self, bad: bool = False):
        super().__init__()
        if bad:
            self.x[BAD_EXAMPLE, 0] = np.nan

    def build_optimizer(self):
        return UserSGD(learning_rate=0.1, momentum=0.9, global_clipnorm=0.05)

    def train_step(self, batch, model, optimizer, metrics, global_batch_size):
        features, labels = batch
        with tf.GradientTape() as tape:
            outputs = model(features, training=True)
            loss = self.total_loss(labels, outputs, model, global_batch_size)
            scaled = optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        self.update_metrics(metrics, labels, outputs)
        return {"loss": loss}


def train(tmp_path, name, replicas, task, steps=4, guard=None):
    trainer = tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(replicas),
                               train_steps=steps, steps_per_loop=2, global_batch_size=16,
                               eval_steps=1, report_mfu=False, guard=guard)
    trainer.train()
    return trainer


def test_own_train_step_with_a_user_optimizer_matches_on_one_and_two_replicas(tmp_path):
    one = train(tmp_path, "one", 1, OwnStepTask())
    two = train(tmp_path, "two", 2, OwnStepTask())
    for a, b in zip(one.model.get_weights(), two.model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(one.optimizer.variables, two.optimizer.variables):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)
    assert int(two.optimizer.iterations.numpy()) == 4


def test_own_train_step_is_guarded_on_one_and_two_replicas(tmp_path):
    for replicas in (1, 2):
        trainer = train(tmp_path, f"bad{replicas}", replicas, OwnStepTask(bad=True),
                        guard=NonFiniteGuard(policy="skip"))
        assert int(trainer.guard.nonfinite_steps.numpy()) == 1
        assert int(trainer.optimizer.iterations.numpy()) == 3  # the bad step applied nothing
        assert all(np.all(np.isfinite(w)) for w in trainer.model.get_weights())


def test_the_users_optimizer_is_not_patched(tmp_path):
    trainer = train(tmp_path, "plain", 2, OwnStepTask(), steps=2)
    optimizer = trainer.optimizer
    assert type(optimizer) is UserSGD
    written = {name for name in vars(optimizer)
               if name in ("apply", "apply_gradients", "scale_loss")
               or name.startswith("_tputrain_")}
    assert written == set()


def test_one_definition_of_a_train_step_override():
    class Instance(TinyTask):
        pass

    task = Instance()
    assert not overrides_train_step(task)
    assert overrides_train_step(OwnStepTask())
    task.train_step = lambda *args: {}
    assert overrides_train_step(task)


class KeptOptimizerTask(TinyTask):
    """Builds the optimizer the test keeps, to use it again after the Trainer."""

    def __init__(self, optimizer):
        super().__init__()
        self.kept = optimizer

    def build_optimizer(self):
        return self.kept


def _instance_state(optimizer):
    """What a patch would change: the instance's own attribute names, and the class's
    methods the Trainer's update depends on."""
    return (set(vars(optimizer)),
            {name: getattr(type(optimizer), name) for name in
             ("apply", "apply_gradients", "scale_loss", "_all_reduce_sum_gradients",
              "assign", "assign_add", "assign_sub")})


def _sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=1.0)


def test_a_users_optimizer_trained_by_a_trainer_then_keras_fit_keeps_replicas_equal(tmp_path):
    """Issue 53: after a Trainer on 2 replicas, the same optimizer in Keras `fit` on 2
    replicas sums the gradients itself again (the Trainer changed nothing of it), so
    every replica's copy of a weight stays the same."""
    strategy = strategy_for(2)
    with strategy.scope():
        optimizer = _sgd()
    trainer = tputrain.Trainer(KeptOptimizerTask(optimizer), str(tmp_path / "run"),
                               strategy=strategy, train_steps=4, steps_per_loop=2,
                               global_batch_size=16, eval_steps=1, report_mfu=False)
    trainer.train()
    trainer.close()
    assert trainer.optimizer is optimizer
    task, model = trainer.task, trainer.model
    with strategy.scope():  # the same optimizer, as Keras alone builds it
        twin = _sgd()
        twin.build(model.trainable_variables)
    names, methods = _instance_state(optimizer)
    assert names ^ _instance_state(twin)[0] == set()  # nothing added or left behind
    assert methods == _instance_state(twin)[1]

    rng = np.random.RandomState(1)
    x, y = rng.randn(64, 8).astype(np.float32), rng.randint(0, 2, 64)
    with strategy.scope():
        model.compile(optimizer=optimizer, loss=task.compute_loss)
    model.fit({"x": x}, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for weight in model.trainable_variables:
        copies = [np.array(c) for c in strategy.experimental_local_results(weight.value)]
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=weight.path)


def test_the_pipeline_is_a_keras_optimizer_holding_the_users():
    """As Keras's LossScaleOptimizer: an Optimizer with `inner_optimizer`, no forwarding."""
    optimizer = keras.optimizers.SGD(0.1)
    pipeline = UpdatePipeline(optimizer, NonFiniteGuard())
    assert isinstance(pipeline, keras.optimizers.Optimizer)
    assert pipeline.inner_optimizer is optimizer
    assert not {"__getattr__", "__setattr__"} & set(vars(UpdatePipeline))
    pipeline.learning_rate = 0.5
    assert float(optimizer.learning_rate) == 0.5
    assert pipeline.iterations is optimizer.iterations


class FailingSGD(keras.optimizers.SGD):
    """A user's optimizer whose update fails while the step traces."""

    def update_step(self, gradient, variable, learning_rate):
        raise RuntimeError("the user's update failed")


class FailingOptimizerTask(TinyTask):
    def __init__(self):
        super().__init__()
        self.kept = FailingSGD(0.1)

    def build_optimizer(self):
        return self.kept


def test_an_update_that_fails_while_tracing_leaves_the_optimizer_as_built(tmp_path):
    task = FailingOptimizerTask()
    trainer = tputrain.Trainer(task, str(tmp_path / "run"), strategy=strategy_for(2),
                               train_steps=2, steps_per_loop=2, global_batch_size=16,
                               eval_steps=1, report_mfu=False)
    with pytest.raises(Exception, match="the user's update failed"):
        trainer.train()
    trainer.close()
    left = {"_all_reduce_sum_gradients", "assign", "assign_add", "assign_sub"} & set(
        vars(task.kept))
    assert left == set()
