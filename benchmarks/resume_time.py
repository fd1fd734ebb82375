"""How long a resume takes at an early step and at a 50x later step, per input mode.

    python benchmarks/resume_time.py            # ~3-4 minutes on 2 cores
    python benchmarks/resume_time.py --quick    # smoke run (JSON to stdout)
    python benchmarks/resume_time.py --positions [--quick]   # the input alone (below)

Writes one JSON document to benchmarks/results/<today>-resume_time[-<tag>].json
(`--out PATH`, `--out -` for stdout; progress on stderr). A run of a small MLP
on 2 replicas (logical CPUs) reading sharded TFRecords (parsed, shuffled) is
trained to `early` and to `late = 50 x early` steps once per input mode. Each
trial copies that model_dir and times a fresh `Trainer(...)` plus `train()` of
one more step: building, restoring and reaching the first new step. Trials of
the four cases are interleaved; medians are reported.

* `host` (exact resume): the data iterator's position is in the checkpoint, so
  resuming costs the same at any step.
* `distributed`: TensorFlow cannot checkpoint a distributed iterator; a resume
  rebuilds the pipeline and skips the consumed batches, reading them again.

`--positions` (`<today>-resume_time-positions.json`) times the train input alone,
CPU seconds (`time.process_time`) of building one host's `TFRecordInput` and taking
its first batch after 1e3, 1e4, 1e5 and 1e6 examples consumed (1e6 is 15 epochs of
the data), trials interleaved in one process:

* `skip` (the reference: today's distributed-mode resume): the shuffle-buffer
  pipeline, `Dataset.skip` of the consumed batches;
* `distributed`: `TFRecordInput(positional=True)` built at the position
  (`InputContext.examples_consumed`), as distributed mode rebuilds it;
* `host`: host mode's resume of a positional input (no iterator is saved for it):
  built at the recorded layout's position with its host history, as the host
  iterator's dataset; plus the input state its checkpoint holds (the layout's JSON);
* at 1e9 both are built there, and `host_ledger_only` times the ledger alone
  (`locate`: the position's window).

Steady state: CPU seconds an example over 200 batches after the first, positional
vs the shuffle-buffer pipeline.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
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
from machine import cpu_kind, cpu_model  # noqa: E402,F401  (train_loop.py imports cpu_kind here)
import tputrain  # noqa: E402

FEATURES = 128


def log(message: str) -> None:
    print(f"[resume_time] {message}", file=sys.stderr, flush=True)


class RecordsMLP(tputrain.Task):
    """An MLP on TFRecord shards (every step parses a batch: re-reading costs)."""

    def __init__(self, pattern: str):
        self.pattern = pattern

    def build_model(self) -> keras.Model:
        inputs = keras.Input((FEATURES,), name="x")
        h = keras.layers.Dense(64, activation="relu")(inputs)
        return keras.Model({"x": inputs}, keras.layers.Dense(10, dtype="float32")(h))

    def build_inputs(self, split, input_context):
        return tputrain.data.TFRecordInput(
            self.pattern, {"x": ([FEATURES], "float32"), "label": ([], "int64")},
            label_key="label", shuffle_buffer=1024, seed=1,
            repeat=split == "train", pad_remainder=split == "eval")(input_context)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_optimizer(self):
        return keras.optimizers.Adam(1e-3)


def trainer(task, model_dir: str, strategy, mode: str, steps: int, loop: int):
    return tputrain.Trainer(task, model_dir, strategy=strategy, train_steps=steps,
                            steps_per_loop=loop, global_batch_size=64, checkpoint_every=steps,
                            eval_steps=1, input_mode=mode, report_mfu=False)


def positions_main(args) -> None:
    """`--positions`: the input's build + first batch at a position (module docstring)."""
    import resume_positions  # noqa: E402  (benchmarks/, this script's folder)
    load_before = os.getloadavg()
    result = resume_positions.run(args.quick, args.repeats, log)
    result["machine"] = {"cpu": platform.processor() or platform.machine(),
                         "cpu_model": cpu_model(), "cpu_kind": cpu_kind(),
                         "cores": os.cpu_count(), "tensorflow": tf.__version__,
                         "load_average_before": load_before,
                         "load_average_after": os.getloadavg()}
    result["command"] = "python benchmarks/resume_time.py --positions" + (
        " --quick" if args.quick else "")
    result_file.write(result, args.out, "resume_time", args.tag or "positions", args.quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--positions", action="store_true",
                        help="time the train input alone at 1e3..1e9 examples consumed")
    parser.add_argument("--early", type=int, default=40, help="the early step")
    parser.add_argument("--repeats", type=int, default=5)
    result_file.add_arguments(parser, "resume_time")
    args = parser.parse_args()
    if args.positions:
        positions_main(args)
        return
    if args.quick:
        args.early, args.repeats = 4, 2
    late = 50 * args.early
    logging.set_verbosity(logging.WARNING)
    tputrain.split_cpu(2)
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())
    root = tempfile.mkdtemp(prefix="tputrain-bench-resume-time-")
    rng = np.random.RandomState(0)
    x = rng.randn(16384, FEATURES).astype(np.float32)
    tputrain.data.write_tfrecords({"x": x, "label": rng.randint(0, 10, 16384).astype(np.int64)},
                                  f"{root}/data/train", num_shards=8)
    task = RecordsMLP(f"{root}/data/train-*")

    bases = {}
    for mode in ("host", "distributed"):
        for step in (args.early, late):
            base = f"{root}/{mode}-{step}"
            log(f"training {mode} to step {step}")
            trainer(task, base, strategy, mode, step, min(step, 100)).train()
            bases[(mode, step)] = base

    seconds: dict[str, list[float]] = {f"{m}@{s}": [] for m, s in bases}
    cases = list(bases)
    for round_ in range(args.repeats):
        for mode, step in cases[round_ % 4:] + cases[:round_ % 4]:
            model_dir = f"{root}/trial"
            shutil.rmtree(model_dir, ignore_errors=True)
            shutil.copytree(bases[(mode, step)], model_dir)
            start = time.perf_counter()
            resumed = trainer(task, model_dir, strategy, mode, step + 1, 1)
            resumed.train()
            seconds[f"{mode}@{step}"].append(time.perf_counter() - start)
            assert int(resumed.step.numpy()) == step + 1
        log(f"round {round_ + 1}/{args.repeats}: " + ", ".join(
            f"{k} {v[-1]:.2f}s" for k, v in seconds.items()))
    median = {k: statistics.median(v) for k, v in seconds.items()}
    result = {
        "benchmark": "time to resume (build + restore + one step) at an early vs a 50x later step",
        "command": "python benchmarks/resume_time.py" + (" --quick" if args.quick else ""),
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "tensorflow": tf.__version__},
        "config": {"replicas": 2, "global_batch": 64, "early_step": args.early,
                   "late_step": late, "repeats": args.repeats,
                   "data": "16384 examples of 128 floats in 8 TFRecord shards, shuffled"},
        "seconds_median": median,
        "seconds_all": seconds,
        # > 1: resuming at the late step takes longer than at the early one.
        "late_vs_early": {mode: median[f"{mode}@{late}"] / median[f"{mode}@{args.early}"]
                          for mode in ("host", "distributed")},
    }
    result_file.write(result, args.out, "resume_time", args.tag, args.quick)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
