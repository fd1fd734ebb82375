"""Tests for tputrain.diagnose, `tputrain diagnose`, and the input-stall measurement.

The stall each training loop logs (`Progress`) and `Trainer.steps_per_fetch`
are tested here too: they are what diagnose reports. Slow inputs and slow
steps sleep (`tf.py_function`), so the outcome does not depend on how busy the
host is.
"""

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import TinyTask, strategy_for, weights
from tputrain.data import InputOptions
from tputrain.diagnose import Diagnosis, _advice, diagnose

ROOT = Path(__file__).resolve().parent.parent


class SleepyTask(TinyTask):
    """TinyTask whose train batches each take `sleep` seconds to make."""

    def __init__(self, sleep: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.sleep = sleep

    def build_inputs(self, split, input_context):
        dataset = super().build_inputs(split, input_context)
        if split != "train" or not self.sleep:
            return dataset

        def slow(features, label):
            waited = tf.py_function(lambda: time.sleep(self.sleep) or 0.0, [], tf.float32)
            waited.set_shape([])
            return {"x": features["x"] + 0.0 * waited}, label

        # A py_function cannot be saved with the iterator: "warn" saves the rest.
        return dataset.map(slow).with_options(
            InputOptions(external_state_policy="warn").tf_options())


class SlowStepTask(TinyTask):
    """TinyTask whose every step takes `sleep` seconds more (in its loss): compute-bound
    however busy the host is, its input coming from memory."""

    def __init__(self, sleep: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.sleep = sleep

    def compute_loss(self, labels, outputs):
        waited = tf.py_function(lambda: time.sleep(self.sleep) or 0.0, [], tf.float32)
        waited.set_shape([])
        return super().compute_loss(labels, outputs) + 0.0 * waited


def _trainer(tmp_path, task, replicas=1, name="run", **kwargs):
    options = dict(train_steps=8, steps_per_loop=4, global_batch_size=16, checkpoint_every=4,
                   report_mfu=False)
    options.update(kwargs)
    return tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(replicas), **options)


def _scalars(directory, tag):
    values = []
    for path in sorted(tf.io.gfile.glob(os.path.join(directory, "train", "events.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    values.append((event.step, float(tf.make_ndarray(value.tensor))))
    return values


# The stall fraction in every training loop.


def test_stall_fraction_is_logged_and_summarised_each_loop(tmp_path, caplog):
    trainer = _trainer(tmp_path, SleepyTask(sleep=0.02), name="slow", train_steps=12,
                       checkpoint_every=12)
    with caplog.at_level(logging.INFO):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if "input stall" in r.getMessage()]
    assert len(lines) == 3  # one per loop of 4 steps
    stalls = _scalars(str(tmp_path / "slow"), "input/stall_fraction")
    assert [step for step, _ in stalls] == [4, 8, 12]
    assert all(f"input stall {100 * value:.1f}%" in line for (_, value), line in zip(stalls, lines))
    # 20 ms of sleep per batch against a sub-millisecond step: mostly waiting (the first
    # loop's wall time also holds the tracing of the loop, so it is not counted here).
    assert all(0.5 < value <= 1.0 for _, value in stalls[1:])



# Trainer.steps_per_fetch: several steps' batches per get_next.


def test_steps_per_fetch_trains_and_resumes_bitwise_the_same(tmp_path):
    """Two replicas, dropout: 8 steps fetched one by one equal 4 + 4 steps fetched 4 at a
    time with a resume from the checkpoint at step 4 in between."""
    options = dict(train_steps=8, eval_steps=1)
    one = _trainer(tmp_path, TinyTask(dropout=0.2), 2, "k1", **options)
    one.train()
    for train_steps in (4, 8):
        four = _trainer(tmp_path, TinyTask(dropout=0.2), 2, "k4", steps_per_fetch=4,
                        **{**options, "train_steps": train_steps})
        four.train()
    assert int(four.step.numpy()) == 8
    assert all(np.array_equal(a, b) for a, b in zip(weights(one), weights(four)))


def test_steps_per_fetch_errors_name_the_fix(tmp_path):
    # A fetch that does not divide a loop boundary shrinks to the largest one that does.
    assert _trainer(tmp_path, TinyTask(), name="gcd", steps_per_fetch=6).steps_per_fetch == 2
    with pytest.raises(ValueError, match="steps_per_fetch must be an int >= 1"):
        _trainer(tmp_path, TinyTask(), steps_per_fetch=0)
    with pytest.raises(ValueError, match="needs input_mode='host'"):
        _trainer(tmp_path, TinyTask(), steps_per_fetch=2, input_mode="distributed")
    _trainer(tmp_path, TinyTask(), name="at6", train_steps=6, steps_per_loop=3,
             checkpoint_every=3).train()
    with pytest.raises(ValueError, match="at step 6, not a multiple of Trainer.steps_per_fetch=4"):
        _trainer(tmp_path, TinyTask(), name="at6", train_steps=12, steps_per_fetch=4).train()


# diagnose: three throughputs, the stall, the bottleneck and the advice.


def test_advice_names_the_knobs():
    reason, advice = _advice("compute", 900.0, 100.0, 0.01, "host")
    assert "keeps up" in reason and any("mixed_bfloat16" in a for a in advice)
    reason, advice = _advice("input", 50.0, 100.0, 0.5, "host")
    assert "alone delivers 50.0 steps/s" in reason
    text = " ".join(advice)
    for knob in ("num_parallel_calls", "cycle_length", "cache='memory'", "InputOptions.prefetch",
                 "service_address", "write_tfrecords"):
        assert knob in text
    reason, advice = _advice("input", 900.0, 100.0, 0.2, "host")
    assert "compete for the host's cores" in reason
    assert any("threadpool_size" in a for a in advice)
    assert any("Trainer.steps_per_fetch" in a for a in advice)


def test_diagnose_finds_a_slow_input_pipeline(tmp_path):
    trainer = _trainer(tmp_path, SleepyTask(sleep=0.01), train_steps=100, steps_per_loop=4)
    result = diagnose(trainer, seconds=0.3)
    assert result.bottleneck == "input" and result.stall_fraction > 0.5
    assert result.input_only_steps_per_second < result.compute_only_steps_per_second
    assert result.end_to_end_steps_per_second < 0.5 * result.compute_only_steps_per_second
    assert result.measured_input_wait_fraction > 0.5
    assert "alone delivers" in result.reason
    json.dumps(result.to_json())  # --json prints exactly this


def test_diagnose_names_a_compute_bound_job_compute_bound(tmp_path):
    """The step (100 ms: far longer than a busy host's scheduling delays) is the
    bottleneck; the in-memory input is not."""
    trainer = _trainer(tmp_path, SlowStepTask(sleep=0.1), train_steps=100, steps_per_loop=4,
                       steps_per_fetch=2)
    result = diagnose(trainer, seconds=0.4)
    assert isinstance(result, Diagnosis)
    assert result.loop_steps % 2 == 0  # whole fetches of steps_per_fetch=2
    for rate in (result.input_only_steps_per_second, result.compute_only_steps_per_second,
                 result.end_to_end_steps_per_second):
        assert rate > 0
    assert 0.0 <= result.stall_fraction <= 1.0
    assert result.bottleneck == "compute" and "keeps up" in result.reason
    assert result.input_only_steps_per_second > result.compute_only_steps_per_second
    assert any("mixed_bfloat16" in a for a in result.advice)
    assert "stall fraction" in result.report() and "bottleneck" in result.report()
    assert not os.path.exists(tmp_path / "run" / "checkpoints" / "checkpoint")  # nothing saved


def test_cli_names_the_input_bottleneck_of_slow_input_gin():
    """As documented: `python -m tputrain.diagnose` from the repository root, where
    slow_input.gin's `import examples.slow_input` finds its task."""
    result = subprocess.run(
        [sys.executable, "-m", "tputrain.diagnose", "--gin_file=slow_input.gin", "--json",
         "--seconds=0.3", "--gin_param=SlowInputTask.work=1000",
         "--gin_param=Trainer.steps_per_loop=5", "--gin_param=Trainer.eval_every=None"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["bottleneck"] == "input" and report["stall_fraction"] > 0.5
    assert report["gin_file"] == ["slow_input.gin"]
    assert set(report["seconds"]) >= {"build", "total", "input_only"}
