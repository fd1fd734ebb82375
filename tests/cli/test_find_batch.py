"""Tests for tputrain.find_batch and `tputrain find-batch`.

Out of memory is injected: a task whose loss raises `ResourceExhaustedError`
when traced for a per-replica batch at or above a limit, as XLA does when a
program does not fit (the finder compiles each batch through the Trainer's own
step, so the error comes from where a real one would).
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from faults import child_env
from tiny import TinyTask
from tputrain.jobs.batch_finder import FindBatchResult, Trial, find_batch, is_out_of_memory
from tputrain.optim.schedules import scale_learning_rate

ROOT = Path(__file__).resolve().parents[2]
# The climb is what these tests check: tf.function steps compile in a fraction of
# XLA's time (the CLI test runs the default XLA step).
QUICK = {"steps_per_loop": 2, "jit_compile": False, "steps_per_program": 1}


class OutOfMemoryTask(TinyTask):
    """TinyTask whose step does not "fit" from a per-replica batch of `limit` up."""

    def __init__(self, limit: int, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def compute_loss(self, labels, outputs):
        if labels.shape[0] is not None and labels.shape[0] >= self.limit:
            raise tf.errors.ResourceExhaustedError(
                None, None, f"Out of memory allocating a batch of {labels.shape[0]}")
        return super().compute_loss(labels, outputs)


# slow tier: the climb's other default tests cover the suggestion
@pytest.mark.slow
def test_out_of_memory_ends_the_climb_and_the_largest_batch_that_fit_is_suggested(tmp_path):
    task = OutOfMemoryTask(limit=22, num_examples=512)
    result = find_batch(task, tf.distribute.OneDeviceStrategy("/cpu:0"), global_batch_size=4,
                        learning_rate=0.1, min_gain=None, resolution=2, seconds=0.05,
                        **QUICK)
    tried = [(trial.per_replica_batch, trial.fits) for trial in result.trials]
    # Doubling from 4 to the first failure (32), then bisecting 16..32 to 2.
    assert tried == [(4, True), (8, True), (16, True), (32, False), (24, False), (20, True),
                     (22, False)]
    assert result.suggested.per_replica_batch == 20 and result.suggested.global_batch == 20
    assert "out of memory" in result.stop_reason and "22" in result.stop_reason
    assert all(t.examples_per_second > 0 for t in result.trials if t.fits)
    assert list(tmp_path.iterdir()) == []  # nothing written (the Trainers use temp dirs)


class SmallDataTask(TinyTask):
    """TinyTask whose input refuses a per-replica batch above `limit`."""

    def __init__(self, limit: int, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def build_inputs(self, split, input_context):
        if input_context.get_per_replica_batch_size(input_context.global_batch_size) > self.limit:
            raise ValueError(f"more than the {self.limit} examples the data holds")
        return super().build_inputs(split, input_context)


def test_another_error_at_a_larger_batch_is_a_limit_named_in_the_stop_reason():
    result = find_batch(SmallDataTask(limit=8), tf.distribute.OneDeviceStrategy("/cpu:0"),
                        global_batch_size=8, learning_rate=0.1, min_gain=None, resolution=8,
                        seconds=0.05, **QUICK)
    assert [(t.per_replica_batch, t.fits) for t in result.trials] == [(8, True), (16, False)]
    assert result.suggested.per_replica_batch == 8
    assert "the 8 examples the data holds" in result.stop_reason


def test_a_data_limit_ends_the_climb_without_bisecting_toward_it():
    """Bisection is for memory: a batch near the whole data set is no suggestion."""
    result = find_batch(SmallDataTask(limit=20), tf.distribute.OneDeviceStrategy("/cpu:0"),
                        global_batch_size=8, learning_rate=0.1, min_gain=None, resolution=4,
                        seconds=0.05, **QUICK)
    assert [(t.per_replica_batch, t.fits) for t in result.trials] == [
        (8, True), (16, True), (32, False)]
    assert result.suggested.per_replica_batch == 16
    assert "the 20 examples the data holds" in result.stop_reason


def test_max_batch_bounds_the_climb_on_two_replicas():
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())
    result = find_batch(TinyTask(num_examples=512), strategy, global_batch_size=8,
                        learning_rate=0.1, max_batch=16, min_gain=None, seconds=0.05,
                        **QUICK)
    assert [(t.per_replica_batch, t.global_batch) for t in result.trials] == [(4, 8), (8, 16),
                                                                            (16, 32)]
    assert result.suggested.global_batch == 32 and "max_batch" in result.stop_reason


def _result(rates: list[tuple[int, float]], stop: str = "max_batch 64") -> FindBatchResult:
    trials = [Trial(b, b, rate, None, None) for b, rate in rates]
    return FindBatchResult(trials=trials, stop_reason=stop, replicas=1, global_batch_size=32,
                           learning_rate=0.001, train_steps=1000, min_gain=0.05)


def test_learning_rate_rules_against_hand_computed_values():
    # Configured: global batch 32 at 0.001; the finder suggests 128 (4x).
    result = _result([(32, 100.0), (64, 190.0), (128, 300.0)])
    assert result.suggested.global_batch == 128
    assert result.learning_rate_for("linear") == pytest.approx(0.004)
    assert result.learning_rate_for("sqrt") == pytest.approx(0.002)
    assert scale_learning_rate(0.1, 512, 256, rule="sqrt") == pytest.approx(0.1414213562)
    assert scale_learning_rate(0.1, 512, 256, rule="linear") == pytest.approx(0.2)
    lines = result.suggestion("sqrt")
    assert "Trainer.global_batch_size = 128" in lines
    assert "warmup_schedule.learning_rate = 0.002" in lines
    assert "Trainer.train_steps = 250" in lines  # the same examples: 1000 x 32 / 128
    assert "warmup_schedule.warmup_steps = 13" in lines  # 5% of 250, rounded up
    with pytest.raises(ValueError, match="learning-rate rule .cubic."):
        result.learning_rate_for("cubic")


def test_no_schedule_is_suggested_when_the_rate_needs_no_warmup():
    """A suggestion no larger than the configured batch needs no warmup: a constant
    schedule with warmup_steps = 0 would restate the rate (issue 52 drift)."""
    same = _result([(32, 100.0), (64, 100.5)], stop="gain")
    assert same.suggested.global_batch == 32
    lines = same.suggestion("linear")
    assert not [line for line in lines if "warmup_schedule" in line], lines
    assert "build_optimizer.learning_rate = 0.001" not in lines  # unchanged: not restated
    smaller = _result([(16, 100.0), (32, 60.0, )], stop="gain")
    smaller.min_gain = None
    smaller.trials[1].error = "OOM"
    lines = smaller.suggestion("linear")
    assert "Trainer.global_batch_size = 16" in lines
    assert "build_optimizer.learning_rate = 0.0005" in lines
    assert not [line for line in lines if "warmup_schedule" in line], lines


def test_a_doubling_that_buys_less_than_min_gain_is_not_suggested():
    result = _result([(32, 100.0), (64, 180.0), (128, 183.0)], stop="gain")
    assert result.suggested.global_batch == 64


def test_out_of_memory_is_recognised_in_xla_messages():
    assert is_out_of_memory(tf.errors.ResourceExhaustedError(None, None, "OOM"))
    assert is_out_of_memory(tf.errors.InternalError(
        None, None, "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory "
        "in memory space hbm."))
    assert not is_out_of_memory(tf.errors.InternalError(None, None, "a NaN"))
    assert not is_out_of_memory(ValueError("Out of memory"))


@pytest.mark.parametrize("start", [0, -4])
def test_a_non_positive_start_batch_is_refused(start):
    with pytest.raises(ValueError, match="start_batch"):
        find_batch(TinyTask(), tf.distribute.OneDeviceStrategy("/cpu:0"), start_batch=start)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tputrain.cli", "find-batch", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=child_env())

@pytest.mark.slow

def test_cli_prints_the_table_and_the_suggestion_and_writes_nothing(tmp_path):
    model_dir = tmp_path / "run"
    result = _cli("--gin_file=synthetic_transformer.gin", f"--model_dir={model_dir}",
                  "--gin_param=SyntheticLMTask.width=16", "--gin_param=SyntheticLMTask.num_layers=1",
                  "--gin_param=SyntheticLMTask.sequence_length=8",
                  "--gin_param=Trainer.global_batch_size=4", "--max_batch=16",
                  "--min_gain=-1", "--seconds=0.1", "--lr_rule=linear")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "per-replica" in out and "examples/s" in out and "MFU" in out and "memory" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[:2] for row in rows] == [["4", "4"], ["8", "8"], ["16", "16"]]
    assert "Trainer.global_batch_size = 16" in out
    assert "warmup_schedule.learning_rate = 0.002" in out  # 0.0005 x 16 / 4
    assert not model_dir.exists()


@pytest.mark.parametrize("flag, named", [("--start_batch=0", "--start_batch"),
                                         pytest.param("--lr_rule=cubic", "--lr_rule",
                                                      marks=pytest.mark.slow)])
def test_cli_bad_input_is_one_line_and_exit_2(flag, named):
    result = _cli("--gin_file=synthetic_transformer.gin", flag)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert named in result.stderr and result.stdout == ""


def test_unknown_rule_names_the_choices():
    assert math.isclose(scale_learning_rate(1.0, 4, 1), 4.0)
    with pytest.raises(ValueError, match="linear.*sqrt"):
        scale_learning_rate(1.0, 4, 1, rule="cubic")


@pytest.mark.parametrize("gain", [math.nan, math.inf, -0.5, "5%"])
def test_a_min_gain_that_is_not_a_fraction_is_refused_as_given(gain):
    """Issue 50.7: min_gain=nan was accepted (every comparison with it is false: the
    climb never stopped for it), and is quoted as the user gave it."""
    with pytest.raises((ValueError, TypeError), match="min_gain") as raised:
        find_batch(TinyTask(), tf.distribute.OneDeviceStrategy("/cpu:0"), min_gain=gain)
    assert repr(gain) in str(raised.value), raised.value


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_cli_min_gain_nan_is_one_line_and_exit_2(value, capsys):
    from absl import flags

    from tputrain.cli import find_batch as command
    from tputrain.cli.common import parse_flags

    registry = flags.FlagValues()
    command.define_flags(registry)
    with pytest.raises(SystemExit) as caught:
        parse_flags(["tputrain find-batch", f"--min_gain={value}"], registry)
    error = capsys.readouterr().err
    assert caught.value.code == 2 and error.count("\n") == 1, error
    assert f"--min_gain={value}" in error, error
