"""Compile time on 1 and N replicas: goodput's compile bucket for a keras.applications model.

    nice python benchmarks/compile_replicas.py --tag before      # MobileNet, 1 and 2 replicas, oneDNN on and off
    python benchmarks/compile_replicas.py --quick                # smoke run (JSON to stdout)

Each case (replicas x oneDNN) is one fresh process (`TF_ENABLE_ONEDNN_OPTS` is read
when TensorFlow loads) that trains `--steps` steps of MobileNet (alpha 0.5, its
dropout head, `benchmarks/train_loop.py`'s `ApplicationTask`) at `--size` input with
the Trainer's defaults, in loops of `--steps_per_loop` (so a later loop prices the
steps) and XLA's persistent cache off (`TPUTRAIN_COMPILE_CACHE=off`: every case
compiles). Kept per case: the run's goodput record's `compile` seconds (the first
loop's time beyond its steps at the later loops' rate), the first loop's seconds,
the train loop graph's op count (its function library included), and `train()`'s
wall and CPU seconds (all threads) in that process, with the load average before
it. Cases run one after another, interleaved over `--repeats`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

import result_file  # noqa: E402  (benchmarks/, this script's folder)
from tputrain.core.cpu_info import cpu_flags  # noqa: E402

CHILD = r"""
import glob, json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
replicas, size, batch, steps, per_loop, model_dir = (int(sys.argv[2]), int(sys.argv[3]),
    int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
import tputrain
if replicas > 1:
    tputrain.split_cpu(replicas)
from train_loop import ApplicationTask

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

task = ApplicationTask("MobileNet", size, examples=8 * batch, alpha=0.5)
trainer = tputrain.Trainer(task, model_dir, strategy=tputrain.resolve_strategy(),
                           train_steps=steps, steps_per_loop=per_loop, global_batch_size=batch,
                           report_mfu=False, checkpoint_every=10**9, eval_every=10**9)
wall, start = time.perf_counter(), cpu()
trainer.train()
wall, seconds = time.perf_counter() - wall, cpu() - start
loop = trainer._train_loop_fn.__self__
graphs = [c.graph.as_graph_def() for f in (loop.loop, loop.program_loop)
          for c in f._list_all_concrete_functions()]  # no public list of a function's traces
ops = sum(len(g.node) + sum(len(f.node_def) for f in g.library.function) for g in graphs)
record = sorted(glob.glob(os.path.join(model_dir, "goodput", "run-*.json")))[-1]
with open(record) as f:
    data = json.load(f)
print("RESULT " + json.dumps({
    "compile": data["seconds"]["compile"], "first_loop": data["first_loop"],
    "seconds_per_step": data["seconds_per_step"], "train_wall": wall, "train_cpu": seconds,
    "loop_graph_ops": ops, "jit_compile": str(trainer.jit_compile),
    "tputrain": os.path.dirname(tputrain.__file__)}))
"""


def log(message: str) -> None:
    print(f"[compile_replicas] {message}", file=sys.stderr, flush=True)


def case(replicas: int, onednn: bool, args: argparse.Namespace) -> dict:
    """One fresh process: its figures and the load average before it."""
    env = dict(os.environ, TPUTRAIN_COMPILE_CACHE="off", TF_CPP_MIN_LOG_LEVEL="2",
               TF_ENABLE_ONEDNN_OPTS="1" if onednn else "0")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tputrain-compile-") as model_dir:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, os.path.dirname(os.path.abspath(__file__)),
             str(replicas), str(args.size), str(args.batch), str(args.steps),
             str(args.steps_per_loop), model_dir], env=env, capture_output=True, text=True,
            cwd=model_dir)  # not the checkout: PYTHONPATH says which tputrain runs
    if done.returncode:
        raise RuntimeError(f"{replicas} replicas, oneDNN {onednn}:\n{done.stderr[-3000:]}")
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), "load_before": list(load),
            "load_after": list(os.getloadavg())}


def summary(trials: dict[str, list[dict]], replicas: list[int]) -> dict:
    """The trials, each case's medians and N replicas over 1 (medians), per oneDNN setting."""
    medians = {name: {key: statistics.median(t[key] for t in values)
                      for key in ("compile", "train_cpu", "train_wall", "loop_graph_ops")}
               for name, values in trials.items()}
    ratios = {f"onednn_{o}-{n}_replicas": {
        key: medians[f"onednn_{o}-{n}_replicas"][key] / medians[f"onednn_{o}-1_replicas"][key]
        for key in ("compile", "train_cpu")}
        for o in ("on", "off") for n in replicas[1:]
        if f"onednn_{o}-1_replicas" in medians and f"onednn_{o}-{n}_replicas" in medians}
    return {"trials": trials, "medians": medians, "ratios_n_over_1": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--onednn", default="on,off", help="on, off or both (on,off)")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--steps_per_loop", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one repeat of 1 replica, 4 steps")
    result_file.add_arguments(parser, "compile_replicas")
    args = parser.parse_args()
    replicas = [int(r) for r in args.replicas.split(",")]
    onednn = [o == "on" for o in args.onednn.split(",")]
    if args.quick:
        replicas, onednn, args.steps, args.steps_per_loop = [1], onednn[:1], 4, 2
    trials: dict[str, list[dict]] = {}
    load = os.getloadavg()
    for _ in range(args.repeats):
        for on in onednn:
            for count in replicas:
                name = f"onednn_{'on' if on else 'off'}-{count}_replicas"
                trials.setdefault(name, []).append(case(count, on, args))
                last = trials[name][-1]
                log(f"{name}: compile {last['compile']:.1f}s, train() CPU "
                    f"{last['train_cpu']:.1f}s, load {last['load_before'][0]:.2f}")
    report = {"benchmark": "compile_replicas", "model": "MobileNet alpha 0.5",
              "size": args.size, "global_batch": args.batch, "steps": args.steps,
              "steps_per_loop": args.steps_per_loop, "cpu_count": os.cpu_count(),
              "lscpu_flags": cpu_flags(), "load_before": list(load),
              "load_after": list(os.getloadavg()), **summary(trials, replicas)}
    result_file.write(report, args.out, "compile_replicas", args.tag, quick=args.quick)


if __name__ == "__main__":
    main()
