"""MLflowTracker against a real MLflow store: one run across a resume, no step twice,
params from the config and the plan, artifacts; a bad URI refused before any write."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import tputrain
from tputrain.fault_tolerance.preemption import Preempted
from tputrain.tracking.record import read_record
from faults import Process, child_env, cli_refusal, pausable_env
from mlflow_server import MlflowServer
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
    with _trainer(model_dir, store, 300) as trainer:
        first = trainer.train()
    run_id = read_record(str(model_dir), "mlflow")["run_id"]
    client = mlflow.tracking.MlflowClient(store)
    at_300 = client.get_metric_history(run_id, "train/loss")[-1].value
    _forget_latest(str(model_dir), 300, keep=200)
    with _trainer(model_dir, store, 400) as trainer:
        trainer.train()  # recomputes 201-300, then 301-400

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
    with pytest.raises(ValueError, match="MLflowTracker: tracking URI http://127.0.0.1:9 "
                                         "does not work"):
        _trainer(model_dir, "http://127.0.0.1:9", 100)
    assert not model_dir.exists()


@pytest.mark.slow
def test_a_bad_tracking_uri_is_one_line_and_exit_2_before_anything_is_written(tmp_path):
    stderr = cli_refusal(tmp_path, "include 'digits.gin'\n"
                         "Trainer.actions = [@MLflowTracker()]\n"
                         "MLflowTracker.tracking_uri = 'http://127.0.0.1:9'\n")
    assert "MLflowTracker: tracking URI http://127.0.0.1:9 does not work" in stderr


# ------------------------------------------------------------ the CLI and a real server

DIGITS = ["--gin_import=faults", "--gin_file=digits.gin", "--gin_param=Trainer.train_steps=600",
          "--gin_param=Trainer.eval_every=200", "--gin_param=Trainer.checkpoint_every=200",
          "--gin_param=MLflowTracker.experiment='e2e'"]


def _cli(tmp_path, uri, *args, actions="@Export(), @MLflowTracker()"):
    return [sys.executable, "-m", "tputrain.run", *DIGITS, f"--model_dir={tmp_path / 'model'}",
            f"--gin_param=MLflowTracker.tracking_uri='{uri}'",
            f"--gin_param=Trainer.actions=[{actions}]", *args]


def _env(tmp_path):
    return dict(child_env(), TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"))


def _done(log: str) -> str:
    return re.findall(r"done at step 600: (.*)", log)[-1]


@pytest.fixture
def server(tmp_path):
    server = MlflowServer(tmp_path)
    server.wait_ready()
    yield server
    server.kill()


@pytest.mark.slow
def test_kill_9_resume_and_tputrain_eval_are_one_run(tmp_path, server):
    """Acceptance 1: killed at step 300 (checkpoint 200), resumed, then `tputrain eval`:
    one MLflow run, every step once, params, artifacts."""
    killed = Process(_cli(tmp_path, server.uri, "--gin_param=PauseAtStep.step=300",
                          actions="@Export(), @MLflowTracker(), @PauseAtStep()"),
                     _env(tmp_path))
    killed.wait_for(r"tputrain-test: paused at step 300", timeout=900)
    assert killed.kill(signal.SIGKILL) == -signal.SIGKILL
    resumed = subprocess.run(_cli(tmp_path, server.uri), env=_env(tmp_path), text=True,
                             capture_output=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restored" in resumed.stderr and "(step 200)" in resumed.stderr
    evaluated = subprocess.run([sys.executable, "-m", "tputrain.cli", "eval",
                                f"--model_dir={tmp_path / 'model'}"], env=_env(tmp_path),
                               text=True, capture_output=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]

    client = mlflow.tracking.MlflowClient(server.uri)
    runs = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert [r.info.run_id for r in runs] == [read_record(str(tmp_path / "model"), "mlflow")["run_id"]]
    run_id = runs[0].info.run_id
    assert _steps(client, run_id, "train/loss") == [100, 200, 300, 400, 500, 600]
    assert _steps(client, run_id, "eval/accuracy") == [200, 400, 600]
    run = client.get_run(run_id)
    assert run.data.params["DigitsTask.dropout"] == "0.1"
    assert run.data.params["plan/global_batch_size"] == "64"
    assert run.data.tags["tputrain.serving.export"].endswith("export/600")
    assert {"operative_config.gin", "goodput.txt"} <= {
        a.path for a in client.list_artifacts(run_id)}


def _until_exists(path, timeout: float = 300) -> None:
    """Waits for `path` (a file the code writes) to exist."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path} within {timeout} s"
        time.sleep(0.2)


@pytest.mark.slow
def test_kill_9_while_the_server_is_down_loses_no_step_the_checkpoint_kept(tmp_path, server):
    """The server dies after the run exists; training is killed with kill -9 at step 300,
    its metrics of steps 100 and 200 still queued; with the server back, the resume
    (checkpoint 200) sends them from the spool, and the run holds every step once."""
    killed = Process(_cli(tmp_path, server.uri, "--gin_param=first/PauseAtStep.step=100",
                          "--gin_param=second/PauseAtStep.step=300",
                          actions="@Export(), @MLflowTracker(), @first/PauseAtStep(), "
                                  "@second/PauseAtStep()"),
                     pausable_env(_env(tmp_path)), stdin=True)
    killed.wait_for(r"tputrain-test: paused at step 100", timeout=900)
    _until_exists(tmp_path / "model" / "tracking" / "mlflow.json")  # the run exists
    server.kill()
    killed.send("go")
    killed.wait_for(r"tputrain-test: paused at step 300", timeout=900)
    assert killed.kill(signal.SIGKILL) == -signal.SIGKILL
    again = MlflowServer(tmp_path)  # the same store, back
    try:
        again.wait_ready()
        resumed = subprocess.run(_cli(tmp_path, again.uri), env=_env(tmp_path), text=True,
                                 capture_output=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "restored" in resumed.stderr and "(step 200)" in resumed.stderr
        client = mlflow.tracking.MlflowClient(again.uri)
        run_id = read_record(str(tmp_path / "model"), "mlflow")["run_id"]
        assert _steps(client, run_id, "train/loss") == [100, 200, 300, 400, 500, 600]
        assert _steps(client, run_id, "eval/accuracy") == [200, 400, 600]
    finally:
        again.kill()


@pytest.mark.slow
def test_a_tracking_server_that_dies_mid_run_changes_nothing(tmp_path, server):
    """Acceptance 3: the server killed at step 300; training ends as without a tracker,
    with one warning line."""
    paused = Process(_cli(tmp_path, server.uri, "--gin_param=MLflowTracker.flush_seconds=2",
                          "--gin_param=PauseAtStep.step=300",
                          actions="@Export(), @MLflowTracker(), @PauseAtStep()"),
                     pausable_env(_env(tmp_path)), stdin=True)
    paused.wait_for(r"tputrain-test: paused at step 300", timeout=900)
    server.kill()
    paused.send("go")
    assert paused.finish(timeout=600) == 0, paused.log()
    warnings = [line for line in paused.lines if line.startswith("W") and "MLflow" in line]
    assert len(warnings) == 1, paused.text()[-3000:]
    assert "MLflowTracker: the tracker failed" in paused.text()
    alone = subprocess.run([sys.executable, "-m", "tputrain.run", *DIGITS[:5],
                            f"--model_dir={tmp_path / 'alone'}"], env=_env(tmp_path),
                           text=True, capture_output=True, timeout=600)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert _done(paused.text()) == _done(alone.stderr)


@pytest.mark.slow
def test_on_two_workers_only_the_chief_logs(tmp_path, store, monkeypatch):
    """Acceptance 1: `tputrain launch --workers=2` with the tracker is one MLflow run."""
    from processes import launched
    config = tmp_path / "two.gin"
    config.write_text(f"""
Trainer.task = @FaultTask()
FaultTask.dropout = 0.0
Trainer.train_steps = 4
Trainer.steps_per_loop = 2
Trainer.eval_every = 2
Trainer.checkpoint_every = 4
Trainer.global_batch_size = 16
Trainer.report_mfu = False
Trainer.actions = [@MLflowTracker()]
MLflowTracker.tracking_uri = '{store}'
MLflowTracker.experiment = 'two'
""")
    launched(config, tmp_path / "model")
    client = mlflow.tracking.MlflowClient(store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [read_record(str(tmp_path / "model"), "mlflow")["run_id"]]
    assert _steps(client, runs[0].info.run_id, "train/loss") == [2, 4]
    assert runs[0].data.params["plan/hosts"] == "2"


# ------------------------------------------------------------ a run that ends early

class _RaiseAtStep(tputrain.Action):
    """Training fails after the loop to `step` (its figures are queued to the tracker)."""

    def __init__(self, step):
        self.step = step

    def on_loop_end(self, context, step, logs):
        if step >= self.step:
            raise RuntimeError(f"tputrain-test: failed at step {step}")


class _SigtermAtStep(_RaiseAtStep):
    """Sends this process SIGTERM after the loop to `step`: the next loop is preempted."""

    def on_loop_end(self, context, step, logs):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _ending(model_dir, store, action):
    return tputrain.Trainer(TinyTask(), str(model_dir), strategy=tf.distribute.OneDeviceStrategy(
        "/cpu:0"), train_steps=6, steps_per_loop=2, eval_every=6, checkpoint_every=6,
        global_batch_size=16, report_mfu=False, jit_compile=False,
        actions=[tputrain.MLflowTracker(tracking_uri=store, experiment="tests"), action])


def test_a_run_that_raises_sends_what_it_logged_and_ends_the_mlflow_run_failed(tmp_path, store):
    """What was queued when training raised is sent before the error leaves train() (a
    CLI process ends right after, with the sender's thread), and the run says FAILED."""
    model_dir = tmp_path / "run"
    with _ending(model_dir, store, _RaiseAtStep(4)) as trainer:
        with pytest.raises(RuntimeError, match="failed at step 4"):
            trainer.train()
    run_id = read_record(str(model_dir), "mlflow")["run_id"]
    client = mlflow.tracking.MlflowClient(store)
    assert _steps(client, run_id, "train/loss") == [2, 4]
    assert client.get_run(run_id).info.status == "FAILED"


def test_a_preempted_run_sends_what_it_logged_and_ends_the_mlflow_run_killed(tmp_path, store):
    """SIGTERM: the preemption's checkpoint, then what was queued is sent and the run says
    KILLED; the resume continues it to FINISHED."""
    model_dir = tmp_path / "run"
    with _ending(model_dir, store, _SigtermAtStep(2)) as trainer:
        with pytest.raises(Preempted) as preempted:
            trainer.train()
    step = preempted.value.step
    run_id = read_record(str(model_dir), "mlflow")["run_id"]
    client = mlflow.tracking.MlflowClient(store)
    assert _steps(client, run_id, "train/loss") == [2, step]
    assert client.get_run(run_id).info.status == "KILLED"
    with _ending(model_dir, store, tputrain.Action()) as trainer:
        trainer.train()
    steps = _steps(client, run_id, "train/loss")
    assert steps[:2] == [2, step] and steps[-1] == 6 and steps == sorted(set(steps))
    assert client.get_run(run_id).info.status == "FINISHED"


# ------------------------------------------------------------ the tracker's own seams

def _tracker(store):
    return tputrain.MLflowTracker(tracking_uri=store, experiment="tests")


def _sent(model_dir, store, step, values, writer=True, restored_step=None, tracker=None):
    """A tracker started on `model_dir` as training (`writer`) or `tputrain eval` is; sends
    `values` at `step` (as an evaluation's when they are "eval/..."), then closes."""
    tracker = tracker or _tracker(store)
    tracker.start(str(model_dir), writer=writer, restored_step=restored_step)
    evals = {k[len("eval/"):]: v for k, v in values.items() if k.startswith("eval/")}
    if evals:
        tracker.on_eval_end(None, step, evals)
    others = {k: v for k, v in values.items() if not k.startswith("eval/")}
    if others:
        tracker.put_metrics(step, others)
    tracker.close()
    return tracker


def test_a_metric_whose_name_mlflow_changes_is_sent_once_across_a_resume(tmp_path, store):
    """`top@3` is logged as `top_3`: a resume's spool replay found no `top@3` in the run
    and sent every step again (and said the run did not hold them)."""
    model_dir = tmp_path / "run"
    _sent(model_dir, store, 100, {"train/top@3": 0.5})
    _sent(model_dir, store, 100, {}, restored_step=100)  # the resume replays the spool
    _sent(model_dir, store, 100, {"train/top@3": 0.5})  # and computes step 100 again
    run_id = read_record(str(model_dir), "mlflow")["run_id"]
    assert _steps(mlflow.tracking.MlflowClient(store), run_id, "train/top_3") == [100]


@pytest.mark.parametrize("first", ["training", "tputrain eval"])
def test_an_evaluation_both_training_and_tputrain_eval_made_is_sent_once(tmp_path, store,
                                                                          first):
    """The side-car read the run's steps once, when it opened it: the evaluations the
    training logged after that were sent again (and the side-car's, by the training)."""
    model_dir = tmp_path / "run"
    _sent(model_dir, store, 100, {"train/loss": 1.0})
    training, side_car = _tracker(store), _tracker(store)
    training.start(str(model_dir), writer=True, restored_step=100)
    side_car.start(str(model_dir), writer=False)
    assert training.sender.flush(30) and side_car.sender.flush(30)  # both runs opened
    order = [training, side_car] if first == "training" else [side_car, training]
    for tracker in order:
        tracker.on_eval_end(None, 200, {"loss": 0.5})
        tracker.sender.flush(30)
    for tracker in order:
        tracker.close()
    run_id = read_record(str(model_dir), "mlflow")["run_id"]
    assert _steps(mlflow.tracking.MlflowClient(store), run_id, "eval/loss") == [200]


def test_tputrain_eval_leaves_a_finished_run_finished(tmp_path, store):
    """`tputrain eval` set the run RUNNING on opening it and never ended it: a finished
    run stayed RUNNING for ever."""
    model_dir = tmp_path / "run"
    with _trainer(model_dir, store, 100) as trainer:
        trainer.train()
    _sent(model_dir, store, 100, {"eval/accuracy": 0.5}, writer=False)
    run_id = read_record(str(model_dir), "mlflow")["run_id"]
    assert mlflow.tracking.MlflowClient(store).get_run(run_id).info.status == "FINISHED"


def test_one_tracker_given_to_two_trainers_keeps_each_runs_spool_and_tags(tmp_path, store):
    """A sweep passing one tracker to Trainers on two model_dirs: the second run's metrics
    went into the first's spool (no kill -9 protection) and it had no model_dir tag."""
    tracker = _tracker(store)
    for name in ("a", "b"):
        with tputrain.Trainer(TinyTask(), str(tmp_path / name), strategy=tf.distribute.
                              OneDeviceStrategy("/cpu:0"), train_steps=4, steps_per_loop=2,
                              global_batch_size=16, report_mfu=False, jit_compile=False,
                              actions=[tracker]) as trainer:
            trainer.train()
    client = mlflow.tracking.MlflowClient(store)
    for name in ("a", "b"):
        model_dir = str(tmp_path / name)
        spool = [json.loads(line) for line in
                 open(os.path.join(model_dir, "tracking", "mlflow.spool.jsonl"))]
        assert [job["step"] for job in spool if "train/loss" in job["values"]] == [2, 4]
        run = client.get_run(read_record(model_dir, "mlflow")["run_id"])
        assert run.data.tags["tputrain.model_dir"] == model_dir
        assert _steps(client, run.info.run_id, "train/loss") == [2, 4]
