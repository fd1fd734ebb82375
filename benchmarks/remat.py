"""Rematerialization's memory and time: the Transformer with and without `Trainer.remat`.

    python benchmarks/remat.py            # about 10 minutes on 2 busy cores
    python benchmarks/remat.py --quick    # smoke run (JSON to stdout)
    python benchmarks/remat.py --batch 16 --width 256 --layers 8 --plans executor

Writes one JSON document to benchmarks/results/<today>-remat[-<tag>].json.

Each measurement is a child process (its resident memory is its own). It builds
`SyntheticLMTask` as the Trainer does (`build_model_state`, with or without
`RematOptions(mode)`) and runs the one-replica step (gradients and Adam's update
in one `tf.function`) under a plan: "xla" (`jit_compile=True`, the default plan
on CPU/GPU) or "executor" (`jit_compile=False`: TensorFlow's executor frees each
tensor when no op needs it any more). Memory, in MiB:

- `peak_rss_mib`: the process's peak (VmHWM), TensorFlow's own ~1 GB included;
- `peak_above_built_mib`: that peak minus the resident memory after the model
  was built (before the first step): what the steps (compilation included) add;
- `step_peak_mib`: the peak of the timed steps above the resident memory just
  before them (VmHWM reset after one warm-up step through /proc/self/clear_refs):
  one steady step's transient memory, mostly activations (it reads low when
  the allocator kept memory the warm-up step freed: one run in three, executor).

Runs interleave (plan by plan, off then on, `repeats` times); reported: medians
of each, the ratios remat/no-remat per plan, and the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import result_file  # noqa: E402  (benchmarks/, this script's folder)

FULL = dict(batch=8, sequence_length=512, width=256, num_layers=4, steps=1)
QUICK = dict(batch=2, sequence_length=64, width=32, num_layers=1, steps=2)
PLANS = {"xla": True, "executor": False}


def _memory_kib() -> dict[str, int]:
    """VmHWM and VmRSS of this process, in KiB."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return {l.split(":")[0]: int(l.split()[1]) for l in lines if l.startswith(("VmHWM", "VmRSS"))}


def _reset_peak() -> bool:
    """VmHWM := VmRSS (Linux: "5" to clear_refs); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child(mode: str | None, size: dict[str, int], jit_compile: bool) -> dict[str, float]:
    """One measurement, in this (fresh) process."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tputrain.runtime.model_state import build_model_state  # pylint: disable=import-outside-toplevel
    from tputrain.options import TrainerOptions  # pylint: disable=import-outside-toplevel
    from tputrain.tasks import SyntheticLMTask  # pylint: disable=import-outside-toplevel

    task = SyntheticLMTask(vocab_size=256, sequence_length=size["sequence_length"],
                           width=size["width"], num_layers=size["num_layers"], num_heads=4)
    batch, length = size["batch"], size["sequence_length"]
    state = build_model_state(task, tf.distribute.get_strategy(),
                              {"tokens": tf.TensorSpec([batch, length], tf.int32)}, (), None,
                              TrainerOptions(remat=mode).remat)

    @tf.function(jit_compile=jit_compile)
    def step(data):
        gradients, loss, _ = task.compute_gradients(data, state.model, state.optimizer, batch)
        state.optimizer.apply(gradients, state.model.trainable_variables)
        return loss

    data = ({"tokens": tf.random.stateless_uniform([batch, length], [1, 2], 0, 256, tf.int32)},
            tf.random.stateless_uniform([batch, length], [3, 4], 0, 256, tf.int32))
    built = _memory_kib()["VmRSS"]
    step(data).numpy()  # traces, compiles, creates Adam's slots
    warm = _memory_kib()
    reset = _reset_peak()
    before = _memory_kib()["VmRSS"]
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(size["steps"]):
        step(data).numpy()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = max(warm["VmHWM"], _memory_kib()["VmHWM"])
    return {"peak_rss_mib": peak / 1024, "peak_above_built_mib": (peak - built) / 1024,
            "step_peak_mib": (_memory_kib()["VmHWM"] - before) / 1024 if reset else float("nan"),
            "step_seconds": wall / size["steps"], "step_cpu_seconds": cpu / size["steps"]}


def measure(mode: str, size: dict[str, int], plan: str) -> dict[str, float]:
    """`child` in a new interpreter (the same PYTHONPATH: this checkout's tputrain)."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--plans", plan,
                          "--size-json", json.dumps(size)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summarize(runs: dict[str, list[dict[str, float]]], mode: str) -> dict[str, Any]:
    """Medians of each side and the ratios remat / no remat, for one plan."""
    medians = {side: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
               for side, rs in runs.items()}
    return {"runs": runs, "medians": medians,
            "ratios_remat_over_none": {key: medians[mode][key] / medians["none"][key]
                                       for key in medians["none"]}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", default="full", help="the RematOptions mode measured")
    parser.add_argument("--plans", default="executor,xla",
                        help="comma-separated: executor (jit_compile=False), xla")
    for name, value in FULL.items():
        parser.add_argument("--" + name.replace("_", "-").replace("num-", ""), type=int,
                            default=value, dest=name)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size-json", default=None, help=argparse.SUPPRESS)
    result_file.add_arguments(parser, "remat")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        mode = None if args.child == "none" else args.child
        print(json.dumps(child(mode, json.loads(args.size_json), PLANS[args.plans])))
        return
    size = QUICK if args.quick else {name: getattr(args, name) for name in FULL}
    plans = args.plans.split(",")
    runs = {plan: {"none": [], args.mode: []} for plan in plans}
    load = [os.getloadavg()[0]]
    for _ in range(1 if args.quick else args.repeats):
        for plan in plans:
            for mode in runs[plan]:
                runs[plan][mode].append(measure(mode, size, plan))
                load.append(os.getloadavg()[0])
    report: dict[str, Any] = {
        "benchmark": "remat", "model": dict(size, task="SyntheticLMTask", num_heads=4,
                                            vocab_size=256, replicas=1),
        "remat_mode": args.mode, "repeats": 1 if args.quick else args.repeats,
        "plans": {plan: summarize(runs[plan], args.mode) for plan in plans},
        "load_average_1min": {"min": min(load), "max": max(load)},
        "cpu_count": os.cpu_count()}
    result_file.write(report, args.out, "remat", args.tag, quick=args.quick)


if __name__ == "__main__":
    main()
