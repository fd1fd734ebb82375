"""The Keras-Hub fine-tuning path: a GPT-2 built from its config, LoRA enabled, trained by
the Trainer (trainable set, EMA, exact resume, side-car eval, 1 and 2 replicas)."""

import numpy as np
import pytest
import tensorflow as tf

import tputrain

from hub import latest_values, lora_trainer, token_batch
from tiny import strategy_for
from tputrain.checkpoint import CheckpointMismatchError
from tputrain.optim.ema import averaged_weights
from tputrain.serving.export import restored_model
from tputrain.serving.keras_saving import lora_variables
from tputrain.jobs.sidecar import ReadOnlyTrainer

pytestmark = pytest.mark.same_worker("keras_hub_lm")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(trainer, {path: value} of every weight before training, eval logs): 8 steps on
    1 replica, with the token embedding left trainable beside the LoRA factors."""
    trainer = lora_trainer(tmp_path_factory.mktemp("lora"), trainable_layers=["token_embedding"])
    before = {v.path: v.numpy() for v in trainer.model.weights}
    logs = trainer.train()
    yield trainer, before, logs
    trainer.close()


def test_the_trainable_weights_are_the_lora_factors_and_what_the_user_left(lora_run):
    trainer, before, _ = lora_run
    model = trainer.model
    lora = {v.path for v in lora_variables(model)}
    assert len(lora) == 2 * 2 * 2  # query and value of 2 layers, a and b factors
    # enable_lora keeps the adapted layers' biases trainable (Keras's EinsumDense).
    adapted_biases = {p.replace("lora_kernel_a", "bias") for p in lora if "lora_kernel_a" in p}
    expected = lora | adapted_biases | {"token_embedding/embeddings"}
    assert {v.path for v in model.trainable_variables} == expected
    assert len(trainer.optimizer.variables) > 0
    for variable in model.weights:  # frozen weights: bitwise as built
        if variable.path not in expected:
            np.testing.assert_array_equal(variable.numpy(), before[variable.path],
                                          err_msg=variable.path)
    for variable in lora_variables(model):  # b starts at zero: lora_run, it is not
        if "lora_kernel_b" in variable.path:
            assert np.abs(variable.numpy()).max() > 0, variable.path


def test_ema_averages_exactly_the_trainable_weights(lora_run):
    trainer, _, _ = lora_run
    averaged = trainer.ema.averages
    assert [a.shape for a in averaged] == [v.shape for v in trainer.model.trainable_variables]
    assert int(trainer.ema.state.updates.numpy()) == 8
    keys = [k for k in latest_values(trainer.model_dir) if k.startswith("ema/")]
    assert len([k for k in keys if "averages" in k]) == len(trainer.model.trainable_variables)


def test_a_resumed_run_is_bitwise_the_uninterrupted_one(lora_run, tmp_path):
    """4 steps, a new Trainer on the same model_dir, 4 more: the checkpoint equals the
    fixture's 8 uninterrupted steps bitwise (model, LoRA factors, Adam slots, EMA)."""
    reference, _, _ = lora_run
    first = lora_trainer(tmp_path, trainable_layers=["token_embedding"])
    first.train(num_steps=4)
    first.close()
    second = lora_trainer(tmp_path, trainable_layers=["token_embedding"])
    second.train()
    expected, actual = latest_values(reference.model_dir), latest_values(tmp_path)
    assert expected.keys() == actual.keys()
    for factor in lora_variables(reference.model):  # saved (under the optimizer's keys)
        assert any(np.array_equal(value, factor.numpy()) for value in expected.values())
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


def test_the_side_car_evaluates_the_lora_checkpoint_as_training_did(lora_run):
    trainer, _, logs = lora_run
    sidecar = ReadOnlyTrainer(trainer.task, trainer.model_dir, strategy=trainer.strategy,
                              train_steps=8, steps_per_loop=4, checkpoint_every=4,
                              global_batch_size=8, eval_every=8, ema_decay=0.5,
                              jit_compile=False, report_mfu=False)
    assert sidecar.evaluate() == pytest.approx(logs, abs=1e-6)


def _lora_after_build(trainer, rank: int = 4) -> None:
    """What a user does to the Trainer's model: LoRA enabled in the strategy's scope."""
    with trainer.strategy.scope():
        trainer.model.backbone.enable_lora(rank)


def test_lora_enabled_after_the_trainer_built_the_model_trains_only_the_factors(tmp_path):
    """train() adopts the new trainable set: an optimizer with slots for the LoRA weights
    only, an EMA of them only, checkpoints that hold the factors; the base stays frozen."""
    trainer = lora_trainer(tmp_path, lora_rank=None, steps=4)
    _lora_after_build(trainer)
    before = {v.path: v.numpy() for v in trainer.model.weights}
    trainer.train()
    model = trainer.model
    lora = {v.path for v in lora_variables(model)}
    adapted_biases = {p.replace("lora_kernel_a", "bias") for p in lora if "lora_kernel_a" in p}
    trainable = list(model.trainable_variables)
    assert len(lora) == 8 and {v.path for v in trainable} == lora | adapted_biases
    # Adam: iterations, learning rate, and two moments of each trainable weight only.
    assert len(trainer.optimizer.variables) == 2 + 2 * len(trainable)
    assert [a.shape for a in trainer.ema.averages] == [v.shape for v in trainable]
    for variable in model.weights:
        if variable.path not in lora | adapted_biases:
            np.testing.assert_array_equal(variable.numpy(), before[variable.path],
                                          err_msg=variable.path)
    saved = latest_values(tmp_path)
    for factor in lora_variables(model):
        assert any(np.array_equal(value, factor.numpy()) for value in saved.values())
    # What the exports read: a new model from the Task, with the Trainer model's LoRA.
    restored = restored_model(trainer, tf.train.latest_checkpoint(f"{tmp_path}/checkpoints"))
    with averaged_weights(trainer.ema):
        expected = model(token_batch(), training=False).numpy()
    np.testing.assert_allclose(restored(token_batch()).numpy(), expected, atol=1e-6)
    trainer.close()


def test_lora_enabled_outside_the_strategy_scope_is_refused_with_the_fix(tmp_path):
    trainer = lora_trainer(tmp_path, lora_rank=None)
    trainer.model.backbone.enable_lora(4)
    with pytest.raises(ValueError, match=r"trainer\.strategy\.scope\(\)"):
        trainer.train()


def test_a_checkpoint_written_before_lora_is_refused_in_one_line_naming_the_fix(tmp_path):
    """Its optimizer slots are the whole model's: a new model_dir starts from it."""
    trainer = lora_trainer(tmp_path / "base", lora_rank=None, steps=4)
    trainer.checkpointer.save()  # what a run without LoRA leaves
    _lora_after_build(trainer)
    with pytest.raises(CheckpointMismatchError, match=r"before LoRA.*InitCheckpoint") as error:
        trainer.train()
    assert "\n" not in str(error.value)


class _EnableLoraAtStart(tputrain.Action):
    """Changes the trainable set once training has begun: the step is traced for it."""

    def on_train_begin(self, context, step):
        with context.strategy.scope():
            context.model.backbone.enable_lora(4)


def test_lora_enabled_by_an_action_during_training_is_refused_with_the_fix(tmp_path):
    trainer = lora_trainer(tmp_path, lora_rank=None, actions=[_EnableLoraAtStart()])
    with pytest.raises(ValueError, match=r"during training.*before Trainer\.train\(\)"):
        trainer.train()


@pytest.mark.slow
def test_a_lora_checkpoint_read_without_lora_enabled_names_the_fix(tmp_path):
    """A rerun that forgets enable_lora: the Trainer builds (LoRA may still come), and
    train() says what is missing."""
    trainer = lora_trainer(tmp_path, lora_rank=None, steps=4)
    _lora_after_build(trainer)
    trainer.train()
    trainer.close()
    again = lora_trainer(tmp_path, lora_rank=None, steps=4)
    with pytest.raises(CheckpointMismatchError, match=r"LoRA.*enable_lora") as error:
        again.train()
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_lora_enabled_after_build_resumes_bitwise_after_a_kill(tmp_path):
    """A script that builds the Trainer, enables LoRA on its model and trains, killed (-9)
    after step 4 and rerun: its last checkpoint is bitwise the uninterrupted run's."""
    import sys

    from faults import Process, child_env, copy_at_pause, pausable_env

    def child(model_dir, pause_at=None):
        call = f"hub.lora_after_build_run({str(model_dir)!r}, {pause_at!r})"
        env = pausable_env(child_env()) if pause_at else child_env()
        return Process([sys.executable, "-c", f"import hub; {call}"], env,
                       stdin=bool(pause_at))

    reference = child(tmp_path / "reference", pause_at=4)
    copy_at_pause(reference, tmp_path / "reference", tmp_path / "interrupted",
                  r"tputrain-test: paused at step 4")
    assert reference.finish() == 0, reference.log()
    resumed = child(tmp_path / "interrupted")
    assert resumed.finish() == 0, resumed.log()
    assert "training from step 2 to 8" in resumed.text(), resumed.log()
    expected, actual = latest_values(tmp_path / "reference"), latest_values(tmp_path / "interrupted")
    assert expected.keys() == actual.keys() and any(k.startswith("ema/") for k in expected)
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


@pytest.mark.slow
def test_two_replicas_train_as_one(tmp_path):
    one = lora_trainer(tmp_path / "one")
    one.train()
    two = lora_trainer(tmp_path / "two", replicas=2)
    two.train()
    for a, b in zip(one.model.trainable_variables, two.model.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5, err_msg=a.path)


@pytest.mark.slow
def test_sigkill_midway_resumes_bitwise(tmp_path):
    """The CLI run of a LoRA config killed (-9) after step 4 and rerun: its last checkpoint
    is bitwise the uninterrupted run's."""
    from faults import killed_and_rerun

    config = tmp_path / "lora.gin"
    config.write_text("\n".join([
        "Trainer.task = @KerasHubLMTask()", "Trainer.train_steps = 8",
        "Trainer.steps_per_loop = 2", "Trainer.checkpoint_every = 2",
        "Trainer.global_batch_size = 8", "Trainer.ema_decay = 0.5",
        "Trainer.report_mfu = False", "Trainer.jit_compile = False",
        "KerasHubLMTask.lora_rank = 4",
        "KerasHubLMTask.learning_rate = 0.01", "KerasHubLMTask.train_rows = 64",
        "KerasHubLMTask.eval_rows = 16"]))
    _, resumed = killed_and_rerun(tmp_path, config, step=4)
    # Killed before step 4's save: steps 3 and 4 are trained again, from ckpt-2.
    assert "training from step 2 to 8" in resumed.text(), resumed.log()
    expected, actual = latest_values(tmp_path / "reference"), latest_values(tmp_path / "interrupted")
    assert expected.keys() == actual.keys()
    assert any(k.startswith("ema/") for k in expected)
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


def test_without_lora_biases_the_trainable_weights_are_exactly_the_factors():
    """Keras's enable_lora leaves the adapted layers' biases trainable; lora_biases=False
    freezes them too."""
    from tputrain.tasks.keras_hub_lm import KerasHubLMTask

    model = KerasHubLMTask(lora_rank=2, lora_biases=False).build_model()
    assert {v.path for v in model.trainable_variables} == {
        v.path for v in lora_variables(model)}
    assert len(model.trainable_variables) == 8



def _compiled_lora_lm():
    """The user's Keras-Hub model: LoRA enabled, compiled as for `model.fit`."""
    import keras

    from tputrain.tasks.keras_hub_lm import KerasHubLMTask

    model = KerasHubLMTask(lora_rank=4).build_model()
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _token_data(count, seed):
    """KerasHubLMTask's rows as fit-style arrays: (features, next tokens)."""
    from tputrain.tasks.keras_hub_lm import arithmetic_rows

    rows = arithmetic_rows(count, 16, 100, (1, 2, 3), seed)
    return {"token_ids": rows[:, :-1], "padding_mask": np.ones_like(rows[:, :-1])}, rows[:, 1:]


def test_a_lora_model_passed_to_keras_task_keeps_its_lora_and_weights():
    """`tputrain.fit`'s KerasTask clones the user's model: the clone has the same LoRA
    layers, trainable set and values (the factors included)."""
    from tputrain.keras_task import KerasTask

    model = _compiled_lora_lm()
    for index, factor in enumerate(lora_variables(model)):
        factor.assign(np.random.default_rng(index).normal(size=factor.shape))
    clone = KerasTask(model, _token_data(16, 0), batch_size=8).build_model()
    assert [v.path for v in clone.trainable_variables] == [
        v.path for v in model.trainable_variables]
    assert len(lora_variables(clone)) == 8
    values = {v.path: v.numpy() for v in model.weights}
    assert {v.path for v in clone.weights} == set(values)
    for variable in clone.weights:
        np.testing.assert_array_equal(variable.numpy(), values[variable.path],
                                      err_msg=variable.path)


@pytest.mark.slow
def test_tputrain_fit_trains_a_lora_model_as_the_keras_hub_task_does(tmp_path):
    """A Keras-Hub model with LoRA enabled by the user, through `tputrain.fit`: only the
    LoRA weights move, and they equal KerasHubLMTask's run on the same rows (its loss,
    a mean of row means, is fit's token mean here: every row is 16 tokens)."""
    model = _compiled_lora_lm()
    before = {v.path: v.numpy() for v in model.weights}
    trainable = {v.path for v in model.trainable_variables}
    tputrain.fit(model, _token_data(64, 0), _token_data(16, 1), model_dir=str(tmp_path / "fit"),
                 steps=8, batch_size=8, shuffle=False, eval_every=8, steps_per_loop=4,
                 strategy=strategy_for(1), jit_compile=False, report_mfu=False)
    reference = lora_trainer(tmp_path / "task", ema_decay=None)
    reference.train()
    expected = {v.path: v.numpy() for v in reference.model.weights}
    for variable in model.weights:
        if variable.path in trainable:
            assert not np.array_equal(variable.numpy(), before[variable.path]), variable.path
            np.testing.assert_allclose(variable.numpy(), expected[variable.path], atol=1e-5,
                                       err_msg=variable.path)
        else:
            np.testing.assert_array_equal(variable.numpy(), before[variable.path],
                                          err_msg=variable.path)
