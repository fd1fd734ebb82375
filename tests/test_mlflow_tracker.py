"""MLflowTracker against a real MLflow store: one run across a resume, no step twice,
params from the config and the plan, artifacts; a bad URI refused before any write."""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

import tputrain
from tputrain.tracking.record import read_record
from tiny import TinyTask

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra: pip install 'tputrain[mlflow]'")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A local file store (MLflow 3 refuses it unless allowed: it is the quickest)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file://{tmp_path / 'mlruns'}"


def _trainer(model_dir, store, train_steps):
    return tputrain.Trainer(TinyTask(), str(model_dir), strategy=tf.distribute.OneDeviceStrategy(
        "/cpu:0"), train_steps=train_steps, steps_per_loop=100, eval_every=200,
        checkpoint_every=100, global_batch_size=16, report_mfu=False,
        actions=[tputrain.MLflowTracker(tracking_uri=store, experiment="tests")])


def _forget_latest(model_dir, step: int, keep: int) -> None:
    """model_dir as a kill -9 after the loop to `step` (logged) and before its save."""
    folder = os.path.join(model_dir, "checkpoints")
    for path in tf.io.gfile.glob(os.path.join(folder, f"ckpt-{step}.*")):
        tf.io.gfile.remove(path)
    with open(os.path.join(folder, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "ckpt-{keep}"\n'
                f'all_model_checkpoint_paths: "ckpt-{keep}"\n')


def _steps(client, run_id, key):
    return [m.step for m in client.get_metric_history(run_id, key)]


def test_one_run_across_a_resume_with_no_step_twice(tmp_path, store):
    model_dir = tmp_path / "run"
    first = _trainer(model_dir, store, 300).train()
    run_id = read_record(str(model_dir), "mlflow")["run_id"]
    client = mlflow.tracking.MlflowClient(store)
    at_300 = client.get_metric_history(run_id, "train/loss")[-1].value
    _forget_latest(str(model_dir), 300, keep=200)
    _trainer(model_dir, store, 400).train()  # recomputes 201-300, then 301-400

    assert read_record(str(model_dir), "mlflow")["run_id"] == run_id
    assert [r.info.run_id for r in client.search_runs(
        [client.get_experiment_by_name("tests").experiment_id])] == [run_id]
    assert _steps(client, run_id, "train/loss") == [100, 200, 300, 400]
    assert client.get_metric_history(run_id, "train/loss")[2].value == at_300  # the first's
    assert _steps(client, run_id, "eval/loss") == [200, 300, 400]
    assert client.get_metric_history(run_id, "eval/accuracy")[1].value == first["accuracy"]
    for key in ("train/examples_per_second", "train/input/stall_fraction",
                "train/learning_rate", "goodput/steps"):
        assert key in client.get_run(run_id).data.metrics
    run = client.get_run(run_id)
    assert run.data.params["Trainer.train_steps"] == "300"  # the first run's value
    assert run.data.tags["tputrain.changed/Trainer.train_steps"] == "400"
    assert run.data.params["plan/replicas"] == "1"
    assert run.data.params["plan/strategy"] == "OneDeviceStrategy"
    assert run.data.params["plan/global_batch_size"] == "16"
    assert run.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"operative_config.gin", "goodput.txt"} <= artifacts


def test_a_bad_tracking_uri_is_refused_before_model_dir_is_written(tmp_path):
    model_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="MLflowTracker: tracking URI http://127.0.0.1:9"):
        _trainer(model_dir, "http://127.0.0.1:9", 100)
    assert not model_dir.exists()
