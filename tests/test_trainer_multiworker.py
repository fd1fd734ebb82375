"""The Trainer on 2 and 3 real worker processes (MultiWorkerMirrored on 127.0.0.1).

Per-host arithmetic that one process cannot show: file shards per host, eval
step counts agreed across hosts with uneven shards (the host with fewer batches
pads with zero-weight ones), the skip count of a distributed-input resume,
kill -9 resumes equal to an uninterrupted run, in both input modes, and a run
resumed on fewer workers continuing from the examples consumed.
"""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from events import last_scalars
from faults import RecordsTask, final_weights, trained_indices
from processes import Launch, listed_steps

pytestmark = pytest.mark.slow

PER_REPLICA = 8
# Eval files of uneven sizes (in per-replica batches 5, 2, 1): with 2 hosts, host 0
# reads files 0 and 2 (6 batches) and host 1 file 1 (2); with 3 hosts 5, 2 and 1.
EVAL_FILE_BATCHES = (5, 2, 1)


def _write(directory: Path, name: str, counts: list[int], seed: int) -> list[str]:
    rng = np.random.RandomState(seed)
    files = []
    for index, count in enumerate(counts):
        x = rng.randn(count, 8).astype(np.float32)
        y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
        files += tputrain.data.write_tfrecords({"x": x, "label": y},
                                               str(directory / f"{name}{index}"), num_shards=1)
    return files


def _eval_scalars(model_dir: Path) -> dict[str, float]:
    """The last eval point the chief wrote to TensorBoard (float32, not log text)."""
    return last_scalars(model_dir / "eval")


def _direct_eval(model_dir: Path, files: list[str]) -> dict[str, float]:
    """Loss (mean cross-entropy + L2) and accuracy of the final checkpoint over every
    eval example, computed here in one piece."""
    task = RecordsTask("unused")
    model = task.build_model()
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    tf.train.Checkpoint(model=model).read(path).expect_partial().assert_existing_objects_matched()
    x, y = [], []
    for record in tf.data.TFRecordDataset(files):
        example = tf.train.Example.FromString(record.numpy())
        x.append(example.features.feature["x"].float_list.value)
        y.append(example.features.feature["label"].int64_list.value[0])
    logits = model(np.array(x, np.float32), training=False)
    loss = float(np.mean(keras.losses.sparse_categorical_crossentropy(
        np.array(y), logits, from_logits=True)) + float(sum(model.losses)))
    accuracy = float(np.mean(np.argmax(logits, axis=-1) == np.array(y)))
    return {"loss": loss, "accuracy": accuracy, "examples": len(y)}


@pytest.mark.start_early(3)
@pytest.mark.parametrize("workers, input_mode, pad_eval", [
    (2, "host", False), (3, "host", True), (2, "distributed", True), (3, "distributed", False)])
def test_uneven_eval_shards_agree_on_steps_and_the_mean(tmp_path, workers, input_mode, pad_eval):
    data = tmp_path / "data"
    train_files = _write(data, "train", [64] * workers, seed=0)
    eval_files = _write(data, "eval", [b * PER_REPLICA for b in EVAL_FILE_BATCHES], seed=1)
    config = tmp_path / "mw.gin"
    config.write_text(f"""
Trainer.task = @RecordsTask()
RecordsTask.pattern = '{data}/train*'
RecordsTask.eval_pattern = '{data}/eval*'
RecordsTask.pad_eval = {pad_eval}
Trainer.train_steps = 4
Trainer.steps_per_loop = 2
Trainer.checkpoint_every = 4
Trainer.global_batch_size = {PER_REPLICA * workers}
Trainer.input_mode = '{input_mode}'
Trainer.report_mfu = False
""")
    model_dir = tmp_path / "model"
    launch = Launch(["--workers", str(workers), "--gin_import=faults", f"--gin_file={config}",
                     f"--model_dir={model_dir}"])
    code = launch.finish(timeout=300)
    text = launch.text()
    assert code == 0, text[-4000:]
    assert len(train_files) == workers
    # Every host ran as many steps as the host with the most eval batches needs.
    most = max(sum(EVAL_FILE_BATCHES[i::workers]) for i in range(workers))
    counts = {int(w): int(n) for w, n in
              re.findall(r"\[worker (\d)\] .*eval at step 4 .*\| (\d+) eval steps", text)}
    assert counts == {w: most for w in range(workers)}, text[-4000:]
    reported = _eval_scalars(model_dir)
    direct = _direct_eval(model_dir, eval_files)
    assert direct["examples"] == sum(EVAL_FILE_BATCHES) * PER_REPLICA
    assert reported["accuracy"] == pytest.approx(direct["accuracy"], abs=1e-6)
    assert reported["loss"] == pytest.approx(direct["loss"], rel=1e-5)


KILL_CONFIG = """
Trainer.task = @FaultTask()
Trainer.train_steps = 24
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.checkpoint_every = 4
Trainer.eval_steps = 1
Trainer.input_mode = '{input_mode}'
Trainer.report_mfu = False
FaultTask.dropout = 0.3
"""


def _killed_worker_and_rerun(tmp_path, config: Path, kill_steps: list[int]) -> Launch:
    """The launch of `config` on 2 workers, a random worker SIGKILLed once the chief
    has saved a checkpoint at a random step of `kill_steps`, then rerun: its final
    weights equal an uninterrupted launch's, bitwise. Returns the rerun."""
    def args(model_dir: Path) -> list[str]:
        return ["--workers", "2", "--peer_exit_timeout", "60", "--gin_import=faults",
                f"--gin_file={config}", f"--model_dir={model_dir}", "--deterministic"]

    reference = Launch(args(tmp_path / "reference"))
    assert reference.finish(timeout=300) == 0, reference.log()

    rng = random.Random()
    kill_after, victim = rng.choice(kill_steps), rng.choice([0, 1])
    interrupted = Launch(args(tmp_path / "model"))
    pids = interrupted.wait_for(r"worker 0 pid (\d+), worker 1 pid (\d+)")
    saved = 0
    while saved < kill_after:
        saved = int(interrupted.wait_for(r"\[worker 0\] .*saved checkpoint \S+/ckpt-(\d+)").group(1))
    os.kill(int(pids.group(1 + victim)), signal.SIGKILL)
    assert interrupted.finish(timeout=150) != 0, interrupted.log()
    resume_step = listed_steps(tmp_path / "model")[-1]
    assert resume_step >= kill_after

    rerun = Launch(args(tmp_path / "model"))
    assert rerun.finish(timeout=300) == 0, rerun.log()
    assert re.search(rf"\[worker 1\] .*restored \S+/ckpt-{resume_step} ", rerun.text()), rerun.log()
    expected, actual = final_weights(str(tmp_path / "reference")), final_weights(str(tmp_path / "model"))
    assert expected.keys() == actual.keys()
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)
    return rerun


@pytest.mark.start_early(1)
@pytest.mark.parametrize("input_mode", ["host", "distributed"])
def test_kill_9_of_a_worker_then_rerun_equals_an_uninterrupted_run(tmp_path, input_mode):
    """Issue 11 acceptance 2: 2 worker processes, a random worker SIGKILLed after a
    random checkpoint; the rerun's final weights equal an uninterrupted run's, bitwise."""
    config = tmp_path / "mw.gin"
    config.write_text(KILL_CONFIG.format(input_mode=input_mode))
    _killed_worker_and_rerun(tmp_path, config, [4, 8, 12, 16])


POSITIONAL_KILL_CONFIG = """
Trainer.task = @PositionalRecordsTask()
PositionalRecordsTask.manifest = '{manifest}'
PositionalRecordsTask.dropout = 0.3
Trainer.train_steps = 40
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.checkpoint_every = 4
Trainer.eval_steps = 1
Trainer.input_mode = 'distributed'
Trainer.report_mfu = False
"""


def test_kill_9_of_a_worker_with_a_positional_input_in_distributed_mode(tmp_path):
    """Issue 54 acceptance 1 on 2 worker processes: a positional input (windows of 256,
    each host reads every 2nd) in distributed input mode, a random worker SIGKILLed
    after a random checkpoint (each host mid-window, or past host 0's first window at
    step 32); the rerun builds the input at its position and ends bitwise where an
    uninterrupted run does."""
    from faults import write_labelled_records
    config = tmp_path / "mw.gin"
    config.write_text(POSITIONAL_KILL_CONFIG.format(
        manifest=write_labelled_records(tmp_path, 600)))
    rerun = _killed_worker_and_rerun(tmp_path, config, [8, 16, 32])
    assert "not positional" not in rerun.text(), rerun.log()  # built there, nothing re-read


def test_kill_9_of_a_worker_with_packed_positional_rows_in_distributed_mode(tmp_path):
    """Issue 54 acceptance 3 on 2 worker processes: a positional input packed within
    each window (about 100 rows of 16 a window), distributed input mode, a random
    worker SIGKILLed after a random checkpoint; the rerun builds each host's rows at
    the place its checkpointed row sums give (nothing re-read) and ends bitwise where
    an uninterrupted run does."""
    from faults import write_token_sources
    manifest, = write_token_sources(tmp_path, {"tokens": 700}, (0, 12), seed=0)
    config = tmp_path / "mw.gin"
    config.write_text(POSITIONAL_KILL_CONFIG.format(manifest=manifest).replace(
        "PositionalRecordsTask", "PackedRowsTask").replace("PackedRowsTask.dropout = 0.3\n", ""))
    rerun = _killed_worker_and_rerun(tmp_path, config, [8, 16, 32])
    assert "not positional" not in rerun.text(), rerun.log()


def test_packed_positional_rows_on_another_host_count_are_refused_naming_the_fix(tmp_path):
    """Packed rows of a positional input trained on 2 workers, resumed on 1: their
    places are not carried over to other hosts yet, so the resume says so and how to
    go on (not a checkpoint shape error, not rows read twice)."""
    from faults import write_token_sources
    manifest, = write_token_sources(tmp_path, {"tokens": 700}, (0, 12), seed=0)
    config = tmp_path / "mw.gin"
    config.write_text(POSITIONAL_KILL_CONFIG.format(manifest=manifest).replace(
        "PositionalRecordsTask", "PackedRowsTask").replace("PackedRowsTask.dropout = 0.3\n", "")
        .replace("train_steps = 40", "train_steps = 4"))
    first = Launch(["--workers", "2", "--gin_import=faults", f"--gin_file={config}",
                    f"--model_dir={tmp_path / 'model'}"])
    assert first.finish(timeout=300) == 0, first.log()
    again = Launch(["--workers", "1", "--gin_import=faults", f"--gin_file={config}",
                    "--gin_param=Trainer.train_steps=8", f"--model_dir={tmp_path / 'model'}"])
    assert again.finish(timeout=300) != 0
    assert "resume on the host count it started with, or set positional=False" in again.text(), \
        again.log()
    assert listed_steps(tmp_path / "model")[-1] == 4


def test_two_workers_resume_from_checkpoint_files_without_a_state_file(tmp_path):
    """Issue 33.1 on 2 worker processes: the chief's `checkpoint` state file deleted
    after step 16; the rerun resumes there on both workers (not from step 0) and ends
    with an uninterrupted run's weights, bitwise."""
    config = tmp_path / "mw.gin"
    config.write_text(KILL_CONFIG.format(input_mode="host"))

    def args(model_dir: Path, steps: int) -> list[str]:
        return ["--workers", "2", "--peer_exit_timeout", "60", "--gin_import=faults",
                f"--gin_file={config}", f"--gin_param=Trainer.train_steps={steps}",
                f"--model_dir={model_dir}", "--deterministic"]

    reference = Launch(args(tmp_path / "reference", 24))
    assert reference.finish(timeout=900) == 0, reference.log()
    first = Launch(args(tmp_path / "model", 16))
    assert first.finish(timeout=900) == 0, first.log()
    (tmp_path / "model" / "checkpoints" / "checkpoint").unlink()

    rerun = Launch(args(tmp_path / "model", 24))
    assert rerun.finish(timeout=900) == 0, rerun.log()
    for worker in (0, 1):
        assert re.search(rf"\[worker {worker}\] .*restored \S+/ckpt-16 ", rerun.text()), rerun.log()
    assert re.search(r"\[worker 0\] .*no checkpoint state file", rerun.text()), rerun.log()
    assert listed_steps(tmp_path / "model") == [16, 20, 24]
    expected, actual = final_weights(str(tmp_path / "reference")), final_weights(str(tmp_path / "model"))
    assert expected.keys() == actual.keys()
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


INDEXED_CONFIG = """
Trainer.task = @IndexedTask()
IndexedTask.record_dir = '{record}'
Trainer.train_steps = {steps}
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.checkpoint_every = 2
Trainer.eval_steps = 1
Trainer.input_mode = 'host'
Trainer.report_mfu = False
Trainer.jit_compile = False  # IndexedTask records in the step (a py_function)
Trainer.steps_per_program = 1
"""


def test_two_workers_then_one_continue_from_the_examples_consumed(tmp_path):
    """Issue 33 item 8: 2 workers train 4 steps (each host every 2nd example), then 1
    worker resumes from their checkpoint (refused before): the step continues and the
    input, each example of one order sharded by example, resumes at the 64 consumed;
    from the indices trained on in both runs, none twice and none left out."""
    model_dir, record = tmp_path / "model", tmp_path / "seen"

    def run(workers: int, steps: int) -> Launch:
        config = tmp_path / f"steps{steps}.gin"
        config.write_text(INDEXED_CONFIG.format(record=record, steps=steps))
        launch = Launch(["--workers", str(workers), "--gin_import=faults",
                         f"--gin_file={config}", f"--model_dir={model_dir}"])
        assert launch.finish(timeout=300) == 0, launch.log()
        return launch

    run(2, 4)
    assert trained_indices(record) == list(range(64))
    resumed = run(1, 8)
    assert listed_steps(model_dir)[-1] == 8
    assert trained_indices(record) == list(range(128))
    line = re.search(r"checkpoint \S+/ckpt-4 was written with 2 replicas on 2 hosts, global "
                     r"batch 16.*, this run has 1 replica on 1 host, global batch 16.*skipped 4 "
                     r"steps of 16 examples: the 64 examples consumed \(the input was split "
                     r"into 2 host shard\(s\), now 1: exact only where", resumed.text())
    assert line, resumed.log()


POSITIONAL_CONFIG = """
Trainer.task = @PositionalIndexedTask()
PositionalIndexedTask.record_dir = '{record}'
PositionalIndexedTask.manifest = '{manifest}'
Trainer.train_steps = {steps}
Trainer.steps_per_loop = 1
Trainer.global_batch_size = {batch}
Trainer.checkpoint_every = 1
Trainer.eval_steps = 1
Trainer.input_mode = '{input_mode}'
Trainer.report_mfu = False
Trainer.jit_compile = False  # the task records in the step (a py_function)
Trainer.steps_per_program = 1
"""


def _positional_launches(tmp_path, layouts, input_mode: str = "distributed") -> list[int]:
    """2400 records (5 shards, windows of 256) trained through one `tputrain launch` a
    (workers, global batch, last step) of `layouts`, in one model_dir: the checkpoint's
    steps; each launch recorded the indices it trained on."""
    from tputrain.data import write_tfrecords
    model_dir, record = tmp_path / "model", tmp_path / "seen"
    prefix = str(tmp_path / "ids")
    indices = np.arange(2400, dtype=np.int64)
    write_tfrecords({"x": np.eye(8, dtype=np.float32)[indices % 8], "index": indices},
                    prefix, num_shards=5)
    for workers, batch, steps in layouts:
        config = tmp_path / f"steps{steps}.gin"
        config.write_text(POSITIONAL_CONFIG.format(
            record=record, manifest=prefix + ".manifest.json", steps=steps, batch=batch,
            input_mode=input_mode))
        launch = Launch(["--workers", str(workers), "--gin_import=faults",
                         f"--gin_file={config}", f"--model_dir={model_dir}"])
        assert launch.finish(timeout=900) == 0, launch.log()
    return listed_steps(model_dir)


@pytest.mark.slow  # two launches
def test_positional_input_reads_every_record_once_through_2_then_1_workers(tmp_path):
    """Issue 54, acceptance 2, through worker processes in distributed mode: 3 steps of
    64 on 2 workers (each mid-window), then to the end of the epoch (step 26) with 96 on
    1: every record trained on once (the layout's host history in the checkpoint places
    the positional input)."""
    assert _positional_launches(tmp_path, ((2, 64, 3), (1, 96, 26)))[-1] == 26
    assert trained_indices(tmp_path / "seen") == list(range(2400))


@pytest.mark.slow  # three launches
def test_positional_input_reads_every_record_once_through_2_3_1_workers(tmp_path):
    """The same through 2 -> 3 -> 1 workers and global batches 64 -> 48 -> 96: 3 steps
    on 2, to step 7 on 3 (carried windows beside fresh ones), to the end of the epoch
    (step 28) on 1: every record trained on once."""
    assert _positional_launches(tmp_path, ((2, 64, 3), (3, 48, 7), (1, 96, 28)))[-1] == 28
    assert trained_indices(tmp_path / "seen") == list(range(2400))


@pytest.mark.slow  # three launches
def test_positional_input_in_host_mode_reads_every_record_once_through_2_3_1_workers(
        tmp_path):
    """Host mode, 2 -> 3 -> 1 workers and global batches 64 -> 48 -> 96 as above: no
    iterator is saved, each resume builds every host's input at its place from the
    layout's host history; every record trained on once."""
    assert _positional_launches(tmp_path, ((2, 64, 3), (3, 48, 7), (1, 96, 28)),
                                input_mode="host")[-1] == 28
    assert trained_indices(tmp_path / "seen") == list(range(2400))
