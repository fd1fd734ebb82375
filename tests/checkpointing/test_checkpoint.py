"""Checkpointer: torn writes ignored, corrupt latest falls back, mismatch named, async saves."""

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.checkpoint import (CheckpointMismatchError, Checkpointer, InputLayoutError,
                                 seed_generator_states)
from tputrain.checkpointing.input_layout import InputLayout
from tputrain.fault_tolerance.preemption import Preempted
from faults import IndexedTask, trained_indices
from tiny import TinyTask, strategy_for, weights


def make(directory, units=4, async_save=False, keep=3, data_state=True, **layout):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units),
                              keras.layers.Dropout(0.5, seed=1)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64)
    iterator = iter(tf.data.Dataset.range(100).shuffle(10, seed=1).batch(4))
    return Checkpointer(str(directory), step, every=2, keep=keep, async_save=async_save,
                        model=model, optimizer=optimizer,
                        per_host={"iterator": iterator} if data_state else None,
                        seeds=seed_generator_states(model), **layout)


def save_at(checkpointer, step, value):
    checkpointer.step.assign(step)
    kernel = checkpointer._trackables["model"].trainable_variables[0]
    kernel.assign(tf.fill(kernel.shape, float(value)))
    return checkpointer.save()


def kernel_value(checkpointer):
    return float(checkpointer._trackables["model"].trainable_variables[0].numpy().flat[0])


def test_unlisted_newer_files_from_a_torn_write_are_never_restored(tmp_path):
    writer = make(tmp_path)
    save_at(writer, 2, 2.0)
    # What a kill mid-write leaves: data and index of step 4, the state file not updated.
    Path(tmp_path, "ckpt-4.index").write_bytes(b"\0" * 64)
    Path(tmp_path, "ckpt-4.data-00000-of-00001").write_bytes(b"\1" * 64)
    os.makedirs(tmp_path / "ckpt-4_temp")
    reader = make(tmp_path)
    assert reader.restore_latest().endswith("ckpt-2")
    assert int(reader.step.numpy()) == 2 and kernel_value(reader) == 2.0


@pytest.mark.parametrize("damage", ["truncate", "garbage_index", "lost_data"])
def test_corrupt_latest_falls_back_to_the_previous_one_with_a_warning(tmp_path, damage, caplog):
    writer = make(tmp_path)
    save_at(writer, 2, 2.0)
    latest = save_at(writer, 4, 4.0)
    data, index = Path(latest + ".data-00000-of-00001"), Path(latest + ".index")
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "garbage_index":
        index.write_bytes(b"not an sstable" * 8)
    else:
        data.unlink()
    reader = make(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert reader.restore_latest().endswith("ckpt-2")
    assert int(reader.step.numpy()) == 2 and kernel_value(reader) == 2.0
    assert any("ckpt-4 is unreadable" in r.getMessage() and "restored the older" in r.getMessage()
               for r in caplog.records)


def test_every_checkpoint_unreadable_says_what_to_delete(tmp_path):
    writer = make(tmp_path)
    latest = save_at(writer, 2, 2.0)
    Path(latest + ".index").write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match="could be read .*delete the damaged files"):
        make(tmp_path).restore_latest()


def index_steps(directory) -> list[int]:
    return sorted(int(p.name[5:-6]) for p in Path(directory).glob("ckpt-*.index"))


def test_two_checkpointers_on_one_directory_each_see_the_others_saves(tmp_path):
    """Issue: two Trainers on one model_dir in one process; the first one's manager kept
    its list from before the second one's saves and wrote it back at its next save: the
    state file dropped the intact newer checkpoints (no fallback to them, never rotated).
    A restore reads the directory again."""
    first = make(tmp_path)
    first.restore_latest()
    save_at(first, 2, 2.0)
    save_at(first, 4, 4.0)
    second = make(tmp_path)
    assert second.restore_latest().endswith("ckpt-4")
    for step in (6, 8, 10):
        save_at(second, step, float(step))
    assert first.restore_latest().endswith("ckpt-10")
    save_at(first, 12, 12.0)
    assert [p.rsplit("-", 1)[1] for p in first.checkpoints] == ["8", "10", "12"]
    assert index_steps(tmp_path) == [8, 10, 12]


def test_another_models_checkpoint_is_a_mismatch_not_corruption(tmp_path):
    save_at(make(tmp_path, units=4), 2, 2.0)
    with pytest.raises(CheckpointMismatchError, match=r"shape \[3, 4\], this model \[3, 5\]"):
        make(tmp_path, units=5).restore_latest()


def test_async_save_writes_the_state_at_save_time(tmp_path):
    writer = make(tmp_path, async_save=True, keep=2)
    for step in (2, 4, 6):
        path = save_at(writer, step, step)
        # Training goes on while the write is in flight: change everything at once.
        save_at_value = kernel_value(writer)
        writer._trackables["model"].trainable_variables[0].assign_add(
            tf.ones_like(writer._trackables["model"].trainable_variables[0]) * 100)
        writer.step.assign_add(1)
        assert save_at_value == step
    writer.sync()
    assert [os.path.basename(p) for p in writer.checkpoints] == ["ckpt-4", "ckpt-6"]
    assert not tf.io.gfile.glob(str(tmp_path / "ckpt-2.*")), "keep=2 deleted the oldest"
    reader = make(tmp_path)
    assert reader.restore_latest() == path
    assert int(reader.step.numpy()) == 6 and kernel_value(reader) == 6.0


def trainer(model_dir, strategy_replicas=2, **kwargs):
    options = dict(train_steps=8, steps_per_loop=2, global_batch_size=16, checkpoint_every=2,
                   eval_steps=1)
    options.update(kwargs)
    return tputrain.Trainer(TinyTask(dropout=0.3), str(model_dir),
                            strategy=strategy_for(strategy_replicas), **options)


def test_async_checkpoints_resume_exactly_and_survive_preemption(tmp_path):
    reference = trainer(tmp_path / "sync")
    reference.train()

    gin.bind_parameter("Checkpointer.async_save", True)
    first = trainer(tmp_path / "async", train_steps=4)
    assert first.checkpointer.async_save
    first._preemption.request()  # as if SIGTERM arrived before training: one step, then stop
    with pytest.raises(Preempted) as caught:
        first.train()
    # train() returned only after the background write finished: it is listed.
    assert caught.value.step == 1
    assert tf.train.latest_checkpoint(str(tmp_path / "async" / "checkpoints")).endswith("ckpt-1")

    resumed = trainer(tmp_path / "async")
    resumed.train()
    assert int(resumed.step.numpy()) == 8
    for a, b in zip(weights(reference), weights(resumed)):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------- damaged files and resumed configs


def _checkpoint_steps(directory) -> list[int]:
    state = tf.train.get_checkpoint_state(str(directory))
    return [int(os.path.basename(p).split("-")[1]) for p in state.all_model_checkpoint_paths]


def test_a_fallback_saves_again_at_the_damaged_step(tmp_path, caplog):
    """Issue 10.1: after falling back past a damaged latest checkpoint, the rerun's
    save at that step must really write (it returned early: the damaged one stayed
    the latest and every rerun retrained)."""
    model_dir = tmp_path / "model"
    trainer(model_dir, train_steps=4).train()
    checkpoints = model_dir / "checkpoints"
    data = checkpoints / "ckpt-4.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])

    with caplog.at_level(logging.WARNING):
        rerun = trainer(model_dir, train_steps=4)
        rerun.train()
    assert any("ckpt-4 is unreadable" in r.getMessage() for r in caplog.records)
    assert int(rerun.step.numpy()) == 4
    # The damaged files are kept aside, the fresh ckpt-4 is readable and listed.
    assert (checkpoints / "damaged" / "ckpt-4.data-00000-of-00001").exists()
    assert _checkpoint_steps(checkpoints)[-1] == 4
    tf.train.load_checkpoint(str(checkpoints / "ckpt-4"))  # raises if unreadable
    caplog.clear()
    with caplog.at_level(logging.INFO):
        third = trainer(model_dir, train_steps=4)
        third.train()
    assert not any("unreadable" in r.getMessage() for r in caplog.records)
    assert any("restored" in r.getMessage() and "(step 4)" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("content", [
    b"garbage that is not a state file", pytest.param(b"", marks=pytest.mark.slow),
    pytest.param(b"\xff\xfe binary \x00 junk", marks=pytest.mark.slow)])
def test_a_damaged_state_file_resumes_from_the_files_and_keeps_them(tmp_path, content, caplog):
    """Issue 10.2: a garbled, empty or non-UTF-8 `checkpoint` file must not restart
    training at step 0 (which rotated the good checkpoints away)."""
    model_dir = tmp_path / "model"
    trainer(model_dir, train_steps=6).train()
    checkpoints = model_dir / "checkpoints"
    before = sorted(p.name for p in checkpoints.glob("ckpt-*.index"))
    assert before == ["ckpt-2.index", "ckpt-4.index", "ckpt-6.index"]
    (checkpoints / "checkpoint").write_bytes(content)

    with caplog.at_level(logging.WARNING):
        rerun = trainer(model_dir, train_steps=8)
        rerun.train()
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "state file is damaged" in messages
    assert int(rerun.step.numpy()) == 8
    assert (checkpoints / "damaged" / "checkpoint").read_bytes() == content
    assert _checkpoint_steps(checkpoints) == [4, 6, 8]  # keep-3 rotation from 6, not from 0

    reference = trainer(tmp_path / "reference", train_steps=8)
    reference.train()
    for a, b in zip(weights(reference), weights(rerun)):
        np.testing.assert_array_equal(a, b)


def test_a_damaged_state_file_with_no_checkpoint_files_starts_over(tmp_path):
    checkpoints = tmp_path / "model" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "checkpoint").write_bytes(b"")
    run = trainer(tmp_path / "model", train_steps=2)
    run.train()
    assert _checkpoint_steps(checkpoints) == [2]


@pytest.mark.parametrize("how", [pytest.param("deleted", marks=pytest.mark.slow),
                                 "copied_without"])
def test_a_missing_state_file_resumes_from_the_newest_checkpoint_files(tmp_path, how, caplog):
    """Issue 33.1: intact `ckpt-*` files without a `checkpoint` state file are a resume
    (it started at step 0, silently, and rotated the good checkpoints away)."""
    first = tmp_path / "first"
    trainer(first, train_steps=6, strategy_replicas=1).train()
    if how == "deleted":
        model_dir = first
        (first / "checkpoints" / "checkpoint").unlink()
    else:  # a model_dir copied without its state file
        model_dir = tmp_path / "copy"
        shutil.copytree(first, model_dir, ignore=shutil.ignore_patterns("checkpoint", ".tputrain.lock"))
    checkpoints = model_dir / "checkpoints"
    assert not (checkpoints / "checkpoint").exists()
    assert sorted(p.name for p in checkpoints.glob("ckpt-*.index")) == [
        "ckpt-2.index", "ckpt-4.index", "ckpt-6.index"]

    with caplog.at_level(logging.INFO):
        rerun = trainer(model_dir, train_steps=8, strategy_replicas=1)
        rerun.train()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no checkpoint state file" in m for m in messages) == 1, messages
    assert any("training from step 6 " in m for m in messages), messages
    assert int(rerun.step.numpy()) == 8
    assert _checkpoint_steps(checkpoints) == [4, 6, 8]  # rotation goes on from 6

    reference = trainer(tmp_path / "reference", train_steps=8, strategy_replicas=1)
    reference.train()
    for a, b in zip(weights(reference), weights(rerun)):
        np.testing.assert_array_equal(a, b)


def test_a_first_save_killed_before_its_commit_starts_over_at_step_0(tmp_path, caplog):
    """Issue: kill -9 while TF wrote the first checkpoint's index left its data file, a
    0-byte `ckpt-2.index`, `ckpt-2_temp/` and no state file; every rerun exited 2 ("no
    checkpoint ... could be read"). That save was never committed: it is moved aside
    with a warning and the run starts at step 0."""
    model_dir = tmp_path / "model"
    checkpoints = model_dir / "checkpoints"
    trainer(model_dir, train_steps=2, strategy_replicas=1).train()
    (checkpoints / "checkpoint").unlink()
    (checkpoints / "ckpt-2.index").write_bytes(b"")
    (checkpoints / "ckpt-2_temp").mkdir()
    with caplog.at_level(logging.INFO):
        rerun = trainer(model_dir, train_steps=2, strategy_replicas=1)
        rerun.train()
    messages = [r.getMessage() for r in caplog.records]
    assert any("training from step 0 " in m for m in messages), messages
    assert any("ckpt-2 was never committed" in m for m in messages), messages
    assert _checkpoint_steps(checkpoints) == [2] and not (checkpoints / "ckpt-2_temp").exists()
    assert (checkpoints / "damaged" / "ckpt-2.index").read_bytes() == b""
    reference = trainer(tmp_path / "reference", train_steps=2, strategy_replicas=1)
    reference.train()
    for a, b in zip(weights(reference), weights(rerun)):
        np.testing.assert_array_equal(a, b)


def test_temp_folders_of_killed_writes_are_removed(tmp_path):
    """Issue 10.8: `ckpt-N_temp/` left by a write killed mid-way is tidied on restart."""
    model_dir = tmp_path / "model"
    trainer(model_dir, train_steps=2).train()
    leftover = model_dir / "checkpoints" / "ckpt-4_temp"
    leftover.mkdir()
    (leftover / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"\0" * 32)
    trainer(model_dir, train_steps=2).train()
    assert not leftover.exists()


def test_a_changed_learning_rate_wins_over_the_checkpoint(tmp_path, caplog):
    """Issue 10.3: the config owns the learning rate on resume (it was restored from
    the checkpoint, silently defeating "lower the learning rate")."""
    model_dir = tmp_path / "model"
    first = tputrain.Trainer(TinyTask(learning_rate=0.05), str(model_dir),
                             strategy=strategy_for(1), train_steps=2, steps_per_loop=2,
                             global_batch_size=16, checkpoint_every=2, eval_steps=1)
    first.train()
    with caplog.at_level(logging.WARNING):
        rerun = tputrain.Trainer(TinyTask(learning_rate=0.001), str(model_dir),
                                 strategy=strategy_for(1), train_steps=4, steps_per_loop=2,
                                 global_batch_size=16, checkpoint_every=2, eval_steps=1)
        rerun.train()
    assert float(rerun.optimizer.learning_rate.numpy()) == pytest.approx(0.001)
    assert any("learning_rate" in r.getMessage() and "using the config's" in r.getMessage()
               for r in caplog.records)
    # The optimizer's slots and step still come from the checkpoint.
    assert int(rerun.optimizer.iterations.numpy()) == 4



def test_a_learning_rate_set_between_train_calls_is_kept(tmp_path):
    """A script that lowers the learning rate on a live Trainer between two train()
    calls trains on at that rate: the next train()'s restore of its own last
    checkpoint (which holds the old rate) does not silently put the old one back."""
    run = tputrain.Trainer(TinyTask(learning_rate=0.05), str(tmp_path / "model"),
                           strategy=strategy_for(1), train_steps=4, steps_per_loop=2,
                           global_batch_size=16, checkpoint_every=2, eval_steps=1)
    run.train(num_steps=2)
    run.optimizer.learning_rate.assign(0.001)
    run.train(num_steps=2)
    assert float(run.optimizer.learning_rate.numpy()) == pytest.approx(0.001)
    assert run.current_step == 4

def test_large_finite_weights_are_saved(tmp_path):
    """The save check is element by element: weights whose float32 sum overflows are
    finite (the guard's sum-based gradient check would call them non-finite)."""
    checkpointer = make(tmp_path)
    assert save_at(checkpointer, 2, 3e38).endswith("ckpt-2")
    assert checkpointer.all_finite()


# ------------------------------------------- resumed on another replica count


def tiny_trainer(model_dir, replicas, **kwargs):
    options = dict(train_steps=4, steps_per_loop=2, global_batch_size=16, checkpoint_every=4,
                   eval_steps=1, report_mfu=False)
    options.update(kwargs)
    return tputrain.Trainer(TinyTask(), str(model_dir), strategy=strategy_for(replicas),
                            **options)


def checkpoint_files(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in Path(directory).iterdir() if path.is_file()}


def test_resume_on_two_replicas_of_a_one_replica_run_skips_to_its_step(tmp_path, caplog):
    """The checkpointed iterator was built for 1 replica's batches and cannot feed 2:
    the weights, optimizer slots and step are restored, the input is rebuilt and the
    examples of the steps done skipped, and one warning line says so. The training
    then matches an uninterrupted 1-replica run; the checkpoint is left as it was."""
    reference = tiny_trainer(tmp_path / "reference", 1, train_steps=8)
    reference.train()
    model_dir = tmp_path / "model"
    tiny_trainer(model_dir, 1).train()
    written = checkpoint_files(model_dir / "checkpoints")

    resumed = tiny_trainer(model_dir, 2, train_steps=8)
    with caplog.at_level(logging.WARNING):
        resumed.train()
    assert resumed.current_step == 8
    assert int(resumed.optimizer.iterations.numpy()) == 8  # the slots' step came back too
    for a, b in zip(weights(reference), weights(resumed)):  # only the sums' order differs
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "replica" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert all(words in warnings[0] for words in
               ("ckpt-4", "1 replica", "2 replicas", "skipped", "64 examples")), warnings[0]
    after = checkpoint_files(model_dir / "checkpoints")
    assert {name: after[name] for name in written if name != "checkpoint"} == \
        {name: data for name, data in written.items() if name != "checkpoint"}
    assert not (model_dir / "checkpoints" / "damaged").exists()


# slow tier: tests/jobs/test_diagnose.py's steps_per_fetch resume covers stacked fetches by default
@pytest.mark.slow
def test_changing_between_direct_and_stacked_fetches_resumes_bitwise(tmp_path, caplog):
    """One replica fetching one step at a time reads the task's batches as built
    ("direct"); steps_per_fetch=2 stacks them ("stacked"), another iterator structure.
    Each resume across the two rebuilds the input and skips to the step, and the run
    ends bitwise where an uninterrupted one does."""
    reference = tiny_trainer(tmp_path / "reference", 1, train_steps=12)
    reference.train()
    model_dir = tmp_path / "model"
    first = tiny_trainer(model_dir, 1)
    assert first.inputs.layout().fetch == "direct"
    first.train()
    stacked = tiny_trainer(model_dir, 1, steps_per_fetch=2, train_steps=8)
    assert stacked.inputs.layout().fetch == "stacked"
    resumed = tiny_trainer(model_dir, 1, train_steps=12)
    with caplog.at_level(logging.WARNING):
        stacked.train()
        resumed.train()
    assert resumed.current_step == 12
    assert all(np.array_equal(a, b) for a, b in zip(weights(reference), weights(resumed)))
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "skipped" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "ckpt-4" in warnings[0] and "global batch 16 (batches fetched as built), this run " \
        "has 1 replica on 1 host, global batch 16 (batches stacked per fetch):" in warnings[0]
    assert "ckpt-8" in warnings[1] and "global batch 16 (batches stacked per fetch), this run " \
        "has 1 replica on 1 host, global batch 16 (batches fetched as built):" in warnings[1]


def test_input_layout_json_without_fetch_is_a_stacked_one():
    """Checkpoints written before `InputLayout.fetch` existed stacked every fetch."""
    old = '{"accumulation": 1, "global_batch": 16, "hosts": 1, "replicas": 1}'
    assert InputLayout.from_json(old) == InputLayout(1, 1, 16, fetch="stacked")
    direct = InputLayout(replicas=1, hosts=1, global_batch=16, fetch="direct")
    assert InputLayout.from_json(direct.to_json()) == direct
    # Nor a start: their examples consumed are step x global batch.
    assert InputLayout.from_json(old).examples(5) == 80
    started = InputLayout(1, 1, 16, start_step=3, start_examples=60)
    assert InputLayout.from_json(started.to_json()) == started and started.examples(5) == 92


BUILT = " (read from its start and skipped, or built there by a positional input)"


def test_a_host_count_change_is_added_to_the_layouts_host_history():
    """What a positional input replays (InputContext.layout_history): each host count
    and the examples consumed when it took over; a batch change adds nothing."""
    from tputrain.checkpointing.input_layout import LayoutChange
    two = InputLayout(2, 2, 64)
    assert two.history() == ((0, 2),)
    three = LayoutChange("ckpt-3", 3, two, InputLayout(3, 3, 48)).continued()
    # The third field: the change deals fresh windows by load (tputrain.data.ledger).
    assert three.history() == ((0, 2), (192, 3, 1)) and three.start_examples == 192
    one = LayoutChange("ckpt-7", 7, three, InputLayout(1, 1, 96)).continued()
    assert one.history() == ((0, 2), (192, 3, 1), (384, 1, 1))
    # A checkpoint written before that field replays its changes as it ran them.
    older = InputLayout(1, 1, 96, start_examples=384, host_history="0:2,192:3,384:1")
    assert InputLayout.from_json(older.to_json()).history() == ((0, 2), (192, 3), (384, 1))
    assert InputLayout.from_json(one.to_json()) == one and one.split() == InputLayout(1, 1, 96)
    batch = LayoutChange("ckpt-9", 9, one, InputLayout(1, 1, 32)).continued()
    assert batch.history() == one.history()


def indexed_trainer(model_dir, replicas, global_batch_size, train_steps, **kwargs):
    options = dict(steps_per_loop=2, checkpoint_every=2, eval_steps=1, report_mfu=False,
                   jit_compile=False, steps_per_program=1)  # py_function records in the step
    options.update(kwargs)
    return tputrain.Trainer(IndexedTask(str(Path(model_dir).parent / "seen")), str(model_dir),
                            strategy=strategy_for(replicas), global_batch_size=global_batch_size,
                            train_steps=train_steps, **options)


@pytest.mark.slow
@pytest.mark.parametrize("input_mode", ["host", "distributed"])
def test_changed_replicas_and_global_batch_continue_from_the_examples_consumed(
        tmp_path, caplog, input_mode):
    """Issue 33 item 8: 1 -> 2 replicas, then a doubled global batch, then one that does
    not divide the examples consumed, each resumed (a same-layout resume between)
    with the step and optimizer continuing and the input read past the examples
    consumed: from the indices trained on, none twice and none left out but the
    documented round-up to the next whole batch. Replaces the tests that these
    global-batch changes were refused."""
    model_dir = tmp_path / "model"
    segments = [(1, 16, 3), (2, 16, 6), (2, 32, 7), (2, 32, 8), (2, 24, 10)]
    for replicas, batch, steps in segments:
        run = indexed_trainer(model_dir, replicas, batch, steps, input_mode=input_mode)
        with caplog.at_level(logging.WARNING):
            run.train()
        assert run.current_step == steps and int(run.optimizer.iterations.numpy()) == steps
    # 3 x 16 + 3 x 16 + 2 x 32 = 160 examples; 160 is not a multiple of 24: the input
    # resumes at the 7th batch of 24 (168), and examples 160-167 are never trained on.
    assert trained_indices(tmp_path / "seen") == list(range(160)) + list(range(168, 216))
    lines = [r.getMessage() for r in caplog.records if "examples consumed" in r.getMessage()]
    assert len(lines) == 3, lines
    assert all(words in lines[0] for words in (
        "ckpt-3", "1 replica on 1 host, global batch 16", "2 replicas on 1 host, global batch 16",
        "resumes past 3 steps of 16 examples" + BUILT + ": the 48 examples consumed (exact")), \
        lines[0]
    assert "ckpt-6" in lines[1] and "resumes past 3 steps of 32 examples" + BUILT + \
        ": the 96 examples consumed (exact" in lines[1] and "a step is now 32 examples (was 16)" in lines[1]
    assert "ckpt-8" in lines[2] and "resumes past 7 steps of 24 examples" + BUILT + \
        ": the 160 examples consumed and the next 8 (to a whole batch of this run; never trained on)" in lines[2]
    reader = tf.train.load_checkpoint(str(model_dir / "checkpoints" / "ckpt-10"))
    recorded = InputLayout.from_json(reader.get_tensor("input_layout/.ATTRIBUTES/VARIABLE_VALUE"))
    assert (recorded.global_batch, recorded.start_step, recorded.start_examples) == (24, 8, 168)
    assert recorded.examples(10) == 216


def test_without_data_state_other_hosts_and_batches_restore_at_the_examples_consumed(
        tmp_path, caplog):
    """Checkpointer level, as input_mode="distributed" uses it (no iterator saved):
    another host count restores with one line saying the position is exact only for
    inputs sharded by example; another global batch (refused before) restores with the
    input position rounded up to its whole batches, and that start is carried on by
    the next checkpoint and resume under the same layout."""
    one = InputLayout(replicas=1, hosts=1, global_batch=16)
    save_at(make(tmp_path, data_state=False, input_layout=one), 2, 2.0)
    two_hosts = InputLayout(replicas=2, hosts=2, global_batch=16)
    restored = make(tmp_path, data_state=False, input_layout=two_hosts)
    with caplog.at_level("WARNING"):
        assert restored.restore_latest().endswith("ckpt-2")
    assert kernel_value(restored) == 2.0 and restored.recorded_layout.input_steps(2) == 2
    warnings = [r.getMessage() for r in caplog.records if "examples consumed" in r.getMessage()]
    assert len(warnings) == 1 and "1 replica on 1 host" in warnings[0], warnings
    assert "the 32 examples consumed (the input was split into 1 host shard(s), now 2: " \
        "exact only where each host reads every n-th example" in warnings[0], warnings[0]

    other_batch = InputLayout(replicas=1, hosts=1, global_batch=12)
    resized = make(tmp_path, data_state=False, input_layout=other_batch)
    assert resized.restore_latest().endswith("ckpt-2") and kernel_value(resized) == 2.0
    assert resized.recorded_layout == dataclasses.replace(other_batch, start_step=2,
                                                          start_examples=36)
    assert resized.recorded_layout.input_steps(2) == 3  # 32 examples: 3 batches of 12
    save_at(resized, 4, 4.0)
    again = make(tmp_path, data_state=False, input_layout=other_batch)
    assert again.restore_latest().endswith("ckpt-4") and kernel_value(again) == 4.0
    assert again.recorded_layout.input_steps(4) == 5 and again.recorded_layout.examples(4) == 60


def test_input_layouts_old_checkpoints_hosts_and_no_reposition(tmp_path):
    """Checkpointer level: a checkpoint without a layout (written before layouts were
    recorded) restores exactly and the next save records one; a replica change
    without `reposition` is refused; with it (or another host count), the iterator is
    not restored and `reposition` gets the change."""
    one = InputLayout(replicas=1, hosts=1, global_batch=16)
    old = make(tmp_path / "old")
    next(old._trackables["iterator"])
    save_at(old, 2, 2.0)
    reader = make(tmp_path / "old", input_layout=one)
    assert reader.restore_latest().endswith("ckpt-2") and kernel_value(reader) == 2.0
    assert int(next(reader._trackables["iterator"])[0]) == int(next(old._trackables["iterator"])[0])
    save_at(reader, 4, 4.0)
    assert tf.train.load_checkpoint(str(tmp_path / "old" / "ckpt-4")).has_tensor(
        "input_layout/.ATTRIBUTES/VARIABLE_VALUE")

    writer = make(tmp_path / "new", input_layout=one)
    next(writer._trackables["iterator"])
    save_at(writer, 2, 2.0)
    two_hosts = InputLayout(replicas=2, hosts=2, global_batch=16)
    hosts_changes = []
    make(tmp_path / "new", input_layout=two_hosts,
         reposition=hosts_changes.append).restore_latest()  # refused before issue 33
    assert [(c.step, c.consumed, c.resume_steps) for c in hosts_changes] == [(2, 32, 2)]
    two = InputLayout(replicas=2, hosts=1, global_batch=16)
    with pytest.raises(InputLayoutError, match="cannot move its data position"):
        make(tmp_path / "new", input_layout=two).restore_latest()
    changes = []
    moved = make(tmp_path / "new", input_layout=two, reposition=changes.append)
    assert moved.restore_latest().endswith("ckpt-2") and kernel_value(moved) == 2.0
    assert [(c.step, c.saved, c.now) for c in changes] == [(2, one, two)]
    first = next(iter(tf.data.Dataset.range(100).shuffle(10, seed=1).batch(4)))
    np.testing.assert_array_equal(next(moved._trackables["iterator"]), first)  # not restored


@pytest.mark.parametrize("async_save", [False, True])
def test_a_worker_saving_to_scratch_logs_no_temporary_path(tmp_path, caplog, async_save):
    """A non-chief worker writes its part of each save to a scratch directory that is
    deleted at its end (issue 52): its log names no such path, and its save returns the
    chief's checkpoint; the chief's log names the checkpoint."""
    scratch, chief = tmp_path / "tputrain-worker-x" / "checkpoints", tmp_path / "model" / "checkpoints"
    with caplog.at_level(logging.INFO):
        worker = make(scratch, async_save=async_save, data_state=False,
                      restore_directory=str(chief))
        path = save_at(worker, 2, 2.0)
        worker.sync()
    assert os.listdir(scratch)  # it wrote its part
    assert path == f"{chief}/ckpt-2"  # the checkpoint (a preemption's line names it)
    worker_lines = [r.getMessage() for r in caplog.records]
    assert not [line for line in worker_lines if str(scratch) in line], worker_lines
    caplog.clear()
    with caplog.at_level(logging.INFO):
        owner = make(chief, async_save=async_save, data_state=False)
        save_at(owner, 2, 2.0)
        owner.sync()
    assert any(f"saved checkpoint {chief}/ckpt-2" in r.getMessage() for r in caplog.records)


def test_another_optimizer_on_resume_is_named_as_the_optimizer(tmp_path):
    """A run resumed with SGD(momentum) where it trained with Adam was refused listing
    "hidden_0_bias_momentum: checkpoint has shape [64, 256], this model [256]": the
    slots paired by position and named after this run's variables, as if the model
    had changed. The message says first that the optimizer differs, and how."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    text = _mismatch(tmp_path, model, keras.optimizers.Adam(), model,
                     keras.optimizers.SGD(momentum=0.9))
    assert text.startswith("the optimizer differs from the checkpoint's"), text
    assert "8 variables" in text and "4" in text, text


def test_a_changed_model_is_not_blamed_on_the_optimizer(tmp_path):
    """The same optimizer over a model with another layer has other slots too: the
    message lists the model's change and does not say the optimizer differs."""
    small = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    large = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    text = _mismatch(tmp_path, small, keras.optimizers.Adam(), large, keras.optimizers.Adam())
    assert text and "optimizer differs" not in text, text


def test_another_optimizer_with_the_same_slots_is_refused_on_resume(tmp_path):
    """Adam's checkpoint resumed with LAMB (the same two slots per weight) restored
    silently: Adam's moments went into LAMB's slots. The optimizer's variables are
    named after it in the checkpoint (`adam/iteration`), so the change is found."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    text = _mismatch(tmp_path, model, keras.optimizers.Adam(), model, keras.optimizers.Lamb())
    assert text.startswith("the optimizer differs from the checkpoint's"), text
    assert "'adam'" in text and "'lamb'" in text, text
    assert _mismatch(tmp_path, model, keras.optimizers.Adam(), model,
                     keras.optimizers.Adam()) == ""


def _mismatch(tmp_path, saved_model, saved_optimizer, model, optimizer) -> str:
    """`describe_mismatch` of a checkpoint of (saved_model, saved_optimizer) read by
    (model, optimizer), each optimizer built for its model."""
    from tputrain.checkpointing.integrity import describe_mismatch
    saved_optimizer.build(saved_model.trainable_variables)
    optimizer.build(model.trainable_variables)
    path = tf.train.Checkpoint(model=saved_model, optimizer=saved_optimizer).write(
        str(tmp_path / "ckpt"))
    return describe_mismatch(tf.train.Checkpoint(model=model, optimizer=optimizer), path)
