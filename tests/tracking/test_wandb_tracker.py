"""WandbTracker in offline mode, read back from the run's own files: one run across a
resume, no step twice, params, the saved files."""

from __future__ import annotations

import glob
import os

import pytest
import tensorflow as tf

import tputrain
from tputrain.tracking.record import read_record
from tputrain.tracking.wandb_files import history, raw_records
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


def _config(files_dir, run_id):
    from wandb.proto import wandb_internal_pb2
    config = {}
    for path in sorted(glob.glob(os.path.join(files_dir, "wandb", f"*-{run_id}",
                                              f"run-{run_id}.wandb"))):  # oldest first
        for data in raw_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "config":
                config.update({item.key: item.value_json for item in record.config.update})
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
