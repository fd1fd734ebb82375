"""Random augmentation in the train pipeline (issue 32, item 5).

Stateful random ops and Keras random layers train, with one warning naming what
will not resume exactly; `tputrain.data.stateless_augment` resumes bitwise after
SIGKILL; an explicit external_state_policy="fail" is a tputrain error, not TF's.
"""

from __future__ import annotations

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import Process, child_env, copy_at_pause, pausable_env, same_final_weights
from tiny import TinyTask, strategy_for
from tputrain.runtime.validate import iterator_state_bytes

WARNING = "cannot checkpoint"  # the one warning's words


def keras_layers():
    """RandomFlip and RandomTranslation (their SeedGenerators are tf.Variables), as a
    map function; the layers are made once, outside the traced function."""
    flip = keras.layers.RandomFlip("horizontal", seed=1)
    translate = keras.layers.RandomTranslation(0.2, 0.2, seed=2)

    def augment(features, labels):
        images = translate(flip(tf.reshape(features["x"], [-1, 2, 4, 1])))
        return {"x": tf.reshape(images, [-1, 8])}, labels
    return augment


def tf_image_and_random():
    """`tf.image.random_flip_left_right` and `tf.random.uniform`: stateful random ops."""
    return stateful_draws


def stateful_draws(features, labels):
    images = tf.image.random_flip_left_right(tf.reshape(features["x"], [-1, 2, 4, 1]))
    x = tf.reshape(images, [-1, 8])
    return {"x": x + tf.random.uniform(tf.shape(x), -0.5, 0.5)}, labels


class RandomAugmentTask(TinyTask):
    """TinyTask whose train batches go through `augment` (stateful randomness)."""

    def __init__(self, make_augment, options: tputrain.data.InputOptions | None = None):
        super().__init__()
        self.augment = make_augment()
        self.options = options

    def build_inputs(self, split, input_context):
        dataset = super().build_inputs(split, input_context)
        if split != "train":
            return dataset
        dataset = dataset.map(self.augment)
        return dataset.with_options(self.options.tf_options()) if self.options else dataset


def trainer(tmp_path, task, train_steps):
    return tputrain.Trainer(task, str(tmp_path / "model"), strategy=strategy_for(1),
                            train_steps=train_steps, steps_per_loop=2, checkpoint_every=2,
                            global_batch_size=16, report_mfu=False)


@pytest.mark.parametrize("augment, named", [
    pytest.param(keras_layers, ["ReadVariableOp", "random_flip", "random_translation",
                                "SeedGenerator"], marks=pytest.mark.slow),
    (tf_image_and_random, ["RandomUniform", "random_flip_left_right", "random_uniform"]),
])
def test_random_augmentation_trains_and_resumes_with_one_warning(tmp_path, caplog, augment,
                                                                 named):
    # `augment` makes the map function (Keras layers must exist before it is traced).
    with caplog.at_level("WARNING"):
        trainer(tmp_path, RandomAugmentTask(augment), train_steps=4).train()
    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == 1, warnings
    for word in named + ["the augmentation does not resume exactly", "stateless_augment"]:
        assert word in warnings[0], (word, warnings[0])
    assert tf.train.latest_checkpoint(str(tmp_path / "model" / "checkpoints")).endswith("-4")

    caplog.clear()  # the iterator saved without that state restores and reads on
    with caplog.at_level("WARNING"):
        resumed = trainer(tmp_path, RandomAugmentTask(augment), train_steps=6)
        resumed.train()
    assert resumed.current_step == 6
    assert sum(WARNING in r.getMessage() for r in caplog.records) == 1


def test_fail_policy_is_a_tputrain_error_naming_the_ops(tmp_path):
    task = RandomAugmentTask(tf_image_and_random,
                             tputrain.data.InputOptions(external_state_policy="fail"))
    with pytest.raises(tputrain.data.InputStateError, match="RandomUniform.*'fail'"):
        trainer(tmp_path, task, train_steps=2)
    assert not (tmp_path / "model" / "checkpoints").exists()


def test_the_preflight_names_state_tf_data_refuses_to_save():
    """The backstop for state the Trainer's look through the pipeline would miss."""
    dataset = tf.data.Dataset.range(4).map(lambda i: tf.random.uniform([]))
    with pytest.raises(tputrain.data.InputStateError, match="op RandomUniform\\).*'ignore'"):
        iterator_state_bytes(dataset)


def test_stateless_augment_draws_differ_by_position_and_host():
    images = tf.data.Dataset.from_tensors((tf.zeros([3]), tf.constant(0))).repeat(4)

    def noise(x, label, seed):
        return x + tf.random.stateless_uniform([3], seed), label

    def draws(host):
        context = tputrain.data.InputContext(num_input_pipelines=2, input_pipeline_id=host)
        dataset = images.apply(tputrain.data.stateless_augment(noise, 5, context))
        return np.stack([x.numpy() for x, _ in dataset])
    host0 = draws(0)
    assert len({row.tobytes() for row in host0}) == 4  # a new draw at each position
    assert not np.isin(host0, draws(1)).any()  # the other host draws its own
    np.testing.assert_array_equal(host0, draws(0))  # a function of position alone


# ------------------------------------------------------------ end to end

CONFIG = """
Trainer.task = @AugmentTask()
Trainer.train_steps = 12
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.checkpoint_every = 4
Trainer.eval_steps = 1
Trainer.report_mfu = False
"""


@pytest.mark.slow
def test_stateless_augment_resumes_bitwise_after_sigkill(tmp_path):
    config = tmp_path / "augment.gin"
    config.write_text(CONFIG)

    def child(model_dir, *params, pausable=False):
        env = pausable_env(child_env()) if pausable else child_env()
        return Process([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                        f"--gin_file={config}", f"--model_dir={tmp_path / model_dir}",
                        "--deterministic", *params], env, stdin=pausable)
    # The uninterrupted run pauses after step 6: "interrupted" is its model_dir as a
    # SIGKILL there leaves it (one process less than a second run killed there).
    reference = child("reference", "--gin_param=Trainer.actions=[@PauseAtStep()]",
                      "--gin_param=PauseAtStep.step=6", pausable=True)
    copy_at_pause(reference, tmp_path / "reference", tmp_path / "interrupted",
                  r"tputrain-test: paused at step 6")
    killed = reference.text()  # what a run killed there had printed
    assert "saved checkpoint" in killed and "ckpt-4" in killed, killed[-3000:]
    resumed = child("interrupted")
    assert resumed.finish() == 0, resumed.log()
    assert "ckpt-4 (step 4)" in resumed.text(), resumed.log()  # steps 5-6 replayed
    assert reference.finish() == 0, reference.log()
    for run in (reference, resumed):
        assert WARNING not in run.text(), run.log()

    weights = same_final_weights(tmp_path)
    assert len(weights) > 4
