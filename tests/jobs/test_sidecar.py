"""Evaluation alone: a given or the latest checkpoint, and a side-car beside training that
evaluates every checkpoint once, never touching what the training process owns."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import TinyTask, strategy_for
from tputrain.checkpointing.run_directory import ModelDirError
from tputrain.jobs import sidecar
from tputrain.jobs.sidecar import (NoNewCheckpointError, ReadOnlyTrainer, evaluate_checkpoints,
                              read_checkpoint)


class RecordEvals(tputrain.Action):
    """The training's own evaluations, by step."""

    def __init__(self):
        self.logs = {}

    def on_eval_end(self, trainer, step, logs):
        self.logs[step] = dict(logs)


def make(model_dir, cls=tputrain.Trainer, actions=(), **kwargs):
    options = dict(train_steps=8, steps_per_loop=2, global_batch_size=16, eval_every=2,
                   eval_steps=2, checkpoint_every=4, keep_checkpoints=5, report_mfu=False)
    options.update(kwargs)
    return cls(TinyTask(), str(model_dir), strategy=strategy_for(1), actions=actions, **options)


def eval_steps_in(event_dir, pid=None):
    """Steps of the `loss` scalars in eval/ (of one process's event file when `pid`)."""
    steps = []
    for name in sorted(os.listdir(event_dir)):
        if not name.startswith("events.out.tfevents.") or (pid and f".{pid}." not in name):
            continue
        for record in tf.data.TFRecordDataset(os.path.join(event_dir, name)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            steps += [event.step for value in event.summary.value if value.tag == "loss"]
    return steps


def assert_same(actual, expected):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-6)


def test_latest_and_given_step_match_the_trainers_evaluation(tmp_path):
    recorded = RecordEvals()
    trainer = make(tmp_path / "run", actions=[recorded])
    trainer.train()
    latest = evaluate_checkpoints(trainer)
    assert list(latest) == [8]
    assert_same(latest[8], trainer.evaluate())

    before = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    reader = make(tmp_path / "run", cls=ReadOnlyTrainer)
    given = evaluate_checkpoints(reader, step=4)
    assert list(given) == [4] and reader.current_step == 4
    assert_same(given[4], recorded.logs[4])  # the training's evaluation of those weights
    assert_same(reader.evaluate(), trainer.evaluate())  # read-only: the latest, no actions
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == before

    record = json.loads((tmp_path / "run" / "eval" / sidecar.RECORD_FILE).read_text())
    assert sorted(record["evaluated"]) == ["4", "8"] and record["skipped"] == {}
    assert {4, 8} <= set(eval_steps_in(tmp_path / "run" / "eval", os.getpid()))
    with pytest.raises(TypeError, match="only evaluates"):
        reader.train()


def test_bad_requests_fail_with_the_fix(tmp_path):
    trainer = make(tmp_path / "run", train_steps=4)
    with pytest.raises(ValueError, match="no checkpoint in .*: train first"):
        evaluate_checkpoints(trainer)
    assert not (tmp_path / "run" / "eval").exists()  # nothing written
    trainer.train()
    with pytest.raises(ValueError, match=r"no checkpoint of step 3 .* it has steps \[4\]"):
        evaluate_checkpoints(trainer, step=3)
    with pytest.raises(ValueError, match="not both"):
        evaluate_checkpoints(trainer, step=4, continuous=True)
    with pytest.raises(ValueError, match="poll_seconds must be > 0"):
        evaluate_checkpoints(trainer, continuous=True, poll_seconds=0)


def test_continuous_evaluates_each_checkpoint_once_and_skips_vanished_ones(tmp_path,
                                                                          monkeypatch):
    make(tmp_path / "run", checkpoint_every=2).train()
    reader = make(tmp_path / "run", cls=ReadOnlyTrainer, checkpoint_every=2)
    checkpoints = str(tmp_path / "run" / "checkpoints")
    (tmp_path / "run" / "checkpoints" / "ckpt-4.data-00000-of-00001").write_bytes(b"")
    real_list = sidecar.list_checkpoints
    calls = []

    def listing_with_a_rotated_one(directory):  # ckpt-1: listed, then deleted by rotation
        listed = real_list(directory)
        calls.append(directory)
        if len(calls) == 1:
            return listed._replace(paths=[f"{checkpoints}/ckpt-1"] + listed.paths)
        return listed

    monkeypatch.setattr(sidecar, "list_checkpoints", listing_with_a_rotated_one)
    results = evaluate_checkpoints(reader, continuous=True, poll_seconds=0.01)
    assert sorted(results) == [2, 6, 8]
    record = json.loads((tmp_path / "run" / "eval" / sidecar.RECORD_FILE).read_text())
    assert "keep-N rotation" in record["skipped"]["1"]
    assert "unreadable" in record["skipped"]["4"]
    # A restarted side-car evaluates nothing again; past the end it waits, then gives up.
    assert evaluate_checkpoints(reader, continuous=True, poll_seconds=0.01) == {}
    with pytest.raises(NoNewCheckpointError, match=r"no new checkpoint .* \(the last was step 8; "
                       r"waiting for step 10\)") as raised:
        evaluate_checkpoints(reader, continuous=True, poll_seconds=0.01, timeout=0.05,
                             until_step=10)
    assert raised.value.results == {}
    # Step 8 in eval/: the training's own evaluation, and the side-car's once.
    assert eval_steps_in(tmp_path / "run" / "eval", os.getpid()).count(8) == 2


def test_a_side_car_says_which_checkpoints_an_earlier_evaluation_handled(tmp_path, caplog):
    """A one-off `tputrain eval` records its step; a `--continuous` side-car started
    later skipped that checkpoint without a word (its result was nowhere in the
    side-car's output). Now its first line names the steps it will not evaluate again,
    and where they were recorded."""
    make(tmp_path / "run", checkpoint_every=2).train()
    reader = make(tmp_path / "run", cls=ReadOnlyTrainer, checkpoint_every=2)
    evaluate_checkpoints(reader, step=4)
    with caplog.at_level("INFO"):
        results = evaluate_checkpoints(reader, continuous=True, poll_seconds=0.01)
    assert sorted(results) == [2, 6, 8]
    said = [r.getMessage() for r in caplog.records if "already" in r.getMessage()]
    assert len(said) == 1 and "step 4" in said[0] and sidecar.RECORD_FILE in said[0], said


def test_a_damaged_checkpoint_saved_again_is_evaluated(tmp_path, monkeypatch, caplog):
    """A side-car recorded a damaged ckpt-4 as skipped for good: training's rerun moves
    it aside and saves step 4 afresh, and that good checkpoint was never evaluated (with
    Trainer.eval_every=None, step 4 was never evaluated at all). A skip is retried when
    the step is listed again with other files; the end says which stayed unevaluated."""
    make(tmp_path / "run", checkpoint_every=2).train()
    reader = make(tmp_path / "run", cls=ReadOnlyTrainer, checkpoint_every=2)
    data = tmp_path / "run" / "checkpoints" / "ckpt-4.data-00000-of-00001"
    good = data.read_bytes()
    data.write_bytes(good[:len(good) // 2])  # damaged on disk when the side-car reads it
    real_list = sidecar.list_checkpoints
    calls = []

    def training_saves_step_4_again(directory):  # first [2, 4]; then 4 afresh, 6 and 8
        listed = real_list(directory)
        calls.append(directory)
        if len(calls) == 1:
            return listed._replace(paths=listed.paths[:2])
        data.write_bytes(good)
        return listed

    with monkeypatch.context() as patched:
        patched.setattr(sidecar, "list_checkpoints", training_saves_step_4_again)
        results = evaluate_checkpoints(reader, continuous=True, poll_seconds=0.01)
    assert sorted(results) == [2, 4, 6, 8]
    assert_same(results[4], evaluate_checkpoints(reader, step=4)[4])
    record = json.loads((tmp_path / "run" / "eval" / sidecar.RECORD_FILE).read_text())
    assert sorted(map(int, record["evaluated"])) == [2, 4, 6, 8] and record["skipped"] == {}

    # Damaged for good: the end names it; a restarted side-car, once it is saved again.
    (tmp_path / "run" / "eval" / sidecar.RECORD_FILE).unlink()
    data.write_bytes(good[:len(good) // 2])
    with caplog.at_level("INFO"):
        assert sorted(evaluate_checkpoints(reader, continuous=True, poll_seconds=0.01)) == \
            [2, 6, 8]
    said = [r.getMessage() for r in caplog.records if "not evaluated" in r.getMessage()]
    assert len(said) == 1 and "step 4 (unreadable" in said[0], said
    assert evaluate_checkpoints(reader, continuous=True, poll_seconds=0.01) == {}  # same files
    data.write_bytes(good)
    assert sorted(evaluate_checkpoints(reader, continuous=True, poll_seconds=0.01)) == [4]


@pytest.mark.parametrize("continuous", [False, True])
def test_an_eval_folder_that_takes_no_writes_is_named_before_evaluating(tmp_path, monkeypatch,
                                                                        continuous):
    """A read-only model_dir: `tputrain eval` evaluated, then failed in the summary
    writer's thread (a traceback, no result printed) and --continuous once it wrote its
    record; the lock's warning blamed "a second run". Now nothing is evaluated: one
    error names eval/ and the fix. (Tests run as root, which chmod does not stop: the
    probe's write is made to fail as a read-only disk's does; eval/ as a file is real.)"""
    make(tmp_path / "run", train_steps=4).train()
    reader = make(tmp_path / "run", cls=ReadOnlyTrainer, train_steps=4)
    eval_dir = tmp_path / "run" / "eval"
    shutil.rmtree(eval_dir)
    evaluated = []
    monkeypatch.setattr(reader, "evaluate_weights", lambda: evaluated.append(1) or {})
    eval_dir.write_text("")  # a file where eval/ belongs
    with pytest.raises(ModelDirError, match=f"{eval_dir} .*not a directory.*: "):
        evaluate_checkpoints(reader, continuous=continuous, poll_seconds=0.01)
    eval_dir.unlink()

    def read_only(*args, **kwargs):
        raise tf.errors.PermissionDeniedError(None, None, "Read-only file system")

    monkeypatch.setattr(sidecar.tf.io.gfile, "GFile", read_only)
    with pytest.raises(ModelDirError, match=f"{eval_dir} is not writable .*Read-only file "
                       "system.*tputrain eval writes .* there"):
        evaluate_checkpoints(reader, continuous=continuous, poll_seconds=0.01)
    assert evaluated == []


class WideTask(TinyTask):
    """Another model: a wider hidden layer."""

    def build_model(self):
        import keras

        inputs = keras.Input((8,), name="x")
        return keras.Model({"x": inputs}, keras.layers.Dense(2)(keras.layers.Dense(32)(inputs)))


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    make(tmp_path / "run", train_steps=4).train()
    other = tputrain.Trainer(WideTask(), str(tmp_path / "other"), strategy=strategy_for(1),
                             train_steps=4, steps_per_loop=2, global_batch_size=16,
                             report_mfu=False)
    with pytest.raises(tputrain.CheckpointMismatchError, match="does not hold this model"):
        read_checkpoint(other, str(tmp_path / "run" / "checkpoints" / "ckpt-4"))


TINY_GIN = """
Trainer.task = @FaultTask()
FaultTask.dropout = 0.0
Trainer.train_steps = 60
Trainer.steps_per_loop = 5
Trainer.global_batch_size = 16
Trainer.checkpoint_every = 5
Trainer.keep_checkpoints = 100
Trainer.eval_steps = 2
Trainer.report_mfu = False
"""


@pytest.mark.slow  # three processes starting TensorFlow: 35-50 s on 2 shared cores
def test_cli_side_car_beside_training_evaluates_every_checkpoint_once(tmp_path):
    from faults import Process, child_env

    config, model_dir = tmp_path / "tiny.gin", tmp_path / "model"
    config.write_text(TINY_GIN)
    common = ["--gin_import=faults", f"--gin_file={config}", f"--model_dir={model_dir}"]
    side_car = Process([sys.executable, "-m", "tputrain.cli", "eval", *common, "--continuous",
                        "--poll_seconds=0.1", "--timeout_seconds=600"], child_env())
    side_car.wait_for("evaluating each new checkpoint in")  # up, model built, watching
    training = subprocess.run([sys.executable, "-m", "tputrain.run", *common],
                              env=child_env(), capture_output=True, text=True, timeout=600)
    assert training.returncode == 0, training.stderr[-3000:]  # the side-car took no lock
    assert side_car.finish(timeout=600) == 0, side_car.log()

    kept = sorted(int(name[len("ckpt-"):-len(".index")])
                  for name in os.listdir(model_dir / "checkpoints") if name.endswith(".index"))
    assert kept == list(range(5, 65, 5))
    printed = [json.loads(line) for line in side_car.lines if line.startswith("{")]
    assert [line["step"] for line in printed] == kept and "accuracy" in printed[0]
    record = json.loads((model_dir / "eval" / sidecar.RECORD_FILE).read_text())
    assert sorted(map(int, record["evaluated"])) == kept and record["skipped"] == {}
    assert sorted(eval_steps_in(model_dir / "eval", side_car.process.pid)) == kept

    again = subprocess.run([sys.executable, "-m", "tputrain.cli", "eval", *common,
                            "--step=7"], env=child_env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 2 and "no checkpoint of step 7" in again.stderr, again.stderr[-2000:]
