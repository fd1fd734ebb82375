"""EMA weights (`Trainer.ema_decay`): evaluation, predict and export use the average;
training goes on with the raw weights. Expected averages are computed here, in
float64, from the raw weights recorded after every step."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import TinyTask, strategy_for

pytestmark = pytest.mark.same_worker("test_ema.py")  # the module's trained runs, once

DECAY = 0.8
STEPS = 6


class RecordWeights(tputrain.Action):
    """The raw trainable weights (and the run's averages) after every loop."""

    def __init__(self):
        self.raw: list[list[np.ndarray]] = []
        self.averages: list[list[np.ndarray]] = []

    def on_loop_end(self, context, step, logs):
        self.raw.append([np.array(v) for v in context.model.trainable_variables])
        ema = context.ema
        if ema is not None:
            self.averages.append([np.array(v) for v in ema.averages])


def manual_average(raw: list[list[np.ndarray]], decay: float = DECAY,
                   applied: list[bool] | None = None) -> list[np.ndarray]:
    """The average of the weights after each applied step: the first applied step's
    weights, then decay * average + (1 - decay) * weights."""
    average = None
    for i, weights in enumerate(raw):
        if applied is not None and not applied[i]:
            continue
        weights = [w.astype(np.float64) for w in weights]
        average = weights if average is None else [
            decay * a + (1 - decay) * w for a, w in zip(average, weights)]
    return average


def trainer_for(tmp_path, name, replicas=1, ema_decay=DECAY, actions=(), task=None,
                train_steps=STEPS, **kwargs):
    return tputrain.Trainer(task or TinyTask(), str(tmp_path / name), strategy_for(replicas),
                            train_steps=train_steps, steps_per_loop=1, global_batch_size=32,
                            report_mfu=False, ema_decay=ema_decay, actions=list(actions),
                            **kwargs)


def set_trainable(model, values) -> None:
    for variable, value in zip(model.trainable_variables, values):
        variable.assign(np.asarray(value, np.float32))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An EMA run and the same run without EMA, with their raw weights recorded."""
    tmp_path = tmp_path_factory.mktemp("ema")
    record, plain_record = RecordWeights(), RecordWeights()
    ema_run = trainer_for(tmp_path, "ema", actions=[record])
    ema_logs = ema_run.train()
    plain = trainer_for(tmp_path, "plain", ema_decay=None, actions=[plain_record])
    plain_logs = plain.train()
    return tmp_path, ema_run, ema_logs, record, plain, plain_logs, plain_record


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="ema_decay"):
        tputrain.TrainerOptions(ema_decay=1.0)
    with pytest.raises(ValueError, match="ema_decay"):
        tputrain.TrainerOptions(ema_decay=0)
    assert tputrain.TrainerOptions(ema_decay=0.999).ema_decay == 0.999


def test_evaluation_uses_the_average_and_training_the_raw_weights(runs):
    _, ema_run, ema_logs, record, plain, plain_logs, plain_record = runs
    assert len(record.raw) == STEPS
    # Training continued on the raw weights: bitwise those of a run without EMA.
    for ema_w, plain_w in zip(record.raw, plain_record.raw):
        for a, b in zip(ema_w, plain_w):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(ema_run.model.trainable_variables, plain.model.trainable_variables):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    expected = manual_average(record.raw)
    for average, value in zip(ema_run.ema.averages, expected):
        np.testing.assert_allclose(np.array(average), value, rtol=0, atol=1e-6)
    # The EMA run's eval = the plain run's model holding the manual average.
    raw = [np.array(v) for v in plain.model.trainable_variables]
    set_trainable(plain.model, expected)
    try:
        averaged_logs = plain.evaluate_weights()
    finally:
        set_trainable(plain.model, raw)
    assert abs(ema_logs["loss"] - plain_logs["loss"]) > 1e-4  # the average differs
    for key in averaged_logs:
        assert ema_logs[key] == pytest.approx(averaged_logs[key], abs=1e-6), key


def test_the_eval_line_says_ema_weights(runs, caplog):
    ema_run, plain = runs[1], runs[4]
    with caplog.at_level("INFO"):
        ema_run.evaluate_weights()
    assert "EMA weights" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        plain.evaluate_weights()
    assert "EMA weights" not in caplog.text


def _averaged_outputs(ema_run, record):
    model = ema_run.task.build_model()
    set_trainable(model, manual_average(record.raw))
    return np.asarray(model({"x": ema_run.task.x}, training=False))


def test_predict_uses_the_average(runs):
    _, ema_run, _, record, *_ = runs
    raw = [np.array(v) for v in ema_run.model.trainable_variables]
    outputs = ema_run.predict("eval")
    np.testing.assert_allclose(outputs, _averaged_outputs(ema_run, record), atol=1e-5)
    for value, variable in zip(raw, ema_run.model.trainable_variables):
        np.testing.assert_array_equal(np.array(variable), value)  # raw ones back


def test_export_holds_the_average(runs):
    tmp_path, ema_run, _, record, *_ = runs
    path = tputrain.export_checkpoint(ema_run, export_dir=str(tmp_path / "exported"))
    serving = tf.saved_model.load(path).signatures["serving_default"]
    outputs = serving(x=tf.constant(ema_run.task.x))
    np.testing.assert_allclose(np.asarray(next(iter(outputs.values()))),
                               _averaged_outputs(ema_run, record), atol=1e-5)


def test_checkpoints_hold_the_averages(runs):
    _, ema_run, *_ = runs
    path = tf.train.latest_checkpoint(str(ema_run.model_dir) + "/checkpoints")
    names = [name for name, _ in tf.train.list_variables(path) if name.startswith("ema/")]
    assert len(names) > len(ema_run.model.trainable_variables)  # averages and their count


def test_one_and_two_replicas_average_alike(runs, tmp_path):
    _, ema_run, ema_logs, *_ = runs
    two = trainer_for(tmp_path, "two", replicas=2)
    two_logs = two.train()
    for a, b in zip(ema_run.ema.averages, two.ema.averages):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=1e-5)
    for key in ema_logs:
        assert two_logs[key] == pytest.approx(ema_logs[key], abs=1e-5), key


def test_a_skipped_non_finite_step_leaves_the_averages(tmp_path):
    from faults import FaultTask

    record = RecordWeights()
    task = FaultTask(dropout=0.0, nan_at_batch=2)
    run = trainer_for(tmp_path, "nan", task=task, actions=[record],
                      guard=tputrain.NonFiniteGuard(policy="skip"))
    run.train()
    assert int(run.guard.nonfinite_steps.numpy()) == 1
    before, at, after = record.averages[1], record.averages[2], record.averages[3]
    for a, b, c in zip(before, at, after):
        np.testing.assert_array_equal(a, b)  # the skipped step (batch 2 = step 3)
        assert np.all(np.isfinite(c)) and not np.array_equal(b, c)
    expected = manual_average(record.raw, applied=[i != 2 for i in range(STEPS)])
    for average, value in zip(run.ema.averages, expected):
        np.testing.assert_allclose(np.array(average), value, rtol=0, atol=1e-6)


EMA_CONFIG = """
Trainer.task = @FaultTask()
Trainer.train_steps = 10
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.checkpoint_every = 4
Trainer.eval_steps = 1
Trainer.report_mfu = False
Trainer.ema_decay = 0.9
"""


@pytest.mark.slow
def test_a_run_killed_mid_run_resumes_its_averages_bitwise(tmp_path):
    from faults import killed_and_rerun

    config = tmp_path / "ema.gin"
    config.write_text(EMA_CONFIG)
    reference, resumed = killed_and_rerun(tmp_path, config, step=6)
    assert "ckpt-4 (step 4)" in resumed.text(), resumed.log()
    assert "EMA weights" in reference.text(), reference.log()

    def state(model_dir):
        path = tf.train.latest_checkpoint(str(tmp_path / model_dir / "checkpoints"))
        reader = tf.train.load_checkpoint(path)
        return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(path)
                if name.split("/")[0] in ("model", "optimizer", "ema")}

    expected, actual = state("reference"), state("interrupted")
    assert expected.keys() == actual.keys()
    assert any(name.startswith("ema/") for name in expected)
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


def test_the_decay_cannot_change_on_a_built_trainer(runs):
    ema_run = runs[1]
    assert ema_run.ema_decay == DECAY and ema_run.ema.decay == DECAY
    with pytest.raises(AttributeError, match="ema_decay"):
        ema_run.ema_decay = 0.5


def test_a_side_car_evaluates_and_predicts_with_the_averages(runs):
    tmp_path, ema_run, ema_logs, record, *_ = runs
    reader = tputrain.ReadOnlyTrainer(TinyTask(), str(tmp_path / "ema"), strategy_for(1),
                                      train_steps=STEPS, steps_per_loop=1, global_batch_size=32,
                                      report_mfu=False, ema_decay=DECAY)
    logs = tputrain.evaluate_checkpoints(reader, step=STEPS)[STEPS]
    for key in ema_logs:
        assert logs[key] == pytest.approx(ema_logs[key], abs=1e-6), key
    np.testing.assert_allclose(reader.predict("eval"), _averaged_outputs(ema_run, record),
                               atol=1e-5)


@pytest.mark.parametrize("before, after", [(None, DECAY), (DECAY, None)])
def test_turning_ema_on_or_off_in_a_model_dir_is_refused(tmp_path, before, after):
    trainer_for(tmp_path, "dir", ema_decay=before, train_steps=2).train()
    with pytest.raises(tputrain.CheckpointMismatchError):
        trainer_for(tmp_path, "dir", ema_decay=after, train_steps=4).train()


def test_averaged_weights_swaps_the_averages_in_and_the_raw_weights_back(runs):
    ema_run = runs[1]
    raw = [np.array(v) for v in ema_run.model.trainable_variables]
    with tputrain.averaged_weights(ema_run.ema) as averaged:
        assert averaged
        for variable, average in zip(ema_run.model.trainable_variables, ema_run.ema.averages):
            np.testing.assert_array_equal(np.array(variable), np.array(average))
    for variable, value in zip(ema_run.model.trainable_variables, raw):
        np.testing.assert_array_equal(np.array(variable), value)
    with tputrain.averaged_weights(None) as averaged:
        assert not averaged
