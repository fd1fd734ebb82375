"""Rematerialization's memory and time: the Transformer with and without `Trainer.remat`.

    python benchmarks/remat.py            # a few minutes on 2 busy cores
    python benchmarks/remat.py --quick    # smoke run (JSON to stdout)

Writes one JSON document to benchmarks/results/<today>-remat[-<tag>].json.

Each measurement is a child process (its peak resident memory, VmHWM, is its own):
it builds `SyntheticLMTask` as the Trainer does (`build_model_state`, with or
without `RematOptions(mode)`), compiles the one-replica step (gradients and Adam's
update in one XLA program, the default plan) and times `steps` steps after two
warm-up steps. The sequence is long and the model narrow, so attention scores and
MLP activations, not weights, dominate memory. Children alternate (off, on, off,
on...); reported: each side's medians (peak RSS, wall and CPU seconds a step) and
the ratios remat/no-remat, with the machine's load average.
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

SIZES = {"full": dict(batch=8, sequence_length=512, width=128, num_layers=4, steps=3),
         "quick": dict(batch=2, sequence_length=64, width=32, num_layers=1, steps=2)}


def child(mode: str | None, size: dict[str, int]) -> dict[str, float]:
    """One measurement, in this (fresh) process."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tputrain.model_state import build_model_state  # pylint: disable=import-outside-toplevel
    from tputrain.options import TrainerOptions  # pylint: disable=import-outside-toplevel
    from tputrain.tasks import SyntheticLMTask  # pylint: disable=import-outside-toplevel

    task = SyntheticLMTask(vocab_size=256, sequence_length=size["sequence_length"],
                           width=size["width"], num_layers=size["num_layers"], num_heads=4)
    batch, length = size["batch"], size["sequence_length"]
    state = build_model_state(task, tf.distribute.get_strategy(),
                              {"tokens": tf.TensorSpec([batch, length], tf.int32)}, (), None,
                              TrainerOptions(remat=mode).remat)

    @tf.function(jit_compile=True)
    def step(data):
        gradients, loss, _ = task.compute_gradients(data, state.model, state.optimizer, batch)
        state.optimizer.apply(gradients, state.model.trainable_variables)
        return loss

    data = ({"tokens": tf.random.stateless_uniform([batch, length], [1, 2], 0, 256, tf.int32)},
            tf.random.stateless_uniform([batch, length], [3, 4], 0, 256, tf.int32))
    for _ in range(2):
        step(data).numpy()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(size["steps"]):
        step(data).numpy()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    status = Path("/proc/self/status").read_text()
    peak_kib = int(next(l for l in status.splitlines() if l.startswith("VmHWM")).split()[1])
    return {"peak_rss_mib": peak_kib / 1024, "step_seconds": wall / size["steps"],
            "step_cpu_seconds": cpu / size["steps"]}


def measure(mode: str, size_name: str) -> dict[str, float]:
    """`child` in a new interpreter (the same PYTHONPATH: this checkout's tputrain)."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--size", size_name],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", default="full", help="the RematOptions mode measured")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", default="full", help=argparse.SUPPRESS)
    result_file.add_arguments(parser, "remat")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(None if args.child == "none" else args.child, SIZES[args.size])))
        return
    size_name = "quick" if args.quick else "full"
    runs: dict[str, list[dict[str, float]]] = {"none": [], args.mode: []}
    load = [os.getloadavg()[0]]
    for _ in range(1 if args.quick else args.repeats):
        for mode in runs:
            runs[mode].append(measure(mode, size_name))
            load.append(os.getloadavg()[0])
    medians = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
               for mode, rs in runs.items()}
    report: dict[str, Any] = {
        "benchmark": "remat", "model": dict(SIZES[size_name], task="SyntheticLMTask",
                                            num_heads=4, vocab_size=256, plan="one replica, XLA"),
        "remat_mode": args.mode, "repeats": len(runs["none"]), "runs": runs, "medians": medians,
        "ratios_remat_over_none": {key: medians[args.mode][key] / medians["none"][key]
                                   for key in medians["none"]},
        "load_average_1min": {"min": min(load), "max": max(load)},
        "cpu_count": os.cpu_count()}
    result_file.write(report, args.out, "remat", args.tag, quick=args.quick)


if __name__ == "__main__":
    main()
