"""One update pipeline: a Task's own train_step with a user's optimizer is reduced,
clipped and guarded as the default step is, and the optimizer is never patched."""

import keras
import numpy as np
import tensorflow as tf

import tputrain
from tputrain.guard import NonFiniteGuard
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
