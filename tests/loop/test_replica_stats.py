"""Batch norm's moving statistics on N replicas (loop/replica_stats.py).

Keras 3 keeps a copy of each moving statistic per device with no aggregation, so
each device's copy followed its own per-replica batches: a checkpoint saved
replica 0's and every replica evaluated with its own. After each loop every copy
must hold the statistics of the global batches, what one replica computes.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.serving.export import export_checkpoint
from faults import INPUT_NORM_MOMENTUM as MOMENTUM, input_norm_model, running_stats_model
from processes import Launch
from tiny import TinyTask, strategy_for

STEPS, BATCH = 4, 16


class InputNormTask(TinyTask):
    """TinyTask with batch norm straight on the inputs (`faults.input_norm_model`)."""

    def build_model(self) -> keras.Model:
        return input_norm_model()


def moving_mean(global_batches: list[np.ndarray]) -> np.ndarray:
    """Keras's update, `moving = moving * momentum + batch_mean * (1 - momentum)`, over
    these global batches in turn, from zeros."""
    moving = np.zeros(8, np.float64)
    for batch in global_batches:
        moving = moving * MOMENTUM + batch.astype(np.float64).mean(0) * (1 - MOMENTUM)
    return moving


def expected_moving_mean(task: TinyTask) -> np.ndarray:
    """Over the global batches one process's steps read: consecutive examples."""
    return moving_mean([task.x[step * BATCH:(step + 1) * BATCH] for step in range(STEPS)])


def saved_moving_mean(path: str) -> np.ndarray:
    """The batch norm's moving mean in the checkpoint at `path`."""
    reader = tf.train.load_checkpoint(path)
    saved = [reader.get_tensor(name) for name, _ in tf.train.list_variables(path)
             if "moving_mean" in name and "OPTIMIZER" not in name]
    assert len(saved) == 1
    return saved[0]


def copies(variable) -> list[np.ndarray]:
    value = variable.value
    return [c.numpy() for c in getattr(value, "values", [value])]


def train(tmp_path, replicas: int, **kwargs) -> tputrain.Trainer:
    return train_task(tmp_path, InputNormTask(), replicas, **kwargs)


def train_task(tmp_path, task: TinyTask, replicas: int, **kwargs) -> tputrain.Trainer:
    trainer = tputrain.Trainer(task, str(tmp_path / f"r{replicas}"),
                               strategy=strategy_for(replicas), train_steps=STEPS,
                               steps_per_loop=2, global_batch_size=BATCH, checkpoint_every=2,
                               eval_steps=2, seed=0, **kwargs)
    trainer.train()
    return trainer


@pytest.mark.parametrize("replicas", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_replica_holds_the_global_batches_moving_mean(tmp_path, replicas):
    trainer = train(tmp_path, replicas)
    bn = trainer.model.get_layer("bn")
    expected = expected_moving_mean(trainer.task)
    for copy in copies(bn.moving_mean):
        np.testing.assert_allclose(copy, expected, rtol=1e-5, atol=1e-7)
    variances = copies(bn.moving_variance)
    for copy in variances[1:]:
        np.testing.assert_array_equal(copy, variances[0])
    # What is saved is that value, not one device's share.
    np.testing.assert_allclose(saved_moving_mean(trainer.checkpointer.latest), expected,
                               rtol=1e-5, atol=1e-7)


def test_two_replicas_evaluate_as_one_from_the_same_checkpoint(tmp_path):
    """Eval on 2 replicas of the 2-replica run's checkpoint matches eval on 1 replica
    of it: both normalize with the same statistics."""
    two = train(tmp_path, 2)
    one = tputrain.Trainer(InputNormTask(), two.model_dir, strategy=strategy_for(1),
                           train_steps=STEPS, steps_per_loop=2, global_batch_size=BATCH,
                           checkpoint_every=2, eval_steps=2, seed=0)
    one.checkpointer.restore_latest()
    two_logs, one_logs = two.evaluate_weights(), one.evaluate_weights()
    assert two_logs["loss"] == pytest.approx(one_logs["loss"], rel=1e-5)


def test_copies_already_equal_are_kept_bit_for_bit(tmp_path):
    """Copies already equal (a synchronized or frozen batch norm) must not move by a
    rounding step: on 3 replicas a sum of 3 equal values divided by 3 can round."""
    trainer = tputrain.Trainer(InputNormTask(), str(tmp_path / "r3"), strategy=strategy_for(3),
                               train_steps=2, steps_per_loop=2, global_batch_size=12,
                               checkpoint_every=2, eval_steps=1, seed=0)
    trainer.train()
    values = np.random.RandomState(0).rand(8).astype(np.float32) + 1
    rounded = ((values + values + values) / np.float32(3)).astype(np.float32)
    assert (rounded != values).any()  # what a plain mean would do to them
    bn = trainer.model.get_layer("bn")
    bn.moving_mean.assign(values)  # every copy
    trainer._replica_stats.average()
    for copy in copies(bn.moving_mean):
        np.testing.assert_array_equal(copy, values)


@pytest.mark.slow
def test_two_worker_processes_save_the_global_batches_moving_mean(tmp_path):
    """On 2 worker processes each worker's copy followed its own file; the chief's
    checkpoint must hold the statistics of both workers' batches."""
    rng = np.random.RandomState(0)
    shards = [rng.randn(64, 8).astype(np.float32) + shift for shift in (0.0, 3.0)]
    for index, x in enumerate(shards):
        tputrain.data.write_tfrecords({"x": x, "label": (x[:, 0] > 0).astype(np.int64)},
                                      str(tmp_path / f"train{index}"), num_shards=1)
    config = tmp_path / "bn.gin"
    config.write_text(f"""
Trainer.task = @InputNormRecordsTask()
InputNormRecordsTask.pattern = '{tmp_path}/train*'
Trainer.train_steps = {STEPS}
Trainer.steps_per_loop = 2
Trainer.checkpoint_every = 2
Trainer.eval_steps = 1
Trainer.global_batch_size = {BATCH}
Trainer.report_mfu = False
""")
    model_dir = tmp_path / "model"
    launch = Launch(["--workers", "2", "--gin_import=faults", f"--gin_file={config}",
                     f"--model_dir={model_dir}"])
    assert launch.finish(timeout=300) == 0, launch.text()[-4000:]
    half = BATCH // 2  # each worker's replica reads its own file's next 8 examples a step
    expected = moving_mean([np.concatenate([x[step * half:(step + 1) * half] for x in shards])
                            for step in range(STEPS)])
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    np.testing.assert_allclose(saved_moving_mean(path), expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------- other non-trainable state (issue 32, item 4)


class RunningStatsTask(TinyTask):
    """TinyTask behind a `faults.RunningStats` layer on its inputs."""

    def __init__(self, declared: bool = True):
        super().__init__()
        self.declared = declared

    def build_model(self) -> keras.Model:
        return running_stats_model(self.declared)


def assert_global_running_stats(count, total, mean, x: np.ndarray) -> None:
    """The statistics of every example of the STEPS global batches `x` (in order)."""
    assert count == STEPS * BATCH
    np.testing.assert_allclose(total, x[:STEPS * BATCH].sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mean, moving_mean([x[s * BATCH:(s + 1) * BATCH]
                                                  for s in range(STEPS)]), rtol=1e-5, atol=1e-6)


def saved_stats(path: str) -> dict[str, np.ndarray]:
    """The "stats" layer's weights in a checkpoint or SavedModel variables file."""
    reader = tf.train.load_checkpoint(path)
    found = {}
    for name, _ in tf.train.list_variables(path):
        for weight in ("count", "total", "mean"):
            if "OPTIMIZER" not in name and name.endswith(f"/{weight}/.ATTRIBUTES/VARIABLE_VALUE"):
                found[weight] = reader.get_tensor(name)
    assert sorted(found) == ["count", "mean", "total"], tf.train.list_variables(path)
    return found


def test_declared_running_statistics_are_one_across_replicas(tmp_path):
    """aggregation="sum" counts every replica's examples once; "mean" averages: every
    copy, the checkpoint and the export hold the statistics of the global batches."""
    trainer = train_task(tmp_path, RunningStatsTask(), replicas=2)
    layer = trainer.model.get_layer("stats")
    for name in ("count", "total", "mean"):
        values = copies(getattr(layer, name))
        for copy in values[1:]:
            np.testing.assert_array_equal(copy, values[0], err_msg=name)
    x = trainer.task.x
    assert_global_running_stats(copies(layer.count)[0], copies(layer.total)[0],
                                copies(layer.mean)[0], x)
    assert_global_running_stats(**saved_stats(trainer.checkpointer.latest), x=x)
    exported = export_checkpoint(trainer, examples=False)
    assert_global_running_stats(**saved_stats(f"{exported}/variables/variables"), x=x)


def test_declared_running_statistics_train_under_gradient_accumulation(tmp_path):
    """accumulation_steps=2 on 2 replicas: a "sum" or "mean" weight's write (a merge of the
    replicas) inside the micro-batches' while loop failed with an 85-line RuntimeError
    ("merge_call called while defining a new graph"). The count and the total are
    those of every example of the global batches."""
    trainer = train_task(tmp_path, RunningStatsTask(), replicas=2, accumulation_steps=2)
    layer = trainer.model.get_layer("stats")
    assert copies(layer.count)[0] == STEPS * BATCH
    np.testing.assert_allclose(copies(layer.total)[0], trainer.task.x[:STEPS * BATCH].sum(0),
                               rtol=1e-5, atol=1e-5)


def test_undeclared_state_that_diverges_is_refused(tmp_path):
    """Weights updated in the forward pass with aggregation "none" (Keras's default)
    would be saved as replica 0's copy (a count of half the examples, equal on both
    replicas): one line names them and the fix, before anything is saved."""
    with pytest.raises(ValueError,
                       match=r"stats/count.*aggregation=\"sum\".*aggregation=\"mean\""):
        train_task(tmp_path, RunningStatsTask(declared=False), replicas=2)
    assert not (tmp_path / "r2" / "checkpoints").exists()


def test_a_keras_model_train_step_override_is_refused(tmp_path):
    """The Trainer never calls `keras.Model.train_step`: a model that overrides it would
    train without it, silently."""
    class OwnStep(keras.Model):
        def train_step(self, data):  # never called by the Trainer
            raise AssertionError("unreachable")

    class OwnStepTask(TinyTask):
        def build_model(self) -> keras.Model:
            inputs = keras.Input((8,), name="x")
            return OwnStep({"x": inputs}, keras.layers.Dense(2)(inputs))

    with pytest.raises(TypeError, match=r"OwnStep\.train_step.*Task\.train_step"):
        tputrain.Trainer(OwnStepTask(), str(tmp_path), strategy=strategy_for(1), train_steps=2,
                         global_batch_size=BATCH, eval_steps=1)


@pytest.mark.slow
def test_two_worker_processes_keep_one_copy_of_declared_running_statistics(tmp_path):
    """One replica on each of 2 worker processes reading its own file: both workers'
    copies and the chief's checkpoint hold the statistics of both workers' examples."""
    rng = np.random.RandomState(0)
    shards = [rng.randn(64, 8).astype(np.float32) + shift for shift in (0.0, 3.0)]
    for index, x in enumerate(shards):
        tputrain.data.write_tfrecords({"x": x, "label": (x[:, 0] > 0).astype(np.int64)},
                                      str(tmp_path / f"train{index}"), num_shards=1)
    config = tmp_path / "stats.gin"
    config.write_text(f"""
Trainer.task = @RunningStatsRecordsTask()
RunningStatsRecordsTask.pattern = '{tmp_path}/train*'
Trainer.actions = [@SaveRunningStats()]
SaveRunningStats.directory = '{tmp_path}'
Trainer.train_steps = {STEPS}
Trainer.steps_per_loop = 2
Trainer.checkpoint_every = 2
Trainer.eval_steps = 1
Trainer.global_batch_size = {BATCH}
Trainer.report_mfu = False
""")
    model_dir = tmp_path / "model"
    launch = Launch(["--workers", "2", "--gin_import=faults", f"--gin_file={config}",
                     f"--model_dir={model_dir}"])
    assert launch.finish(timeout=300) == 0, launch.text()[-4000:]
    half = BATCH // 2  # each worker's replica reads its own file's next 8 examples a step
    x = np.concatenate([np.concatenate([s[step * half:(step + 1) * half] for s in shards])
                        for step in range(STEPS)])
    workers = [np.load(tmp_path / f"worker{w}.npz") for w in (0, 1)]
    for name in ("count", "total", "mean"):
        np.testing.assert_array_equal(workers[0][name], workers[1][name], err_msg=name)
    assert_global_running_stats(workers[0]["count"][0], workers[0]["total"][0],
                                workers[0]["mean"][0], x)
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    assert_global_running_stats(**saved_stats(path), x=x)
