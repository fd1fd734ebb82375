"""Tests for tputrain.jobs.diagnose, `tputrain diagnose`, and the input-stall measurement.

The stall each training loop logs (`Progress`) and `Trainer.steps_per_fetch`
are tested here too: they are what diagnose reports. Slow inputs, slow steps
and slow links cost known seconds of the test's own clock (`Clock`, diagnose's
`clock`), so every figure is exact however busy the host is; on the real clock
a test asserts only what its sleeps guarantee. The communication-bound case is
also run for real (slow), a wide model with a tiny batch on 2 worker processes.
"""

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from events import scalar_points
from faults import child_env
from processes import in_netns
from tiny import TinyTask, devices, model_bytes, strategy_for, weights
from tputrain.distribution.communication import CommunicationOptions
from tputrain.data import InputOptions
from tputrain.observe.progress import STALL_ADVICE
from tputrain.jobs.diagnose import (CommunicationCase, Diagnosis, _advice, communication_advice,
                               diagnose)

ROOT = Path(__file__).resolve().parents[2]


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


@gin.configurable
class WideTask(tputrain.Task):
    """One wide Dense layer (width x width weights) on random in-memory data: many
    gradient bytes for little compute when the batch is tiny."""

    def __init__(self, width: int = 2048, num_examples: int = 64):
        rng = np.random.RandomState(0)
        self.width = width
        self.x = rng.randn(num_examples, width).astype(np.float32)
        self.y = rng.randint(0, 10, num_examples).astype(np.int64)

    def build_model(self):
        inputs = keras.Input((self.width,), name="x")
        hidden = keras.layers.Dense(self.width, activation="relu")(inputs)
        return keras.Model({"x": inputs}, keras.layers.Dense(10, dtype="float32")(hidden))

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": self.x}, self.y)).shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id)
        return (dataset.repeat() if split == "train" else dataset).batch(batch, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_optimizer(self):
        return keras.optimizers.SGD(0.01)


def _trainer(tmp_path, task, replicas=1, name="run", strategy=None, **kwargs):
    options = dict(train_steps=8, steps_per_loop=4, global_batch_size=16, checkpoint_every=4,
                   report_mfu=False)
    options.update(kwargs)
    return tputrain.Trainer(task, str(tmp_path / name),
                            strategy=strategy or strategy_for(replicas), **options)


def _scalars(directory, tag):
    return scalar_points(os.path.join(directory, "train")).get(tag, [])


# The stall fraction in every training loop.


class BlockingInputTask(SleepyTask):
    """SleepyTask with nothing buffered ahead (no prefetch, injected or tuned): each
    batch's sleep runs inside the loop's `get_next`, so every loop waits on its input
    at least `steps x sleep` seconds, however busy the host is."""

    def build_inputs(self, split, input_context):
        dataset = super().build_inputs(split, input_context)
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        options.autotune.enabled = False
        return dataset.with_options(options)


def test_stall_fraction_is_logged_and_summarised_each_loop(tmp_path, caplog):
    sleep, steps_per_loop = 0.02, 4
    trainer = _trainer(tmp_path, BlockingInputTask(sleep=sleep), name="slow", train_steps=12,
                       checkpoint_every=12, steps_per_loop=steps_per_loop)
    with caplog.at_level(logging.INFO):
        trainer.train()
    messages = [r.getMessage() for r in caplog.records if "input stall" in r.getMessage()]
    lines = [m for m in messages if m.startswith("tputrain: step ")]
    assert len(lines) == 3  # one per loop of 4 steps
    stalls = _scalars(str(tmp_path / "slow"), "input/stall_fraction")
    rates = _scalars(str(tmp_path / "slow"), "steps_per_second")
    assert [step for step, _ in stalls] == [step for step, _ in rates] == [4, 8, 12]
    assert all(f"input stall {100 * value:.1f}%" in line for (_, value), line in zip(stalls, lines))
    # The stall's explanation: once when a loop after the first (which holds compiling)
    # stalled above STALL_ADVICE, else never (its wording: test_progress.py).
    explained = [m for m in messages if not m.startswith("tputrain: step ")]
    assert len(explained) == int(any(value > STALL_ADVICE for _, value in stalls[1:])), messages
    # The share is of the loop's own time (steps / steps_per_second), and the time it
    # stands for covers every batch's sleep, spent inside get_next by construction:
    # not a share that depends on how fast the step ran.
    for (_, fraction), (_, steps_per_second) in zip(stalls, rates):
        loop_seconds = steps_per_loop / steps_per_second
        assert fraction * loop_seconds >= steps_per_loop * sleep * 0.999  # float32 events
        assert fraction < 1.0  # a share of the loop, which also ran its steps


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


def _case(**changes):
    case = dict(split={"input": 0.0, "compute": 0.2, "communication": 0.8},
                allreduce_seconds=0.04, step_seconds=0.05, gradient_bytes=16_000_000,
                options=CommunicationOptions(), global_batch_size=4, replicas=2,
                accumulation_steps=1, multi_worker=True, gpus=False)
    case.update(changes)
    return communication_advice(CommunicationCase(**case))


def test_communication_advice_fits_the_case():
    """Each knob with its numbers; knobs that do not apply are left out."""
    reason, advice = _case()
    assert "16.0 MB of gradients (float32) takes 40.0 ms alone" in reason
    assert "communication 80% of the step" in reason
    text = " ".join(advice)
    for knob in ("allreduce_dtype='bfloat16': 8.0 MB per step instead of 16.0",
                 "Trainer.accumulation_steps=4 with a 4x Trainer.global_batch_size (16)",
                 "today's 2 examples per replica", "a larger per-replica batch (now 2",
                 "bytes_per_pack (now 0: one pack)"):
        assert knob in text
    assert "nccl" not in text  # CPUs
    # 10 ms of compute and 40 of all-reduce per step; 4x the examples per all-reduce:
    # 4 x 50 ms / (4 x 10 + 40) = 2.5x the examples/s.
    assert "about 2.5x the examples/s" in text
    _, advice = _case(options=CommunicationOptions(allreduce_dtype="bfloat16",
                                                   bytes_per_pack=4 << 20), gpus=True)
    text = " ".join(advice)
    assert "allreduce_dtype" not in text and "bytes_per_pack (now 4.1943 MB)" in text
    assert "implementation='nccl'" in text
    _, advice = _case(multi_worker=False, accumulation_steps=2, global_batch_size=8)
    text = " ".join(advice)
    assert "bytes_per_pack" not in text and "Trainer.accumulation_steps=8" in text


class Clock:
    """A clock the test's input and step advance by known amounts (`diagnose`'s `clock`):
    every throughput diagnose measures is then exact, however busy the host is."""

    def __init__(self):
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> float:
        with self._lock:
            self.now += seconds
        return 0.0


def _spend(clock: Clock, seconds: float) -> tf.Tensor:
    """An op that advances `clock` by `seconds` each time it runs."""
    spent = tf.py_function(lambda: clock.advance(seconds), [], tf.float32)
    spent.set_shape([])
    return spent


class ClockedInputTask(BlockingInputTask):
    """Each train batch costs `per_batch` seconds of `clock`, made when the loop asks for
    it (nothing is buffered ahead); the step costs nothing."""

    def __init__(self, clock: Clock, per_batch: float, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.per_batch = clock, per_batch

    def build_inputs(self, split, input_context):
        dataset = TinyTask.build_inputs(self, split, input_context)
        if split != "train":
            return dataset
        dataset = dataset.map(lambda features, label: (
            {"x": features["x"] + 0.0 * _spend(self.clock, self.per_batch)}, label))
        options = InputOptions(external_state_policy="warn").tf_options()
        options.experimental_optimization.inject_prefetch = False
        options.autotune.enabled = False
        return dataset.with_options(options)


class ClockedStepTask(TinyTask):
    """Each step costs `per_step` seconds of `clock` on each replica (in its loss); the
    input comes from memory and costs nothing."""

    def __init__(self, clock: Clock, per_step: float, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.per_step = clock, per_step

    def compute_loss(self, labels, outputs):
        return super().compute_loss(labels, outputs) + 0.0 * _spend(self.clock, self.per_step)


class ClockedLink(tf.distribute.ReductionToOneDevice):
    """Replicas joined by a slow link on `clock`: each reduction of a gradient costs its
    bytes over `bytes_per_second` seconds of it."""

    def __init__(self, clock: Clock, bytes_per_second: float):
        super().__init__()
        self.clock, self.bytes_per_second = clock, bytes_per_second

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        value = getattr(per_replica_value, "values", (per_replica_value,))[0]
        seconds = value.shape.num_elements() * value.dtype.size / self.bytes_per_second
        if value.shape.rank:  # a gradient, not a loss or a metric (scalars)
            with tf.control_dependencies([_spend(self.clock, seconds)]):
                return super().reduce_implementation(reduce_op, per_replica_value,
                                                     destinations, options)
        return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)


def _assert_reported(result: Diagnosis) -> None:
    """What every diagnosis holds: shares in [0, 1], a split that sums to 1, a report
    and JSON (what --json prints)."""
    for fraction in (result.stall_fraction, *result.step_split.values()):
        assert 0.0 <= fraction <= 1.0
    assert sum(result.step_split.values()) == pytest.approx(1.0)
    assert "stall fraction" in result.report() and "bottleneck" in result.report()
    json.dumps(result.to_json())


def test_diagnose_names_a_slow_input_pipeline_input_bound(tmp_path):
    """A batch costs 100 ms of the test's clock, a step nothing: the input alone delivers
    10 steps/s, end to end the same, the step on a cached batch is free."""
    clock = Clock()
    trainer = _trainer(tmp_path, ClockedInputTask(clock, per_batch=0.1), train_steps=100,
                       steps_per_loop=4)
    result = diagnose(trainer, seconds=0.4, clock=clock)
    _assert_reported(result)
    assert result.bottleneck == "input" and "alone delivers 10.0 steps/s" in result.reason
    assert result.input_only_steps_per_second == pytest.approx(10.0)
    assert result.end_to_end_steps_per_second == pytest.approx(10.0)
    assert result.stall_fraction == pytest.approx(1.0)
    assert result.step_split["input"] == pytest.approx(1.0)


def test_diagnose_names_a_compute_bound_job_compute_bound(tmp_path):
    """A step costs 50 ms of the test's clock on each of 2 replicas (100 ms a step) and
    its all-reduce 5 ms; the input comes from memory."""
    clock = Clock()
    link = ClockedLink(clock, bytes_per_second=model_bytes(TinyTask()) / 0.005)
    strategy = tf.distribute.MirroredStrategy(devices(2), cross_device_ops=link)
    trainer = _trainer(tmp_path, ClockedStepTask(clock, per_step=0.05), strategy=strategy,
                       train_steps=100, steps_per_loop=4, steps_per_fetch=2)
    result = diagnose(trainer, seconds=0.4, clock=clock)
    _assert_reported(result)
    assert result.loop_steps % 2 == 0  # whole fetches of steps_per_fetch=2
    assert result.replicas == 2
    assert result.allreduce_seconds == pytest.approx(0.005)
    step_seconds = 2 * 0.05 + result.allreduce_seconds
    assert result.compute_only_steps_per_second == pytest.approx(1 / step_seconds)
    assert result.end_to_end_steps_per_second == pytest.approx(1 / step_seconds)
    assert result.stall_fraction == pytest.approx(0.0, abs=1e-9)
    assert result.bottleneck == "compute" and "keeps up" in result.reason
    assert any("mixed_bfloat16" in a for a in result.advice)
    assert not os.path.exists(tmp_path / "run" / "checkpoints" / "checkpoint")  # nothing saved


def test_diagnose_names_a_slow_link_communication_bound(tmp_path):
    """2 replicas joined by a 100 MB/s link on the test's clock: the 4.2 MB of a wide
    layer's gradients cost 42 ms an all-reduce, the step nothing more."""
    clock = Clock()
    strategy = tf.distribute.MirroredStrategy(devices(2),
                                              cross_device_ops=ClockedLink(clock, 100e6))
    trainer = _trainer(tmp_path, WideTask(width=1024), strategy=strategy, train_steps=100,
                       steps_per_loop=4, global_batch_size=4)
    result = diagnose(trainer, seconds=0.3, clock=clock)
    _assert_reported(result)
    assert result.allreduce_seconds == pytest.approx(result.gradient_bytes / 100e6)
    assert result.bottleneck == "communication", result.report()
    assert result.step_split["communication"] == pytest.approx(1.0)
    assert result.gradient_bytes > 4_000_000 and result.allreduce_dtype == "float32"
    text = " ".join(result.advice)
    assert "allreduce_dtype='bfloat16'" in text and "Trainer.accumulation_steps=4" in text
    assert "bytes_per_pack" not in text  # one host: MirroredStrategy has no packs
    assert "communication" in result.report().splitlines()[5]  # the step split line


def test_diagnose_on_the_real_clock_reports_what_sleeps_guarantee(tmp_path):
    """On the real clock only what a 100 ms sleep per batch guarantees on any host: the
    input, alone or feeding the step, delivers at most 10 steps/s, and the rest holds."""
    trainer = _trainer(tmp_path, BlockingInputTask(sleep=0.1), train_steps=100,
                       steps_per_loop=4)
    result = diagnose(trainer, seconds=0.4)
    _assert_reported(result)
    assert 0 < result.input_only_steps_per_second <= 10.0
    assert 0 < result.end_to_end_steps_per_second <= 10.0
    assert result.compute_only_steps_per_second > 0
    assert 0.0 <= result.measured_input_wait_fraction <= 1.0
    assert result.bottleneck in ("input", "compute")  # one replica: no communication


@pytest.mark.slow

def test_cli_names_the_input_bottleneck_of_slow_input_gin():
    """As documented: `python -m tputrain.jobs.diagnose` from the repository root, where
    slow_input.gin's `import examples.slow_input` finds its task."""
    result = subprocess.run(
        [sys.executable, "-m", "tputrain.jobs.diagnose", "--gin_file=slow_input.gin", "--json",
         "--seconds=0.3", "--gin_param=SlowInputTask.work=4000",  # input-bound at any load
         "--gin_param=Trainer.steps_per_loop=5", "--gin_param=Trainer.eval_every=None"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["bottleneck"] == "input" and report["stall_fraction"] > 0.5
    assert report["gin_file"] == ["slow_input.gin"]
    assert set(report["seconds"]) >= {"build", "total", "input_only"}


def _diagnose_cli(*args: str, launch_workers: int = 0) -> list[dict]:
    """`tputrain diagnose --json` (through `tputrain launch` if `launch_workers`): each
    host's report."""
    command = [sys.executable, "-m", "tputrain.run", "diagnose", "--json", *args]
    if launch_workers:
        command = in_netns([sys.executable, "-m", "tputrain.run", "launch", "--workers",
                            str(launch_workers), *command[3:]])
    env = child_env()  # and this folder: a child imports `--gin_import=test_diagnose`
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), env["PYTHONPATH"]])
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    if not launch_workers:
        return [json.loads(result.stdout)]
    reports = []
    for worker in range(launch_workers):
        prefix = f"[worker {worker}] "
        lines = [line[len(prefix):] for line in result.stdout.splitlines()
                 if line.startswith(prefix)]
        reports.append(json.loads("\n".join(lines[lines.index("{"):])))
    return reports

@pytest.mark.slow

def test_cli_does_not_name_digits_communication_bound():
    """digits.gin on 2 replicas (split CPU): a 0.2 MB all-reduce, really measured, is
    not what holds the step back."""
    (report,) = _diagnose_cli("--gin_file=digits.gin", "--seconds=0.5",
                              "--gin_param=split_cpu.num_devices=2",
                              "--gin_param=Trainer.eval_every=None")
    assert report["replicas"] == 2 and report["allreduce_seconds"] > 0
    assert report["bottleneck"] != "communication", report


@pytest.mark.slow
def test_cli_names_a_wide_model_on_two_workers_communication_bound(tmp_path):
    """`tputrain launch --workers 2 diagnose`: a 2048 x 2048 layer (17 MB of gradients
    over gRPC on loopback) and 2 examples per replica."""
    config = tmp_path / "wide.gin"
    config.write_text("Trainer.task = @WideTask()\nTrainer.train_steps = 1000\n"
                      "Trainer.steps_per_loop = 10\nTrainer.global_batch_size = 4\n"
                      "Trainer.report_mfu = False\n")
    reports = _diagnose_cli("--gin_import=test_diagnose", f"--gin_file={config}",
                            "--seconds=1", launch_workers=2)
    for host, report in enumerate(reports):
        assert (report["host"], report["num_hosts"], report["replicas"]) == (host, 2, 2)
        assert report["bottleneck"] == "communication", json.dumps(report, indent=1)
        assert any("bytes_per_pack" in line for line in report["advice"])


# The advice is checked against what the run already does (issue 34: diagnose advised
# digits.gin, whose batches come from RAM 100 steps a fetch, to cache and to fetch more).


def _digits_input(tmp_path, **options):
    from tputrain.data import InputContext, TFRecordInput
    from tputrain.tasks.digits import FEATURES, prepare_digits

    patterns = prepare_digits(str(tmp_path / "digits"))
    context = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1,
                           global_batch_size=16)
    return TFRecordInput(patterns["train"], FEATURES, label_key="label", **options)(context)


def test_pipeline_facts_read_what_the_pipeline_does(tmp_path):
    from tputrain.data.pipeline_facts import pipeline_facts

    in_ram = pipeline_facts(_digits_input(tmp_path, cache="memory"))
    assert in_ram.cached and in_ram.in_memory and not in_ram.reads_files
    assert in_ram.maps_after_cache == 0 and not in_ram.service
    streamed = pipeline_facts(_digits_input(
        tmp_path, options=InputOptions(threadpool_size=2, prefetch=8)))
    assert streamed.reads_files and not streamed.cached and not streamed.in_memory
    assert (streamed.prefetch, streamed.threadpool_size) == (8, 2)
    assert streamed.sequential_maps == 0 and streamed.maps_after_cache == 1  # the parse
    cached = pipeline_facts(tf.data.Dataset.range(8).map(lambda x: x + 1).cache()
                            .map(lambda x: 2 * x).batch(2))
    assert cached.cached and not cached.in_memory and not cached.reads_files
    assert (cached.maps_after_cache, cached.sequential_maps, cached.prefetch) == (1, 2, None)


def _advised(bottleneck, input_only, compute_only, **setup):
    from tputrain.jobs.advice import RunSetup, step_advice

    result = step_advice(bottleneck, input_only, compute_only, 0.2, RunSetup(**setup))
    return " ".join(result.advice), " ".join(result.in_place)


def test_advice_leaves_out_the_knobs_the_run_already_turns():
    from tputrain.data.pipeline_facts import PipelineFacts

    in_ram = PipelineFacts(cached=True, in_memory=True)
    # Competing for cores, as digits.gin: batches from RAM, 100 steps a fetch.
    advice, in_place = _advised("input", 900.0, 100.0, pipeline=in_ram, steps_per_fetch=100)
    assert "threadpool_size" in advice
    for knob in ("cache=", "steps_per_fetch", "service_address", "write_tfrecords", "TPU"):
        assert knob not in advice, knob
    assert "served from RAM" in in_place and "Trainer.steps_per_fetch=100" in in_place
    # Slower than the step, from RAM: nothing to parse, read, cache or offload.
    advice, in_place = _advised("input", 50.0, 100.0, pipeline=in_ram, steps_per_fetch=4)
    for knob in ("num_parallel_calls", "cycle_length", "cache=", "write_tfrecords",
                 "service_address", "steps_per_fetch"):
        assert knob not in advice, knob
    assert "InputOptions.prefetch=8" in advice
    # Streaming files with a deep prefetch and a small private pool.
    streamed = PipelineFacts(reads_files=True, maps_after_cache=1, prefetch=8,
                             threadpool_size=1)
    advice, in_place = _advised("input", 50.0, 100.0, pipeline=streamed)
    for knob in ("cycle_length", "cache='memory'", "write_tfrecords", "service_address",
                 "Trainer.steps_per_fetch"):
        assert knob in advice, knob
    assert "num_parallel_calls" not in advice and "InputOptions.prefetch=8" in in_place
    advice, in_place = _advised("input", 900.0, 100.0, pipeline=streamed)
    assert "threadpool_size" not in advice and "InputOptions.threadpool_size=1" in in_place
    # Compute-bound in mixed precision already: the other knobs, with today's values.
    advice, in_place = _advised("compute", 900.0, 100.0, precision="mixed_bfloat16",
                                global_batch_size=64, steps_per_loop=100)
    assert "mixed_bfloat16" not in advice and "mixed_bfloat16" in in_place
    assert "global_batch_size (now 64)" in advice and "steps_per_loop (now 100)" in advice


def test_digits_setup_gets_no_advice_it_already_follows(tmp_path):
    """digits.gin's Trainer, built (not measured): what diagnose reads of it."""
    from tputrain.jobs.advice import run_setup, step_advice
    from tputrain.tasks.digits import DigitsTask

    trainer = tputrain.Trainer(DigitsTask(cache_dir=str(tmp_path / "digits")),
                               str(tmp_path / "run"), strategy=strategy_for(1), train_steps=200,
                               steps_per_loop=100, steps_per_fetch=100, global_batch_size=64,
                               report_mfu=False)
    setup = run_setup(trainer)
    assert setup.pipeline.in_memory and setup.steps_per_fetch == 100 and not setup.tpu
    for input_only in (900.0, 50.0):
        text = " ".join(step_advice("input", input_only, 100.0, 0.15, setup).advice)
        assert "cache=" not in text and "steps_per_fetch" not in text, text


def test_a_program_read_back_from_the_compile_cache_puts_no_error_lines_on_the_console(
        tmp_path):
    """diagnose ran its loop outside the Trainer's first-call wrapper: a program read back
    from XLA's compilation cache printed TensorFlow's harmless error-level lines (a
    text-format parse error, XLA:CPU's tuning flags as "features" the host lacks)."""
    env = child_env()
    env.pop("TF_XLA_FLAGS", None)
    env["TPUTRAIN_COMPILE_CACHE"] = str(tmp_path / "cache")
    command = [sys.executable, "-m", "tputrain.run", "diagnose", "--json",
               "--gin_file=digits.gin", "--seconds=0.5", "--gin_param=Trainer.jit_compile=True",
               f"--model_dir={tmp_path / 'run'}"]
    for _ in range(2):  # the second reads the program back
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                                env=env)
        assert result.returncode == 0, result.stderr[-3000:]
    assert os.listdir(tmp_path / "cache")
    assert not [line for line in result.stderr.splitlines() if line.startswith("E0")], \
        result.stderr[-3000:]
