"""What exact resume costs: training throughput with it on vs off, and the guard's cost.

    python benchmarks/resume.py            # ~3-5 minutes on 2 cores
    python benchmarks/resume.py --quick    # smoke run (JSON to stdout)

Writes one JSON document to benchmarks/results/<today>-resume[-<tag>].json
(`--out PATH`, `--out -` for stdout; progress on stderr). One process, one
model (an MLP with dropout, 2 replicas over logical CPUs), three Trainers:

* `exact_resume`: `input_mode="host"`: a plain per-host iterator that the
  checkpoint saves (data position and shuffle buffer), batches placed on the
  replicas with `experimental_distribute_values_from_function`, the dropout
  RNG state saved. A resumed run is bitwise the uninterrupted one.
* `skip_resume`: `input_mode="distributed"`: `distribute_datasets_from_function`
  (device prefetch); the iterator is not saved (TF cannot), a resume rebuilds the
  data and skips the consumed batches: the same batches only if the pipeline
  is deterministic, and the shuffle buffer restarts.
* `exact_resume_no_guard`: as `exact_resume` with `NonFiniteGuard.policy=None`,
  to measure what the in-step NaN/Inf guard costs.
* `exact_resume_no_xla` and `exact_resume_no_xla_no_guard`: both with
  `jit_compile=False`: the optimizer update as TensorFlow kernels (the guard a
  conditional around it) instead of one XLA program on each device
  (`tputrain/loop/update.py`), the default.

Steady-state steps/s of the compiled loop (`steps` steps per call, after a
traced warm-up call), in interleaved rounds whose contender order rotates.
Ratios (> 1: the first is faster): `*_vs_*` is the median over rounds of the
steps/s ratio within a round (follows load drift); `*_cpu` compares this
process's CPU seconds per step (all its threads), which other processes' load
disturbs far less than wall time. Also the time of one synchronous checkpoint
save, and of the training-thread part of an async one. The machine is shared,
so compare ratios measured side by side, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

import result_file  # noqa: E402  (benchmarks/, this script's folder)
import tputrain  # noqa: E402

GOAL = 0.98


def log(message: str) -> None:
    print(f"[resume] {message}", file=sys.stderr, flush=True)


class BenchTask(tputrain.Task):
    """An MLP classifier with dropout on a fixed random in-memory dataset."""

    def __init__(self, features: int, hidden: int, examples: int, shuffle_buffer: int):
        rng = np.random.RandomState(0)
        self.x = rng.randn(examples, features).astype(np.float32)
        self.y = rng.randint(0, 10, size=examples).astype(np.int64)
        self.hidden = hidden
        self.shuffle_buffer = shuffle_buffer

    def build_model(self) -> keras.Model:
        inputs = keras.Input((self.x.shape[1],), name="x")
        h = inputs
        for _ in range(2):
            h = keras.layers.Dense(self.hidden, activation="relu")(h)
            h = keras.layers.Dropout(0.1, seed=1)(h)
        return keras.Model({"x": inputs}, keras.layers.Dense(10, dtype="float32")(h))

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": self.x}, self.y))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        if split == "train":
            dataset = dataset.shuffle(self.shuffle_buffer, seed=3).repeat()
        return dataset.batch(batch, drop_remainder=True).prefetch(2)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_optimizer(self):
        return keras.optimizers.Adam(1e-3)


def make_trainer(name: str, root: str, task: BenchTask, strategy, args, **kwargs):
    guard = tputrain.NonFiniteGuard(policy=None) if kwargs.pop("guard_off", False) else None
    trainer = tputrain.Trainer(task, os.path.join(root, name), strategy=strategy,
                               train_steps=10**9, steps_per_loop=args.steps,
                               global_batch_size=args.batch, checkpoint_every=10**9,
                               eval_steps=1, report_mfu=False, guard=guard, **kwargs)
    if trainer.input_mode == "distributed":
        trainer.set_train_iterator(trainer.inputs.distributed_iterator("train"))
    return trainer


def time_loop(trainer, steps: int) -> tuple[float, float]:
    """(steps per wall-clock second, CPU seconds of this process per step)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    _, done, _ = trainer.run_loop(steps)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    assert done == steps
    return steps / seconds, cpu / steps


def make_trainers(task: BenchTask, strategy, args) -> dict[str, tputrain.Trainer]:
    root = tempfile.mkdtemp(prefix="tputrain-bench-resume-")
    trainers = {
        "exact_resume": make_trainer("exact", root, task, strategy, args, input_mode="host"),
        "skip_resume": make_trainer("skip", root, task, strategy, args,
                                    input_mode="distributed"),
        "exact_resume_no_guard": make_trainer("noguard", root, task, strategy, args,
                                              input_mode="host", guard_off=True),
        # The optimizer update as TensorFlow kernels, not one XLA program a device.
        "exact_resume_no_xla": make_trainer("noxla", root, task, strategy, args,
                                            input_mode="host", jit_compile=False),
        "exact_resume_no_xla_no_guard": make_trainer("noxla_noguard", root, task, strategy,
                                                     args, input_mode="host",
                                                     jit_compile=False, guard_off=True),
    }
    assert trainers["exact_resume"].guard.policy == "raise"
    assert trainers["exact_resume_no_guard"].guard.policy is None
    return trainers


def time_rounds(trainers: dict[str, tputrain.Trainer], args
                ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(steps/s, CPU seconds a step) of every contender in interleaved rounds."""
    for name, trainer in trainers.items():
        log(f"warming up {name}")
        time_loop(trainer, args.steps)  # traces
    rates: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    names = list(trainers)
    for round_ in range(args.repeats):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            rate, cpu_per_step = time_loop(trainers[name], args.steps)
            rates[name].append(rate)
            cpu[name].append(cpu_per_step)
        log(f"round {round_ + 1}/{args.repeats}: " + ", ".join(
            f"{n} {rates[n][-1]:.1f} steps/s {1e3 * cpu[n][-1]:.1f} cpu-ms/step" for n in names))
    return rates, cpu


def time_saves(trainers: dict[str, tputrain.Trainer], args) -> dict[str, list[float]]:
    """Seconds of a synchronous save with and without the iterator, and the
    training thread's part of an async one."""
    saves: dict[str, list[float]] = {"exact_resume": [], "skip_resume": [],
                                     "exact_resume_async_blocking": []}
    async_checkpointer = trainers["exact_resume"].checkpointer
    for _ in range(max(3, args.repeats // 2)):
        for name in ("exact_resume", "skip_resume"):
            trainer = trainers[name]
            trainer.step.assign_add(1)
            start = time.perf_counter()
            trainer.checkpointer.save()
            saves[name].append(time.perf_counter() - start)
        async_checkpointer.async_save = True
        trainers["exact_resume"].step.assign_add(1)
        start = time.perf_counter()
        async_checkpointer.save()
        saves["exact_resume_async_blocking"].append(time.perf_counter() - start)
        async_checkpointer.sync()
        async_checkpointer.async_save = False
    return saves


def ratios(rates: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, float]:
    """Throughput ratios (> 1: the first is faster). "wall": medians of same-round
    ratios of steps/s; "cpu": inverse ratio of this process's CPU time per step,
    which other processes' load disturbs less; "paired": medians of same-round ones."""
    cpu_median = {name: statistics.median(values) for name, values in cpu.items()}

    def per_round(a: str, b: str) -> float:
        """Median over rounds of a/b measured in the same round (follows load drift)."""
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    def cpu_ratio(a: str, b: str, paired: bool = False) -> float:
        """b's CPU time a step over a's (> 1: a is cheaper); `paired`: the median of
        same-round ratios."""
        if paired:
            return statistics.median(x / y for x, y in zip(cpu[b], cpu[a]))
        return cpu_median[b] / cpu_median[a]
    return {
        "exact_resume_vs_skip_resume": per_round("exact_resume", "skip_resume"),
        "guard_on_vs_off": per_round("exact_resume", "exact_resume_no_guard"),
        "exact_resume_vs_skip_resume_cpu": cpu_ratio("exact_resume", "skip_resume"),
        "guard_on_vs_off_cpu": cpu_ratio("exact_resume", "exact_resume_no_guard"),
        "guard_on_vs_off_cpu_paired": cpu_ratio("exact_resume", "exact_resume_no_guard", True),
        "guard_on_vs_off_no_xla_cpu": cpu_ratio("exact_resume_no_xla",
                                                "exact_resume_no_xla_no_guard"),
        "guard_on_vs_off_no_xla_cpu_paired": cpu_ratio("exact_resume_no_xla",
                                                       "exact_resume_no_xla_no_guard", True),
        "update_on_each_device_vs_tensorflow_kernels_cpu": cpu_ratio("exact_resume",
                                                                     "exact_resume_no_xla"),
        "update_on_each_device_vs_tensorflow_kernels": per_round("exact_resume",
                                                                 "exact_resume_no_xla"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=25, help="steps per timed loop")
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    result_file.add_arguments(parser, "resume")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps, args.batch = 3, 10, 64
    features, hidden = (64, 128) if args.quick else (256, 1024)
    logging.set_verbosity(logging.WARNING)
    tputrain.split_cpu(2)
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())
    trainers = make_trainers(BenchTask(features, hidden, examples=8192, shuffle_buffer=4096),
                             strategy, args)
    rates, cpu = time_rounds(trainers, args)
    saves = time_saves(trainers, args)
    result = {
        "benchmark": "exact resume on vs off (training throughput), guard cost",
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "tensorflow": tf.__version__,
                    "note": "shared machine (other engineers run TensorFlow): noisy; "
                            "ratios are measured side by side, medians of interleaved rounds"},
        "config": {"replicas": 2, "global_batch": args.batch, "steps_per_loop": args.steps,
                   "repeats": args.repeats, "model": f"MLP {features}-{hidden}-{hidden}-10 "
                   "with dropout", "shuffle_buffer": 4096, "quick": args.quick},
        "steps_per_second_median": {n: statistics.median(v) for n, v in rates.items()},
        "steps_per_second_all": rates,
        "cpu_seconds_per_step_median": {n: statistics.median(v) for n, v in cpu.items()},
        "cpu_seconds_per_step_all": cpu,
        "ratios": ratios(rates, cpu),
        "goal": {"exact_resume_vs_skip_resume": f">= {GOAL}"},
        "checkpoint_save_seconds_median": {k: statistics.median(v) for k, v in saves.items()},
    }
    result["goal_met"] = result["ratios"]["exact_resume_vs_skip_resume"] >= GOAL
    result_file.write(result, args.out, "resume", args.tag, args.quick)


if __name__ == "__main__":
    main()
