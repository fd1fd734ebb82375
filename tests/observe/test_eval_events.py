"""The eval run's events (tputrain.observe.eval_events): an evaluation out of step order hides
no later point in TensorBoard's default view, and reruns do not pile copies up."""

from __future__ import annotations

import collections
import itertools
import time
import types

import pytest
from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.scalar import summary as scalar_summary
from tensorboard.summary.writer import event_file_writer

import tputrain
from tiny import TinyTask, strategy_for
from tputrain.observe.eval_events import EvalEventWriter, event_files, read_events, run_state
from tputrain.jobs.sidecar import ReadOnlyTrainer, evaluate_checkpoints


def summary(**scalars: float) -> summary_pb2.Summary:
    result = summary_pb2.Summary()
    for name, value in scalars.items():
        result.value.extend(scalar_summary.scalar_pb(name, value).value)
    return result


def copies(directory) -> dict[tuple[str, int], int]:
    """How many events hold each (tag, step) in the run, over all its files."""
    counted: collections.Counter = collections.Counter()
    for path in event_files(str(directory)):
        for event in read_events(path):
            for value in event.summary.value:
                counted[(value.tag, event.step)] += 1
    return dict(counted)


def visible(directory) -> dict[str, list[int]]:
    state = run_state(str(directory))
    return {tag: sorted(steps) for tag, steps in state.visible.items()}


_LATER = itertools.count(1)


def write(directory, monkeypatch, *points: tuple[int, float]) -> None:
    """One process's evaluations (a training run, or `tputrain eval --step`), its event
    file named for a later second than the ones before, as another process's is (two
    files made by one process in one second sort by a counter, as text: 10 < 9)."""
    offset = 10.0 * next(_LATER)
    with monkeypatch.context() as patch:
        patch.setattr(event_file_writer, "time",
                      types.SimpleNamespace(time=lambda: time.time() + offset))
        writer = EvalEventWriter(str(directory))
        for step, value in points:
            writer.write(step, summary(loss=value))
        writer.close()


def test_a_lower_step_is_restated_once_and_its_reruns_write_nothing(tmp_path, monkeypatch):
    """Issue 50.7: each rerun of `tputrain eval --step=4` restated the later points
    again (three copies after two reruns, seen by EventAccumulator, `--load_fast=false`
    and pandas exports); a point already shown as it is is not written again."""
    run = tmp_path / "eval"
    write(run, monkeypatch, (2, 0.9), (4, 0.8), (6, 0.7), (8, 0.6))  # the training run
    write(run, monkeypatch, (4, 0.75))  # an evaluation of step 4 that reads another value
    assert visible(run) == {"loss": [2, 4, 6, 8]}
    once = copies(run)
    assert once == {("loss", 2): 1, ("loss", 4): 2, ("loss", 6): 2, ("loss", 8): 2}
    for _ in range(2):  # reruns: the same evaluation, the same value
        write(run, monkeypatch, (4, 0.75))
    assert copies(run) == once and visible(run) == {"loss": [2, 4, 6, 8]}
    write(run, monkeypatch, (6, 0.7))  # the training run's own point, as it is shown
    assert copies(run) == once


def test_eval_step_reruns_of_a_trained_run_add_no_copies(tmp_path):
    """Issue 50.7 end to end: `tputrain eval --step=4` (the side-car's evaluation of
    one checkpoint) run three times after training; the default view keeps every
    step and no (tag, step) is held by more than two events."""
    options = dict(train_steps=8, steps_per_loop=2, global_batch_size=16, eval_every=2,
                   eval_steps=2, checkpoint_every=2, keep_checkpoints=10, report_mfu=False)
    model_dir = tmp_path / "run"
    tputrain.Trainer(TinyTask(), str(model_dir), strategy=strategy_for(1), **options).train()
    counts = []
    for _ in range(3):
        reader = ReadOnlyTrainer(TinyTask(), str(model_dir), strategy=strategy_for(1), **options)
        assert list(evaluate_checkpoints(reader, step=4)) == [4]
        counts.append(copies(model_dir / "eval"))
    assert counts[0] == counts[1] == counts[2], counts
    assert max(counts[-1].values()) <= 2, counts[-1]
    assert set(visible(model_dir / "eval")["loss"]) == {2, 4, 6, 8}
