"""Seconds from a process's last line to its exit, tputrain beside Keras `fit`.

    python benchmarks/exit_time.py              # ~5 minutes on 2 cores
    python benchmarks/exit_time.py --quick      # smoke run (JSON to stdout)

Writes one JSON document to benchmarks/results/<today>-exit_time[-<tag>].json
(`--out PATH`, `--out -` for stdout; progress on stderr). Each case is a fresh
process that trains a small model on the digits and prints its last line; the
parent timestamps every line it reads and the process's end: the gap between the
last line and the exit is what a person waits for a prompt (or a scheduler for
the next job) after the work is done. Cases, in one trial: the CLI
(`tputrain --gin_file=digits.gin`), a script with a `Trainer` on 1 and on 2
replicas, `tputrain.fit`, and Keras' own `model.fit` on the same model and data.
The goal: each tputrain case exits within 2 s of its last line, or within 1 s of
`model.fit`'s gap.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import result_file  # noqa: E402  (benchmarks/, this script's folder)
from machine import cpu_model, has_flag  # noqa: E402  (benchmarks/: the CPU's kind)

GOAL_SECONDS, GOAL_OVER_FIT = 2.0, 1.0

# The scripts' common part: the digits as NumPy arrays and a compiled Keras MLP.
_KERAS = """
import sys
import tputrain
import keras
import numpy as np
from sklearn.datasets import load_digits
digits = load_digits()
x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int64")
def build():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model
"""
_TRAINER = """
import sys
import tputrain
from tputrain.tasks.digits import DigitsTask
if sys.argv[3] == "2":
    tputrain.split_cpu(2)
trainer = tputrain.Trainer(DigitsTask(), sys.argv[1], train_steps=int(sys.argv[2]),
                           steps_per_loop=100, global_batch_size=64)
trainer.train()
print("last line", flush=True)
"""
SCRIPTS = {
    "keras_model_fit": _KERAS + """
steps = int(sys.argv[2])
build().fit(x, y, batch_size=64, epochs=max(1, steps * 64 // len(x)), verbose=2)
print("last line", flush=True)
""",
    "tputrain_fit": _KERAS + """
tputrain.fit(build(), (x, y), (x[:320], y[:320]), model_dir=sys.argv[1], batch_size=64,
             steps=int(sys.argv[2]), steps_per_loop=100)
print("last line", flush=True)
""",
    "script_1_replica": _TRAINER,
    "script_2_replicas": _TRAINER,
}


def log(message: str) -> None:
    print(f"[exit_time] {message}", file=sys.stderr, flush=True)


def command(case: str, folder: Path, steps: int) -> list[str]:
    model_dir = str(folder / case)
    if case == "cli":
        return [sys.executable, "-m", "tputrain.run", "--gin_file=digits.gin",
                f"--model_dir={model_dir}", f"--gin_param=Trainer.train_steps={steps}"]
    script = folder / f"{case}.py"
    script.write_text(textwrap.dedent(SCRIPTS[case]))
    return [sys.executable, str(script), model_dir, str(steps),
            "2" if case == "script_2_replicas" else "1"]


def time_exit(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    """Runs `argv`, stdout and stderr as one stream; seconds to its last line and
    from that line to the process's exit."""
    start = time.monotonic()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    last, tail = start, []
    for line in process.stdout:
        last = time.monotonic()
        tail = (tail + [line.rstrip()])[-5:]
    process.wait()
    end = time.monotonic()
    if process.returncode != 0:
        raise RuntimeError(f"{argv} exited {process.returncode}:\n" + "\n".join(tail))
    return {"to_last_line": last - start, "last_line_to_exit": end - last}


def cpu_kind() -> dict[str, Any]:
    """The processor and the vector extensions that change TensorFlow's speed."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return {"model": cpu_model(), "cores": os.cpu_count(),
            "flags": {flag: has_flag(flag) for flag in wanted},
            "avx512": has_flag("avx512f")}


def summarise(trials: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians per case, and each tputrain case against the goal."""
    cases = {case: {"last_line_to_exit_median": statistics.median(t["last_line_to_exit"] for t in runs),
                    "last_line_to_exit": [round(t["last_line_to_exit"], 2) for t in runs],
                    "to_last_line_median": statistics.median(t["to_last_line"] for t in runs)}
             for case, runs in trials.items()}
    fit = cases.get("keras_model_fit", {}).get("last_line_to_exit_median")
    goals = {}
    for case, result in cases.items():
        if case == "keras_model_fit":
            continue
        gap = result["last_line_to_exit_median"]
        bound = max(GOAL_SECONDS, fit + GOAL_OVER_FIT) if fit is not None else GOAL_SECONDS
        goals[case] = {"seconds": round(gap, 2), "bound": round(bound, 2), "met": gap <= bound}
    return {"cases": cases, "goals": goals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="trials of every case")
    parser.add_argument("--steps", type=int, default=300, help="train steps a case")
    parser.add_argument("--cases", default="cli,script_1_replica,script_2_replicas,"
                        "tputrain_fit,keras_model_fit", help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="one trial of 100 steps")
    result_file.add_arguments(parser, "exit_time")
    args = parser.parse_args()
    repeats, steps = (1, 100) if args.quick else (args.repeats, args.steps)
    cases = args.cases.split(",")
    load_before = os.getloadavg()
    trials: dict[str, list[dict[str, float]]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        env = dict(os.environ, TPUTRAIN_CACHE_DIR=str(folder / "cache"))
        env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as a user runs it
        time_exit(command("cli", folder / "warm-up", 2), env)  # digits' TFRecords, the peak probe
        for trial in range(repeats):
            for case in cases:  # interleaved: a load change hits every case alike
                result = time_exit(command(case, folder / f"trial{trial}", steps), env)
                trials[case].append(result)
                log(f"trial {trial} {case}: last line at {result['to_last_line']:.1f}s, "
                    f"exit {result['last_line_to_exit']:.2f}s later")
    report = {"benchmark": "exit_time", "steps": steps, "repeats": repeats,
              "goal": f"each tputrain case exits <= {GOAL_SECONDS} s after its last line, "
                      f"or <= keras_model_fit's gap + {GOAL_OVER_FIT} s",
              **summarise(trials),
              "machine": {"cpu": cpu_kind(), "load_average_before": load_before[0],
                          "load_average_after": os.getloadavg()[0],
                          "python": platform.python_version()}}
    result_file.write(report, args.out, "exit_time", args.tag, quick=args.quick)


if __name__ == "__main__":
    main()
