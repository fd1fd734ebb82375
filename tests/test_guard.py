"""The non-finite guard: a NaN batch never reaches the weights; raise, skip or roll back."""

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import FaultTask
from tputrain.checkpoint import NonFiniteStateError
from tputrain.guard import NonFiniteError, NonFiniteGuard
from tiny import strategy_for, weights

# Two replicas take per-replica batches 2k and 2k+1 at step k+1: batch 5 is step 3.
NAN_BATCH, NAN_STEP = 5, 3


def make_trainer(tmp_path, name, policy, nan_at_batch=NAN_BATCH, **kwargs):
    options = dict(train_steps=8, steps_per_loop=4, global_batch_size=16, checkpoint_every=2,
                   eval_steps=1)
    options.update(kwargs)
    import gin

    gin.bind_parameter("NonFiniteGuard.policy", policy)
    task = FaultTask(dropout=0.0, nan_at_batch=nan_at_batch)
    return tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(2), **options)


def all_finite(trainer):
    return all(np.all(np.isfinite(w)) for w in weights(trainer))


def checkpoint_steps(trainer):
    return sorted(int(p.rsplit("-", 1)[1]) for p in trainer.checkpointer.manager.checkpoints)


def test_raise_names_the_step_and_checkpoints_nothing_non_finite(tmp_path):
    trainer = make_trainer(tmp_path, "raise", "raise")
    with pytest.raises(NonFiniteError, match=rf"at step {NAN_STEP}\b.*NonFiniteGuard.policy"):
        trainer.train()
    assert int(trainer.step.numpy()) == NAN_STEP  # stopped right after the bad step
    assert all_finite(trainer)  # the bad update was not applied
    assert checkpoint_steps(trainer) == [2]


def test_skip_counts_and_keeps_training(tmp_path):
    trainer = make_trainer(tmp_path, "skip", "skip")
    trainer.train()
    assert int(trainer.step.numpy()) == 8
    assert int(trainer.guard.nonfinite_steps.numpy()) == 1
    assert int(trainer.optimizer.iterations.numpy()) == 7  # one update skipped
    assert all_finite(trainer)
    # The skip count is saved: a resumed run keeps reporting it.
    reader = tf.train.load_checkpoint(trainer.checkpointer.latest)
    assert reader.get_tensor("nonfinite_steps/.ATTRIBUTES/VARIABLE_VALUE") == 1


def test_rollback_restores_the_last_checkpoint_and_continues(tmp_path):
    # Batch 7 is step 4: steps 1-2 are in ckpt-2, step 3 is applied, step 4 is not.
    trainer = make_trainer(tmp_path, "rollback", "rollback", nan_at_batch=7)
    trainer.train()
    assert trainer.guard.rollbacks == 1
    assert int(trainer.step.numpy()) == 8
    assert all_finite(trainer)
    # Back to ckpt-2 (2 updates; step 3's update is undone), then steps 5-8: 4 more.
    assert int(trainer.optimizer.iterations.numpy()) == 2 + 4


def test_rollback_without_a_checkpoint_says_so(tmp_path):
    trainer = make_trainer(tmp_path, "nockpt", "rollback", checkpoint_every=8)
    with pytest.raises(NonFiniteError, match="no checkpoint to roll back to"):
        trainer.train()


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="one of .*'raise', 'skip', 'rollback'"):
        NonFiniteGuard("ignore")


def test_a_non_finite_state_is_never_checkpointed(tmp_path):
    trainer = make_trainer(tmp_path, "nan_state", None, train_steps=2)
    trainer.train()
    kernel = trainer.model.trainable_variables[0]
    kernel.assign(tf.fill(kernel.shape, np.nan))
    trainer.step.assign(4)
    with pytest.raises(NonFiniteStateError, match="not saving step 4: NaN/Inf in .*kernel"):
        trainer.checkpointer.save()
    assert checkpoint_steps(trainer) == [2]


def one_replica_trainer(tmp_path, name, policy, nan_at_batch):
    """One replica, the whole step one XLA program: the step counter and the guard's
    observation run inside it (`StepBuilder.build(count=...)`). One batch a step:
    batch b is step b + 1."""
    import gin

    gin.bind_parameter("NonFiniteGuard.policy", policy)
    task = FaultTask(dropout=0.0, nan_at_batch=nan_at_batch)
    return tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(1),
                            train_steps=8, steps_per_loop=4, global_batch_size=16,
                            checkpoint_every=2, eval_steps=1, jit_compile=True)


def test_raise_with_the_count_inside_the_xla_step(tmp_path):
    trainer = one_replica_trainer(tmp_path, "raise1", "raise", nan_at_batch=2)
    with pytest.raises(NonFiniteError, match=r"at step 3\b"):
        trainer.train()
    assert trainer._steps.counted_in_step
    assert int(trainer.step.numpy()) == 3
    assert all_finite(trainer)
    assert checkpoint_steps(trainer) == [2]


def test_rollback_with_the_count_inside_the_xla_step(tmp_path):
    trainer = one_replica_trainer(tmp_path, "rollback1", "rollback", nan_at_batch=3)
    trainer.train()
    assert trainer._steps.counted_in_step
    assert trainer.guard.rollbacks == 1
    assert int(trainer.step.numpy()) == 8
    assert all_finite(trainer)
    assert int(trainer.optimizer.iterations.numpy()) == 2 + 4  # back to ckpt-2, then 5-8
