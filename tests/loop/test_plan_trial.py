"""tputrain/loop/plan_trial.py: jit_compile="auto" times the plausible plans and keeps
the fastest, on the run's state written back (the weights are a run's without it),
records the choice in model_dir, and a resume runs the recorded plan.

Which plan wins is decided by an injected clock (`plan_trial.clock`), never by timing.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import logging

import tputrain
from tiny import TinyTask, strategy_for, weights
from tputrain.checkpointing.run_directory import ModelDirError, RunDirectory
from tputrain.loop import plan_trial
from tputrain.loop.xla_plan import XlaPlan

# TinyTask on one CPU replica: "auto"'s rules compile the whole step, so the trial
# times the rules' whole step, then none (the rules' plan first).
TRIAL_STEPS = 2 * (plan_trial.WARMUP_STEPS + plan_trial.TIMED_STEPS)
RUN = plan_trial.RUN_SHARE * TRIAL_STEPS  # the shortest run that has a trial


def _trainer(model_dir, train_steps: int, task=None, **options) -> tputrain.Trainer:
    return tputrain.Trainer(task or TinyTask(), str(model_dir), strategy=strategy_for(1),
                            train_steps=train_steps, steps_per_loop=20, global_batch_size=16,
                            checkpoint_every=10**6, eval_steps=1, report_mfu=False,
                            steps_per_program=1, **options)


@pytest.fixture(autouse=True)
def _own_machine_record(tmp_path, monkeypatch):
    """Each test its own cache folder: the machine's record of a trial's choice
    (`plan_trial.MachineRecord`), which a clock set here decides, reaches no other test."""
    monkeypatch.setenv("TPUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    # Compiles read as taking no time unless a test sets them: TIME_SHARE never cuts
    # a trial short by the machine's speed.
    monkeypatch.setattr(plan_trial, "compile_clock", lambda: 0.0)


def _readings(*values):
    """A clock that reads `values` in turn (the trial reads it before and after each
    plan's timed steps)."""
    values = iter(values)
    return lambda: next(values)


def _clock_unread():
    raise AssertionError("the plan trial ran, but the plan was recorded")


def test_the_trial_keeps_the_fastest_plan_records_it_and_a_resume_runs_it(
        tmp_path, monkeypatch):
    """None is fastest by the clock (the rules would compile the whole step): the run
    trains without XLA, logs the table, records the plan and its trial's time is in
    goodput's compile bucket; resumed with a clock that would pick the whole step, it
    reads the record instead; the weights are bitwise those of jit_compile=False
    trained straight through (the trial's XLA steps left nothing behind)."""
    lines = []
    monkeypatch.setattr(logging, "info", lambda fmt, *args: lines.append(fmt % args))
    monkeypatch.setattr(plan_trial, "clock", _readings(0.0, 10.0, 10.0, 11.0))
    first = _trainer(tmp_path / "trial", RUN, plan_trial=True)
    first.train()
    assert "none" in first.plan.xla and "plan trial" in first.plan.xla
    assert not first.plan.xla_plan.whole_step
    table = [line for line in lines if line.startswith("tputrain: plan trial: ")]
    assert len(table) == 1 and "whole step: " in table[0] and "-> none" in table[0], lines
    record = json.loads(open(RunDirectory(str(tmp_path / "trial")).plan_record).read())
    (entry,) = record["plans"].values()
    assert entry["plan"]["whole_step"] is False and entry["table"] in table[0]
    goodput = json.loads(open(RunDirectory(str(tmp_path / "trial")).goodput_record(1)).read())
    assert goodput["plan_trial"] > 0
    assert goodput["seconds"]["compile"] >= goodput["plan_trial"]

    monkeypatch.setattr(plan_trial, "clock", _clock_unread)
    resumed = _trainer(tmp_path / "trial", RUN + 20, plan_trial=True)
    resumed.train()
    assert "recorded in" in resumed.plan.xla and not resumed.plan.xla_plan.whole_step
    straight = _trainer(tmp_path / "straight", RUN + 20, jit_compile=False)
    straight.train()
    assert all(np.array_equal(a, b) for a, b in zip(weights(straight), weights(resumed)))


@pytest.mark.parametrize("options", [dict(jit_compile=False), dict(jit_compile=True),
                                     dict()])
def test_no_trial_when_pinned_or_not_asked(tmp_path, monkeypatch, options):
    """jit_compile=True/False pin the plan; without plan_trial=True nothing is tried
    nor recorded."""
    monkeypatch.setattr(plan_trial, "clock", _clock_unread)
    trainer = _trainer(tmp_path, 20, **({"plan_trial": "jit_compile" in options} | options))
    builder = trainer._steps  # pylint: disable=protected-access
    assert plan_trial.why_not(builder, 1, RUN) is not None
    assert plan_trial.chosen_plan(plan_trial.TrialRun(builder, None, None, []), None,
                                  str(tmp_path), 1, RUN) is None
    assert not (tmp_path / RunDirectory.PLAN_RECORD).exists()


@pytest.mark.slow  # the default tier's trial test covers the record; this, the short run
def test_a_run_shorter_than_the_trial_records_the_rules_plan(tmp_path, monkeypatch):
    """No trial for a run under RUN_SHARE x the trial's steps: the rules' plan (the whole
    step here) is recorded, so a longer resume keeps it rather than trying others."""
    monkeypatch.setattr(plan_trial, "clock", _clock_unread)
    trainer = _trainer(tmp_path, 20, plan_trial=True)
    trainer.train()
    assert trainer.plan.xla_plan.whole_step
    resumed = _trainer(tmp_path, RUN + 20, plan_trial=True)
    assert plan_trial.PlanRecord(str(tmp_path)).read(plan_trial.plan_key(
        resumed._steps, resumed.inputs.train_dataset.element_spec)).whole_step  # pylint: disable=protected-access


def test_the_candidates_are_each_plausible_plan_once_the_rules_first(tmp_path):
    """On one replica in float32 "auto" and jit_compile=True both compile the whole
    step: two candidates, not three."""
    trainer = _trainer(tmp_path, 20, plan_trial=True)
    spec = trainer.inputs.train_dataset.element_spec
    plans = plan_trial.candidates(trainer._steps, spec)  # pylint: disable=protected-access
    assert [plan_trial.describe(p) for p in plans] == ["whole step", "none (fused batch norms)"]


def _trial_table(lines):
    (line,) = [line for line in lines if line.startswith("tputrain: plan trial: ")]
    return line


def test_a_trial_that_would_take_over_its_share_of_the_run_keeps_the_rules_plan(
        tmp_path, monkeypatch):
    """The rules' whole step, timed first, compiles in 100 s (`compile_clock`) and runs
    at 1 s a step: a run of RUN steps is estimated at RUN s, and one more compile
    would take the trial over TIME_SHARE of it. So none is not tried (neither built
    nor timed: each clock reads only the whole step's), the table says why, and the
    run trains with the whole step, recorded in model_dir (a resume keeps it) but not
    for the machine: a cut-short trial measured one plan, and a longer run of the
    same model on this machine must still try them all."""
    lines = []
    monkeypatch.setattr(logging, "info", lambda fmt, *args: lines.append(fmt % args))
    monkeypatch.setattr(plan_trial, "clock", _readings(0.0, 10.0))  # 10 timed steps
    monkeypatch.setattr(plan_trial, "compile_clock", _readings(0.0, 100.0))
    trainer = _trainer(tmp_path / "run", RUN)
    trainer.train()
    table = _trial_table(lines)
    assert table == ("tputrain: plan trial: whole step: 1000.000 ms/step (compile 100.0s) | "
                     "none (fused batch norms): not tried: over 10% of the run -> whole step "
                     "(CPU time a step)"), lines
    assert trainer.plan.xla_plan.whole_step and "fastest in the plan trial" in trainer.plan.xla
    builder, spec = trainer._steps, trainer.inputs.train_dataset.element_spec  # pylint: disable=protected-access
    key = plan_trial.plan_key(builder, spec)
    assert plan_trial.PlanRecord(str(tmp_path / "run")).read(key).whole_step
    assert plan_trial.MachineRecord(key).read() is None


@pytest.mark.slow  # the default tier's trial tests time both plans too (compiles read 0 s)
def test_a_trial_whose_run_leaves_room_times_every_plan_the_rules_first(
        tmp_path, monkeypatch):
    """Compiles of 1 s against a run of RUN steps at 1 s a step: the trial's cost stays
    within TIME_SHARE of the run, so both plans are timed, the rules' first, and the
    fastest (the whole step) is kept."""
    lines = []
    monkeypatch.setattr(logging, "info", lambda fmt, *args: lines.append(fmt % args))
    monkeypatch.setattr(plan_trial, "clock", _readings(0.0, 10.0, 10.0, 110.0))
    monkeypatch.setattr(plan_trial, "compile_clock", _readings(0.0, 1.0, 1.0, 2.0))
    trainer = _trainer(tmp_path / "run", RUN)
    trainer.train()
    assert _trial_table(lines) == (
        "tputrain: plan trial: whole step: 1000.000 ms/step (compile 1.0s) | "
        "none (fused batch norms): 10000.000 ms/step (compile 1.0s) -> whole step "
        "(CPU time a step)"), lines
    assert trainer.plan.xla_plan.whole_step and "fastest in the plan trial" in trainer.plan.xla


def test_by_default_a_long_cpu_run_tries_the_plans_and_a_run_in_another_model_dir_reuses_it(
        tmp_path, monkeypatch):
    """plan_trial="auto" (the default) runs the trial on a CPU run long enough for it;
    its choice is recorded for the machine too, so another run of the same model
    (another model_dir: a test's reference run beside its resumed one) trains with the
    same plan, whatever its own timing would say, and records it in its model_dir."""
    monkeypatch.setattr(plan_trial, "clock", _readings(0.0, 10.0, 10.0, 11.0))
    first = _trainer(tmp_path / "first", RUN)
    assert first.options.plan_trial == "auto"
    first.train()
    assert "fastest in the plan trial" in first.plan.xla and not first.plan.xla_plan.whole_step

    monkeypatch.setattr(plan_trial, "clock", _clock_unread)  # the same model, another model_dir
    builder, spec = first._steps, first.inputs.train_dataset.element_spec  # pylint: disable=protected-access
    choice = plan_trial.chosen_plan(plan_trial.TrialRun(builder, None, None, []), spec,
                                    str(tmp_path / "second"), 1, RUN)
    assert "recorded on this machine" in choice.plan.why and not choice.plan.whole_step
    assert not plan_trial.PlanRecord(str(tmp_path / "second")).read(
        plan_trial.plan_key(builder, spec)).whole_step


def test_by_default_a_short_run_or_its_resume_has_no_trial_and_writes_no_record(
        tmp_path, monkeypatch):
    """A run shorter than the trial keeps the rules' plan and writes nothing a run with
    the trial off does not; resumed for long, it keeps the plan its steps so far ran
    (the rules'): a model_dir trains with one plan throughout. The short run's log
    does not mention the trial either."""
    lines = []
    monkeypatch.setattr(logging, "info", lambda fmt, *args: lines.append(fmt % args))
    monkeypatch.setattr(plan_trial, "clock", _clock_unread)
    short = _trainer(tmp_path / "run", 20)
    short.train()
    assert not [line for line in lines if "plan" in line], lines
    assert short.plan.xla_plan.whole_step  # the rules' plan
    assert not (tmp_path / "run" / RunDirectory.PLAN_RECORD).exists()
    builder, spec = short._steps, short.inputs.train_dataset.element_spec  # pylint: disable=protected-access
    assert plan_trial.chosen_plan(  # resumed at step 20 with RUN steps left
        plan_trial.TrialRun(builder, None, None, []), spec, str(tmp_path / "run"), 1, RUN,
        step=20) is None
    assert not (tmp_path / "run" / RunDirectory.PLAN_RECORD).exists()
    assert not (tmp_path / "cache").exists()


def test_the_machine_records_the_first_plan_and_keeps_it_against_a_later_trial():
    """Two trials of one key (two model_dirs, one machine): the first record stands and
    the second trial gets it back, with no temp file left beside it."""
    first = XlaPlan(whole_step=True, gradients_only=False, why="first trial")
    second = XlaPlan(whole_step=False, gradients_only=False, why="second trial")
    record = plan_trial.MachineRecord("model key")
    assert record.add(first, "first table") == (first, "first table")
    assert plan_trial.MachineRecord("model key").add(second, "second table") == (first, "first table")
    assert os.listdir(os.path.dirname(record.path)) == [os.path.basename(record.path)]


class ShapeBugTask(TinyTask):
    """compute_loss adds a tensor of the wrong shape: the user's error, XLA or not."""

    def compute_loss(self, labels, outputs):
        return outputs + tf.zeros([3, 5])


def test_a_user_error_in_the_step_is_raised_by_the_trial_not_timed_as_refused(
        tmp_path, caplog):
    """A run long enough for the trial, whose step has the user's shape bug: the trial
    raises that ValueError as it is; no line says XLA refused a plan, no table is
    logged and no plan is recorded (in model_dir or for the machine)."""
    trainer = _trainer(tmp_path / "run", RUN, task=ShapeBugTask())
    with caplog.at_level("INFO"), pytest.raises(ValueError, match="Dimensions must be equal"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records]
    assert not [line for line in said if "compile with XLA" in line or "refused by XLA" in line
                or "plan trial:" in line], said
    assert not os.path.exists(RunDirectory(str(tmp_path / "run")).plan_record)
    assert not os.path.exists(tmp_path / "cache" / "plans")


class ReshuffledTask(TinyTask):
    """docs/tasks.md's pattern: the train split shuffled with a seed, again each pass
    and each iterator (tf.data's default `reshuffle_each_iteration`)."""

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": self.x}, self.y))
        if split == "train":
            dataset = dataset.shuffle(len(self.y), seed=0).repeat()
        return dataset.batch(batch, drop_remainder=True)


@pytest.mark.parametrize("replicas, input_mode", [(1, "host"), (2, "distributed")])
def test_the_trial_reads_none_of_the_users_data(tmp_path, monkeypatch, replicas, input_mode):
    """Each iterator of a reshuffling dataset draws the next shuffle: a trial that
    opened its own on the run's data made the run read other batches. Timed on
    stand-in batches (host mode's fetch groups, or a distributed iterator's), the
    trial (the rules' plan wins) leaves the run's weights bitwise those of the same
    plan with the trial off. (Two replicas: three plans, a run long enough for them.)"""
    monkeypatch.setattr(plan_trial, "clock", _readings(0.0, 1.0, 1.0, 11.0, 11.0, 21.0))
    steps = RUN // 2 * (replicas + 1)  # long enough for each plan's trial (2 or 3 plans)

    def run(name, trial):
        trainer = tputrain.Trainer(
            ReshuffledTask(), str(tmp_path / name), strategy=strategy_for(replicas),
            train_steps=steps, steps_per_loop=20, global_batch_size=16, eval_steps=1,
            checkpoint_every=10**6, report_mfu=False, input_mode=input_mode, plan_trial=trial)
        trainer.train()
        return trainer

    tried = run("tried", True)
    assert "fastest in the plan trial" in tried.plan.xla
    straight = run("straight", False)
    assert plan_trial.describe(straight.plan.xla_plan) == plan_trial.describe(tried.plan.xla_plan)
    assert all(np.array_equal(a, b) for a, b in zip(weights(straight), weights(tried)))


def test_a_keras_models_trial_reads_none_of_its_dataset(tmp_path, monkeypatch):
    """`tputrain.fit` with the user's own dataset object, shuffled with a seed: the
    trial opens no iterator of it (each would draw the next shuffle), so the weights
    are those of the trial off."""
    monkeypatch.setattr(plan_trial, "clock", _readings(0.0, 1.0, 1.0, 11.0))
    rng = np.random.RandomState(0)
    x, y = rng.randn(64, 8).astype(np.float32), rng.randint(0, 2, 64)

    def run(name, trial):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=0).repeat().batch(16)
        tputrain.fit(model, data, (x, y), model_dir=str(tmp_path / name), steps=RUN,
                     strategy=strategy_for(1), report_mfu=False, plan_trial=trial,
                     steps_per_program=1)
        return model.get_weights()

    tried, straight = run("tried", True), run("straight", False)
    assert all(np.array_equal(a, b) for a, b in zip(straight, tried))


@pytest.mark.parametrize("damage", [
    lambda entry: entry["plan"].pop("fuse_batch_norm"),  # an older or edited record
    lambda entry: entry.update(plan="whole step"),
    lambda entry: entry["plan"].update(whole_step="no"),
    lambda entry: entry.pop("plan"),
], ids=["field missing", "plan a string", "field not a bool", "no plan"])
def test_an_edited_plan_record_is_ignored_with_a_warning_naming_it(tmp_path, monkeypatch,
                                                                    caplog, damage):
    """model_dir/plan.json edited by hand (or written by another version): its entry is
    read as no record, with a warning naming the file, as a truncated one is; a field
    of the wrong type is not taken for a plan the rules never make."""
    trainer = _trainer(tmp_path, 20, plan_trial=True)
    builder, spec = trainer._steps, trainer.inputs.train_dataset.element_spec  # pylint: disable=protected-access
    key, record = plan_trial.plan_key(builder, spec), plan_trial.PlanRecord(str(tmp_path))
    record.write(key, XlaPlan(whole_step=True, gradients_only=False, why="trial"), "table")
    written = json.loads(open(record.path).read())
    damage(written["plans"][key])
    with open(record.path, "w") as f:
        f.write(json.dumps(written))
    with caplog.at_level("WARNING"):
        assert record.read(key) is None
    assert [r for r in caplog.records if record.path in r.getMessage()
            and "ignoring" in r.getMessage()], caplog.records


def test_a_damaged_plan_record_stops_a_resume_naming_the_file_and_the_fix(tmp_path,
                                                                          monkeypatch):
    """A truncated plan.json was read as no record: the resume switched to the rules'
    plan after steps trained with the recorded one, no longer bitwise, with only
    "ignoring the plan record" logged. A run with checkpoints now stops, naming the file
    and the fix, as a damaged best.json does; one with none yet takes it as none."""
    monkeypatch.setattr(plan_trial, "clock", _clock_unread)
    _trainer(tmp_path, 20, plan_trial=True).train()  # records the rules' plan (short run)
    path = RunDirectory(str(tmp_path)).plan_record
    with open(path, "r+") as f:
        f.truncate(len(f.read()) // 2)
    resumed = _trainer(tmp_path, RUN + 20, plan_trial=True)
    with pytest.raises(ModelDirError, match=f"{path} is damaged or unreadable .*: put it back"
                       ".*, or delete it to choose the plan again .*not bitwise"):
        resumed.train()
    assert resumed.current_step == 20  # no step trained
    builder = resumed._steps  # pylint: disable=protected-access
    key = plan_trial.plan_key(builder, resumed.inputs.train_dataset.element_spec)
    assert plan_trial.PlanRecord(str(tmp_path)).read(key) is None  # no checkpoint yet: none


class GeneratorNoise(keras.layers.Layer):
    """Noise from a `tf.random.Generator` the layer holds: its state is a tf.Variable
    outside the model's Keras variables (and its seed generators)."""

    def build(self, shape):
        self.generator = tf.random.Generator.from_seed(11)

    def call(self, inputs, training=None):
        return inputs + 0.1 * self.generator.normal(tf.shape(inputs)) if training else inputs


class GeneratorNoiseTask(TinyTask):
    def build_model(self):
        inputs = keras.Input((8,), name="x")
        hidden = GeneratorNoise()(keras.layers.Dense(16, activation="relu")(inputs))
        return keras.Model({"x": inputs}, keras.layers.Dense(2)(hidden))


def test_the_trial_writes_back_a_random_generator_the_model_holds(tmp_path, monkeypatch):
    """The trial's steps drew from the layer's generator: its state (in the model's
    checkpoint, not among its Keras variables) is written back too, so the run draws
    what it draws with the trial off."""
    monkeypatch.setattr(plan_trial, "clock", _readings(0.0, 1.0, 1.0, 11.0))
    tried = _trainer(tmp_path / "tried", RUN, task=GeneratorNoiseTask(), plan_trial=True)
    tried.train()
    assert "fastest in the plan trial" in tried.plan.xla
    straight = _trainer(tmp_path / "straight", RUN, task=GeneratorNoiseTask(), plan_trial=False)
    straight.train()
    assert all(np.array_equal(a, b) for a, b in zip(weights(straight), weights(tried)))
