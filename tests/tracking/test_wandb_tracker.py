"""WandbTracker in offline mode, read back from the run's own files: one run across a
resume, no step twice, params, the saved files."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys

import pytest
import tensorflow as tf

import tputrain
from tputrain.tracking.record import read_record
from tputrain.tracking.wandb_files import history, raw_records
from faults import Process, child_env
from tiny import TinyTask

wandb = pytest.importorskip("wandb", reason="the wandb extra: pip install 'tputrain[wandb]'")


def _trainer(model_dir, train_steps):
    return tputrain.Trainer(TinyTask(), str(model_dir), strategy=tf.distribute.OneDeviceStrategy(
        "/cpu:0"), train_steps=train_steps, steps_per_loop=100, eval_every=200,
        checkpoint_every=100, global_batch_size=16, report_mfu=False,
        actions=[tputrain.WandbTracker(project="tests", mode="offline")])


def _forget_latest(model_dir, step: int, keep: int) -> None:
    """model_dir as a kill -9 after the loop to `step` (logged) and before its save."""
    folder = os.path.join(model_dir, "checkpoints")
    for path in tf.io.gfile.glob(os.path.join(folder, f"ckpt-{step}.*")):
        tf.io.gfile.remove(path)
    with open(os.path.join(folder, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "ckpt-{keep}"\n'
                f'all_model_checkpoint_paths: "ckpt-{keep}"\n')


def _config(files_dir, run_id, kind="config"):
    """The run's `config` (or `summary`) as its files hold it: each key's last value, as
    JSON text."""
    from wandb.proto import wandb_internal_pb2
    config = {}
    for path in sorted(glob.glob(os.path.join(files_dir, "wandb", f"*-{run_id}",
                                              f"run-{run_id}.wandb"))):  # oldest first
        for data in raw_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == kind:
                config.update({item.key: item.value_json
                               for item in getattr(record, kind).update})
    return config


@pytest.mark.slow
def test_offline_run_is_one_run_across_a_resume_with_no_step_twice(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    model_dir = tmp_path / "run"
    with _trainer(model_dir, 300) as trainer:
        trainer.train()
    run_id = read_record(str(model_dir), "wandb")["run_id"]
    _forget_latest(str(model_dir), 300, keep=200)
    with _trainer(model_dir, 400) as trainer:
        trainer.train()  # recomputes 201-300, then 301-400
        trainer.train_steps = 500  # a notebook's next train() after the run's end
        trainer.train()

    assert read_record(str(model_dir), "wandb")["run_id"] == run_id
    files = str(model_dir / "tracking")
    rows = history(files, run_id)
    steps = {key: [step for step, values in rows if key in values]
             for key in ("train/loss", "eval/loss", "goodput/steps")}
    assert steps["train/loss"] == [100, 200, 300, 400, 500]
    assert steps["eval/loss"] == [200, 300, 400, 500]
    assert steps["goodput/steps"] == [300, 400, 500]
    # One folder each time the run was opened: two Trainers, and the third train().
    assert len(glob.glob(os.path.join(files, "wandb", f"offline-run-*-{run_id}"))) == 3
    config = _config(files, run_id)
    assert '"1"' in config["plan/replicas"] and "OneDeviceStrategy" in config["plan/strategy"]
    assert "500" in config["Trainer.train_steps"]  # the latest value
    saved = glob.glob(os.path.join(files, "wandb", f"offline-run-*-{run_id}", "files", "*"))
    assert {"operative_config.gin", "goodput.txt"} <= {os.path.basename(p) for p in saved}


# ------------------------------------------------------------ the CLI, WANDB_MODE=offline

DIGITS = ["--gin_import=faults", "--gin_file=digits.gin", "--gin_param=Trainer.train_steps=600",
          "--gin_param=Trainer.eval_every=200", "--gin_param=Trainer.checkpoint_every=200",
          "--gin_param=WandbTracker.project='e2e'"]


def _offline_env(tmp_path):
    """A child's environment: W&B offline (no network, no account), its own folders and
    its own W&B service: once a test ran W&B in this process, wandb's $WANDB_SERVICE
    would have every child share this process's service (which outlives a killed child,
    holding its run open)."""
    env = dict(child_env(), TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"), WANDB_MODE="offline",
               WANDB_SILENT="true", WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    env.pop("WANDB_SERVICE", None)
    return env


def _run_folders(files_dir):
    return sorted(glob.glob(os.path.join(files_dir, "wandb", "offline-run-*")))


@pytest.mark.slow
def test_kill_9_resume_and_tputrain_eval_are_one_offline_run(tmp_path):
    """Acceptance 2: killed at step 300 (checkpoint 200), resumed, then `tputrain eval`:
    one W&B run (read back from its offline files), every step once, params, files."""
    model_dir, env = tmp_path / "model", _offline_env(tmp_path)
    run = [sys.executable, "-m", "tputrain.run", *DIGITS, f"--model_dir={model_dir}"]
    killed = Process([*run, "--gin_param=PauseAtStep.step=300",
                      "--gin_param=Trainer.actions=[@Export(), @WandbTracker(), @PauseAtStep()]"],
                     env)
    killed.wait_for(r"tputrain-test: paused at step 300", timeout=900)
    assert killed.kill(signal.SIGKILL) == -signal.SIGKILL
    resumed = subprocess.run([*run, "--gin_param=Trainer.actions=[@Export(), @WandbTracker()]"],
                             env=env, text=True, capture_output=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restored" in resumed.stderr and "(step 200)" in resumed.stderr
    evaluated = subprocess.run([sys.executable, "-m", "tputrain.cli", "eval",
                                f"--model_dir={model_dir}"], env=env, text=True,
                               capture_output=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]

    run_id = read_record(str(model_dir), "wandb")["run_id"]
    files = str(model_dir / "tracking")
    folders = _run_folders(files)  # the killed run's, the resumed run's, the eval's
    assert len(folders) == 3 and all(f.endswith(f"-{run_id}") for f in folders), folders
    rows = history(files, run_id)
    steps = [step for step, _ in rows]
    assert steps == sorted(set(steps)), steps  # no step twice, across the three processes
    assert [step for step, values in rows if "train/loss" in values] == [
        100, 200, 300, 400, 500, 600]
    assert [step for step, values in rows if "eval/accuracy" in values] == [200, 400, 600]
    assert any("goodput/steps" in values for _, values in rows)
    config = _config(files, run_id)
    assert "0.1" in config["DigitsTask.dropout"] and "64" in config["plan/global_batch_size"]
    assert _config(files, run_id, "summary")["tputrain.serving.export"].endswith('export/600"')
    saved = glob.glob(os.path.join(files, "wandb", f"offline-run-*-{run_id}", "files", "*"))
    assert {"operative_config.gin", "goodput.txt"} <= {os.path.basename(p) for p in saved}


@pytest.mark.slow
def test_on_two_workers_only_the_chief_logs_offline(tmp_path, monkeypatch):
    """Acceptance 2: `tputrain launch --workers=2` with the tracker is one W&B run."""
    from processes import launched
    for key, value in _offline_env(tmp_path).items():
        if key.startswith("WANDB_"):
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_SERVICE", raising=False)  # (_offline_env says why)
    config = tmp_path / "two.gin"
    config.write_text("""
Trainer.task = @FaultTask()
FaultTask.dropout = 0.0
Trainer.train_steps = 4
Trainer.steps_per_loop = 2
Trainer.eval_every = 2
Trainer.checkpoint_every = 4
Trainer.global_batch_size = 16
Trainer.report_mfu = False
Trainer.actions = [@WandbTracker()]
WandbTracker.project = 'two'
""")
    launched(config, tmp_path / "model")
    run_id = read_record(str(tmp_path / "model"), "wandb")["run_id"]
    files = str(tmp_path / "model" / "tracking")
    assert [os.path.basename(f).rsplit("-", 1)[1] for f in _run_folders(files)] == [run_id]
    assert glob.glob(str(tmp_path / "**" / "run-*.wandb"), recursive=True) == glob.glob(
        os.path.join(files, "wandb", "*", "run-*.wandb"))  # the other worker wrote none
    rows = history(files, run_id)
    assert [step for step, values in rows if "train/loss" in values] == [2, 4]
    assert '"2"' in _config(files, run_id)["plan/hosts"]
