"""The trackers' common parts: the background sender (tputrain/tracking/sender.py), and
that the library imports no tracker or tuner package until a run uses one: checked in
a Python that refuses them (tests/support/no_extras.py), as a fresh install lacks them."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from absl import logging as absl_logging

import no_extras
from faults import child_env

from tputrain.tracking import sender as sender_module
from tputrain.tracking.sender import Sender


def test_a_failing_tracker_is_retried_in_order_and_warned_about_once(monkeypatch, caplog):
    monkeypatch.setattr(sender_module, "FIRST_PAUSE", 0.001)
    failures, sent = [3], []

    def send(job):
        if failures[0]:
            failures[0] -= 1
            raise ConnectionError("connection refused\nsecond line")
        sent.append(job)

    sender = Sender("TestTracker", send)
    with caplog.at_level("INFO", logger=absl_logging.get_absl_logger().name):
        for job in range(5):
            sender.put(job)
        assert sender.flush(timeout=60)
    sender.close()
    assert sent == [0, 1, 2, 3, 4]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["tputrain: TestTracker: the tracker failed (ConnectionError: connection "
                        "refused): training goes on; its metrics are queued and retried"]


def test_a_full_queue_drops_new_jobs_and_says_so_once(caplog):
    taken, release, sent = threading.Event(), threading.Event(), []

    def send(job):
        taken.set()
        release.wait()
        sent.append(job)

    sender = Sender("TestTracker", send, max_jobs=2)
    sender.put("in flight")
    assert taken.wait(60)
    with caplog.at_level("WARNING", logger=absl_logging.get_absl_logger().name):
        for job in ("a", "b", "c", "d"):
            sender.put(job)  # never blocks
    release.set()
    assert sender.flush(timeout=60)
    sender.close()
    assert sent == ["in flight", "a", "b"] and sender.dropped == 2
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1


_WITHOUT_EXTRAS = """
import sys
import no_extras
no_extras.install()
import tensorflow as tf
import tputrain
tputrain.load_api()
import tputrain.tracking, tputrain.tuning.report, tputrain.tuning.spec
import tputrain.tuning.vertex_job, tputrain.cli.tune, tputrain.cli.vertex_spec
import tputrain.cli.run, tputrain.cli.eval
from tiny import TinyTask

def trainer(model_dir, actions):
    return tputrain.Trainer(TinyTask(), model_dir, strategy=tf.distribute.OneDeviceStrategy(
        "/cpu:0"), train_steps=2, steps_per_loop=1, global_batch_size=8, report_mfu=False,
        jit_compile=False, actions=actions)

with trainer(sys.argv[1] + "/run", []) as run:
    run.train()
    print("trained to step", run.current_step)
print("refused", no_extras.refused(sys.argv[1] + "/refused"))
print("imported", sorted(m for m in ("mlflow", "wandb", "optuna", "yaml") if m in sys.modules))
for tracker in (tputrain.MLflowTracker(), tputrain.WandbTracker()):
    try:
        trainer(sys.argv[1] + "/tracked", [tracker])
    except ValueError as error:
        print("error", str(error).splitlines()[0])  # (gin adds "In call to ...")
"""


def _without_extras(tmp_path, *command, code=None):
    """`command` (a module and its arguments, or `code`) in a Python that refuses to import
    mlflow, wandb and optuna (tests/support/no_extras.py); the names it refused."""
    env = dict(child_env(), TPUTRAIN_TEST_REFUSED=str(tmp_path / "refused"),
               TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"))
    args = ["-c", code, str(tmp_path)] if code else ["-m", "no_extras", *command]
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_without_the_extras_the_library_trains_and_a_tracker_names_its_extra(tmp_path):
    """Acceptance 6, with the extras refused as a fresh install lacks them: importing the
    library and its commands and training without a tracker import none of them; a
    tracker configured without its extra is refused naming the pip install, before
    anything is written."""
    result = _without_extras(tmp_path, code=_WITHOUT_EXTRAS)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-5:] == [
        "trained to step 2", "refused []", "imported []",
        "error MLflowTracker needs the mlflow package: pip install 'tputrain[mlflow]'",
        "error WandbTracker needs the wandb package: pip install 'tputrain[wandb]'"]
    assert not (tmp_path / "tracked").exists()


def test_without_the_extras_help_imports_none_of_them(tmp_path):
    """`tputrain --help` and `tputrain tune --help` with the extras refused (and no
    TensorFlow: both print text the CLI keeps)."""
    for command in (["tputrain.cli", "--help"], ["tputrain.cli", "tune", "--help"]):
        result = _without_extras(tmp_path, *command)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "usage" in result.stdout.lower()
    assert "--study_dir" in result.stdout
    assert no_extras.refused(tmp_path / "refused") == []


@pytest.mark.slow
def test_without_the_extras_the_cli_trains_and_a_tracker_is_one_line_and_exit_2(tmp_path):
    """Acceptance 6 on the CLI: `tputrain run` with no tracker trains importing none of
    the extras; with `MLflowTracker` configured it is one line naming the extra, exit 2,
    nothing written."""
    config = tmp_path / "tiny.gin"
    config.write_text("Trainer.task = @FaultTask()\nTrainer.train_steps = 2\n"
                      "Trainer.steps_per_loop = 1\nTrainer.global_batch_size = 8\n"
                      "Trainer.report_mfu = False\nTrainer.jit_compile = False\n")
    run = ["tputrain.cli", "--gin_import=faults", f"--gin_file={config}"]
    trained = _without_extras(tmp_path, *run, f"--model_dir={tmp_path / 'run'}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "done at step 2" in trained.stderr
    assert no_extras.refused(tmp_path / "refused") == []
    refused = _without_extras(tmp_path, *run, f"--model_dir={tmp_path / 'tracked'}",
                              "--gin_param=Trainer.actions=[@MLflowTracker()]")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert [line for line in refused.stderr.splitlines() if "error" in line.lower()] == [
        "tputrain: error: MLflowTracker needs the mlflow package: pip install "
        "'tputrain[mlflow]'"]
    assert not (tmp_path / "tracked").exists()
