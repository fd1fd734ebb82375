"""Random layers on N replicas draw per-replica randomness (loop/replica_seeds.py).

A Keras `SeedGenerator`'s state is one variable, mirrored under MirroredStrategy:
every replica read the same state and drew the same dropout mask at every step.
Each replica must draw its own, while the stream stays a function of (step,
replica) only: a resume, or another `steps_per_loop`, gives the same weights.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import mask_probe_model
from processes import Launch
from tiny import TinyTask, strategy_for, weights

STEPS, BATCH = 4, 16


class MaskProbeTask(TinyTask):
    """TinyTask behind a `faults.MaskProbe` dropout on its inputs."""

    def build_model(self) -> keras.Model:
        return mask_probe_model(STEPS, BATCH // 2)


def assert_masks_differ_at_every_step(first: np.ndarray, second: np.ndarray) -> None:
    """Two replicas' [steps, units] masks: each step's mask dropped some units and kept
    some, and the replicas' masks of the same step differ."""
    assert first.shape == second.shape == (STEPS, BATCH // 2 * 8)
    for masks in (first, second):
        assert (masks.sum(1) > 0).all() and (masks.sum(1) < masks.shape[1]).all()
    for step in range(STEPS):
        assert (first[step] != second[step]).any(), f"step {step}: the same dropout mask"


@pytest.mark.parametrize("jit_compile", ["auto", pytest.param(True, marks=pytest.mark.slow)])
def test_two_replicas_draw_different_dropout_masks_at_every_step(tmp_path, jit_compile):
    # Under XLA the masks are ThreeFry draws (loop/xla_dropout.py), seeded as without it.
    trainer = tputrain.Trainer(MaskProbeTask(), str(tmp_path), strategy=strategy_for(2),
                               train_steps=STEPS, steps_per_loop=2, global_batch_size=BATCH,
                               checkpoint_every=STEPS, eval_steps=1, report_mfu=False,
                               jit_compile=jit_compile)
    trainer.train()
    if jit_compile is True:  # the masks were drawn inside XLA, on each device
        assert trainer.plan.xla_plan.gradients_only
    assert_masks_differ_at_every_step(*trainer.model.get_layer("probe").local_masks())


def test_gaussian_noise_differs_across_replicas(tmp_path):
    """Any layer drawing from a SeedGenerator, not only Dropout."""
    class NoiseTask(TinyTask):
        def build_model(self) -> keras.Model:
            inputs = keras.Input((8,), name="x")
            h = keras.layers.GaussianNoise(1.0, seed=1, name="noise")(inputs)
            return keras.Model({"x": inputs}, keras.layers.Dense(2)(h))

    trainer = tputrain.Trainer(NoiseTask(), str(tmp_path), strategy=strategy_for(2),
                               train_steps=2, global_batch_size=BATCH, eval_steps=1,
                               report_mfu=False)
    layer = trainer.model.get_layer("noise")
    noise = tf.function(lambda: trainer.strategy.run(
        lambda: layer(tf.zeros([4, 8]), training=True)))()
    first, second = (v.numpy() for v in trainer.strategy.experimental_local_results(noise))
    assert (first != 0).all() and (first != second).all()


def _train(model_dir, steps: int, steps_per_loop: int, checkpoint_every: int) -> tputrain.Trainer:
    trainer = tputrain.Trainer(TinyTask(dropout=0.3), str(model_dir), strategy=strategy_for(2),
                               train_steps=8, steps_per_loop=steps_per_loop,
                               global_batch_size=BATCH, checkpoint_every=checkpoint_every,
                               eval_steps=1, report_mfu=False)
    trainer.train(steps)
    return trainer

@pytest.mark.slow

def test_stream_depends_on_step_and_replica_only(tmp_path):
    """2 replicas with dropout: 8 steps in loops of 2 = 3 steps in loops of 3, saved and
    resumed into a new Trainer for 5 more in loops of 1, bitwise."""
    reference = weights(_train(tmp_path / "reference", 8, steps_per_loop=2, checkpoint_every=8))
    _train(tmp_path / "split", 3, steps_per_loop=3, checkpoint_every=3)
    resumed = _train(tmp_path / "split", 5, steps_per_loop=1, checkpoint_every=5)
    assert resumed.current_step == 8
    for got, want in zip(weights(resumed), reference):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_two_worker_processes_draw_different_dropout_masks(tmp_path):
    """One replica on each of 2 worker processes: the replica id in sync is global."""
    x = np.random.RandomState(0).randn(128, 8).astype(np.float32)
    tputrain.data.write_tfrecords({"x": x, "label": (x[:, 0] > 0).astype(np.int64)},
                                  str(tmp_path / "train"), num_shards=2)
    config = tmp_path / "masks.gin"
    config.write_text(f"""
Trainer.task = @MaskProbeRecordsTask()
MaskProbeRecordsTask.pattern = '{tmp_path}/train*'
MaskProbeRecordsTask.steps = {STEPS}
MaskProbeRecordsTask.per_replica_batch = {BATCH // 2}
Trainer.actions = [@SaveProbe()]
SaveProbe.directory = '{tmp_path}'
Trainer.train_steps = {STEPS}
Trainer.steps_per_loop = 2
Trainer.checkpoint_every = {STEPS}
Trainer.eval_steps = 1
Trainer.global_batch_size = {BATCH}
Trainer.report_mfu = False
""")
    launch = Launch(["--workers", "2", "--gin_import=faults", f"--gin_file={config}",
                     f"--model_dir={tmp_path / 'model'}"])
    assert launch.finish(timeout=300) == 0, launch.text()[-4000:]
    (first,), (second,) = (np.load(tmp_path / f"worker{w}.npy") for w in (0, 1))
    assert_masks_differ_at_every_step(first, second)
