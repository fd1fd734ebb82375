"""The tuning spec (tputrain/tuning/spec.py) and a trial's metric file (report.py)."""

from __future__ import annotations

import json

import pytest
import tensorflow as tf

import tputrain
from tputrain.tuning.report import read_report
from tputrain.tuning.spec import SpecError, binding_lines, parse_spec
from tiny import TinyTask

SPEC = {"metric": "accuracy", "goal": "maximize", "trials": 6, "parallel": 2,
        "params": {"build_optimizer.learning_rate": {"min": 1e-4, "max": 0.1, "scale": "log"},
                   "DigitsTask.dropout": {"min": 0.0, "max": 0.5},
                   "Trainer.global_batch_size": {"type": "int", "min": 32, "max": 256},
                   "build_optimizer.name": {"values": ["adam", "sgd"]},
                   "DigitsTask.hidden_units": {"values": [[128], [256, 128]]}}}


def test_a_spec_reads_ranges_scales_and_choices():
    spec = parse_spec(SPEC)
    rate, dropout, batch, name, units = spec.params
    assert (rate.kind, rate.low, rate.high, rate.log) == ("float", 1e-4, 0.1, True)
    assert (dropout.kind, dropout.log) == ("float", False)
    assert (batch.kind, batch.low, batch.high) == ("int", 32, 256)
    assert name.values == ("adam", "sgd") and units.kind == "choice"
    assert (spec.trials, spec.parallel, spec.maximize, spec.pruner) == (6, 2, True, "median")
    assert binding_lines({"build_optimizer.name": "adam", "DigitsTask.hidden_units": [128],
                          "DigitsTask.dropout": 0.25, "Trainer.task": "@DigitsTask()"}) == [
        "build_optimizer.name = 'adam'", "DigitsTask.hidden_units = (128,)",
        "DigitsTask.dropout = 0.25", "Trainer.task = @DigitsTask()"]


@pytest.mark.parametrize("change, message", [
    ({"metric": None}, "metric: name the eval metric"),
    ({"goal": "max"}, "goal must be one of"),
    ({"trials": 0}, "trials must be a whole number >= 1"),
    ({"params": {"learning_rate": {"min": 0, "max": 1}}}, "is not a gin binding"),
    ({"params": {"a.b": {"min": 0, "max": 1, "scale": "log"}}}, "min > 0 with scale log"),
    ({"params": {"a.b": {"min": 1, "max": 0}}}, "need min < max"),
    ({"params": {"a.b": {"values": [1]}}}, "at least 2 choices"),
    ({"params": {"a.b": {"type": "int", "min": 0.5, "max": 2}}}, "whole number"),
    ({"budget": 3}, "unknown key"),
])
def test_a_bad_spec_names_the_fix(change, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({**SPEC, **change})


def test_a_trial_writes_its_metric_where_vertex_reads_it_at_each_evaluation(tmp_path,
                                                                             monkeypatch):
    """Acceptance 5: with Vertex's variables set, each evaluation's metric is in the
    cloudml-hypertune file, in its format, as soon as it is evaluated."""
    path = tmp_path / "hypertune" / "output.metrics"
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_TAG", "accuracy")
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(path))
    monkeypatch.setenv("CLOUD_ML_TRIAL_ID", "7")
    seen, evaluated = {}, {}

    class Look(tputrain.Action):  # what the file holds after each loop, before its eval
        def on_loop_end(self, context, step, logs):
            seen[step] = read_report(str(path), "accuracy")

        def on_eval_end(self, context, step, logs):
            evaluated[step] = logs["accuracy"]

    trainer = tputrain.Trainer(TinyTask(), str(tmp_path / "model"),
                               strategy=tf.distribute.OneDeviceStrategy("/cpu:0"),
                               train_steps=60, steps_per_loop=20, eval_every=20,
                               global_batch_size=16, report_mfu=False, actions=[Look()])
    trainer.train()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["global_step"] for line in lines] == ["20", "40", "60"]
    assert {line["trial"] for line in lines} == {"7"}
    assert set(lines[0]) == {"global_step", "accuracy", "timestamp", "trial"}
    assert seen == {20: {}, 40: {20: evaluated[20]}, 60: {20: evaluated[20], 40: evaluated[40]}}


def test_a_trial_resumed_at_its_end_reports_its_last_evaluation_beside_the_earlier(
        tmp_path, monkeypatch):
    """`tputrain tune` killed as a trial saved its last checkpoint, before that step's
    evaluation reached the report: the rerun has nothing to train, and the trial's
    value was the step before's. Its evaluation at the end must reach the report, and
    a new process must keep the steps the file already holds."""
    path = tmp_path / "report.metrics"
    monkeypatch.setenv("TPUTRAIN_TUNE_METRIC", "accuracy")
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(path))

    def train():
        tputrain.Trainer(TinyTask(), str(tmp_path / "model"),
                         strategy=tf.distribute.OneDeviceStrategy("/cpu:0"), train_steps=40,
                         steps_per_loop=20, eval_every=20, global_batch_size=16,
                         report_mfu=False).train()
    train()
    first = path.read_text().splitlines()
    path.write_text(first[0] + "\n")  # step 40's line never written: the kill came first
    train()
    assert sorted(read_report(str(path), "accuracy")) == [20, 40]


def test_a_tuning_metric_the_run_does_not_have_is_refused_before_training(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("TPUTRAIN_TUNE_METRIC", "accuracy_top5")
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(tmp_path / "m"))
    with pytest.raises(ValueError, match="'accuracy_top5' is not one of this run's eval "
                                         r"metrics \['loss', 'accuracy'\]"):
        tputrain.Trainer(TinyTask(), str(tmp_path / "model"),
                         strategy=tf.distribute.OneDeviceStrategy("/cpu:0"), train_steps=20)
    assert not (tmp_path / "model").exists()


def test_the_spec_parses_as_a_vertex_hyperparameter_tuning_job():
    """Acceptance 5: the same spec as the service's message; the trials run the CustomJob
    without a fixed model_dir, naming the metric; a trial's values come back as gin."""
    aiplatform_v1 = pytest.importorskip("google.cloud.aiplatform_v1")
    from tputrain.jobs import vertex
    from tputrain.tuning.vertex_job import build_tuning_job, hyperparameter_args

    custom = vertex.build_job(
        display_name="digits", image="us-docker.pkg.dev/p/r/tputrain:1", bucket="gs://my-bucket/jobs",
        hardware=vertex.tpu_hardware("v5litepod-8"),
        args=vertex.container_args(["digits.gin"], [], [], [], "gs://my-bucket/jobs/digits/model"))
    job = build_tuning_job(parse_spec(SPEC), custom)
    parsed = aiplatform_v1.HyperparameterTuningJob.from_json(json.dumps(job))
    assert (parsed.max_trial_count, parsed.parallel_trial_count) == (6, 2)
    metric, = parsed.study_spec.metrics
    assert (metric.metric_id, metric.goal.name) == ("accuracy", "MAXIMIZE")
    rate = parsed.study_spec.parameters[0]
    assert rate.parameter_id == "build_optimizer__learning_rate"
    assert rate.scale_type.name == "UNIT_LOG_SCALE"
    assert (rate.double_value_spec.min_value, rate.double_value_spec.max_value) == (1e-4, 0.1)
    assert parsed.study_spec.parameters[3].categorical_value_spec.values == ["'adam'", "'sgd'"]
    assert parsed.study_spec.median_automated_stopping_spec.use_elapsed_duration is False
    container = parsed.trial_job_spec.worker_pool_specs[0].container_spec
    assert list(container.args) == ["--gin_file=digits.gin"]
    assert [(e.name, e.value) for e in container.env] == [("TPUTRAIN_TUNE_METRIC", "accuracy")]
    assert hyperparameter_args(["tputrain", "--gin_file=digits.gin",
                                "--build_optimizer__learning_rate=0.0031",
                                "--build_optimizer__name='sgd'"]) == [
        "tputrain", "--gin_file=digits.gin", "--gin_param=build_optimizer.learning_rate = 0.0031",
        "--gin_param=build_optimizer.name = 'sgd'"]
