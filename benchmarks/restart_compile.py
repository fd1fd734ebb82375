"""A rerun's time to its first trained step: XLA's compilation cache and lean tracing.

    python benchmarks/restart_compile.py --configs digits.gin --steps 200 --repeats 5
    python benchmarks/restart_compile.py --quick         # smoke run (JSON to stdout)

A config is trained for `--steps` steps once (its checkpoint, and the XLA cache
that run fills); then, interleaved, `--repeats` reruns of a copy of that
model_dir each train `--steps` more steps, once per case, each case a setting
of the two switches:

- `neither`: `TPUTRAIN_COMPILE_CACHE=off`, `TPUTRAIN_LEAN_TRACING=off`;
- `xla_cache`: a copy of the filled cache (every rerun finds what the first run
  compiled, as a restarted job would), lean tracing off;
- `lean_tracing`: the cache off, lean tracing on (`tputrain/core/tracing.py`);
- `both`: the cache and lean tracing (the default).

Each rerun's goodput record (`model_dir/goodput/run-*.json`) gives its start-up
(process start to the end of the restore and the actions' set-up: the account's
`restart` bucket for a rerun) and the first loop's `compile` seconds; their sum
is the time from process start to the first trained step's loop. On a loaded
machine those wall times swing with the load; the record's CPU seconds (all
threads, from process start) at `train()`'s start and at the end of the first
loop (`cpu_to_first_loop`) swing far less. Also kept: the rerun's wall and CPU
seconds as a whole process (with its final eval, save and export) and the load
average before each rerun. Medians, and each case over `neither`.

Only XLA programs are cached: a config whose step runs without XLA (digits'
dropout on CPU, see `Trainer.jit_compile`) gains nothing from the cache.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import result_file  # noqa: E402  (benchmarks/, this script's folder)

CASES = {"neither": (False, False), "xla_cache": (True, False),
         "lean_tracing": (False, True), "both": (True, True)}  # (cache, lean tracing)


def log(message: str) -> None:
    print(f"[restart_compile] {message}", file=sys.stderr, flush=True)


def run(config: str, model_dir: str, steps: int, cache: str, lean: bool = True) -> dict:
    """One CLI run to `steps`: its newest goodput record, and the process's wall and
    CPU seconds."""
    env = dict(os.environ, TPUTRAIN_COMPILE_CACHE=cache, TF_CPP_MIN_LOG_LEVEL="2",
               TPUTRAIN_LEAN_TRACING="on" if lean else "off")
    env.pop("TF_XLA_FLAGS", None)
    command = [sys.executable, "-m", "tputrain.run", f"--gin_file={config}",
               f"--model_dir={model_dir}", f"--gin_param=Trainer.train_steps={steps}",
               f"--gin_param=Trainer.checkpoint_every={steps}",
               f"--gin_param=Trainer.eval_every={steps}"]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    records = sorted(glob.glob(os.path.join(model_dir, "goodput", "run-*.json")),
                     key=lambda path: int(path.rsplit("-", 1)[1].split(".")[0]))
    with open(records[-1]) as record:
        data = json.load(record)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**data, "process": {"wall": wall, "cpu": cpu}}


def first_step_seconds(record: dict) -> dict:
    """Start-up (its parts too), compile, their sum, the process's wall and CPU."""
    startup = sum(record["startup"].values())
    compile_seconds = record["seconds"]["compile"]
    later_steps, later_seconds = record.get("later_loops") or (0, 0.0)
    return {"startup": startup, "compile": compile_seconds,
            "to_first_loop": startup + compile_seconds,
            **{f"startup_{name}": value for name, value in record["startup"].items()},
            "cpu_to_train_begin": record["cpu"]["train_begin"],
            "cpu_to_first_loop": record["cpu"]["first_loop_end"],
            "process_wall": record["process"]["wall"], "process_cpu": record["process"]["cpu"],
            "seconds_per_later_step": later_seconds / later_steps if later_steps else None}


def rerun(config: str, base: str, cache: str, root: str, case: str, repeat: int,
          steps: int) -> dict:
    """One rerun of a copy of `base` in `case`; its figures and the load before it."""
    with_cache, lean = CASES[case]
    model_dir = os.path.join(root, f"{case}-{repeat}")
    shutil.copytree(base, model_dir)
    setting = "off"
    if with_cache:
        setting = os.path.join(root, f"cache-{case}-{repeat}")
        shutil.copytree(cache, setting)
    load = os.getloadavg()[0]
    figures = first_step_seconds(run(config, model_dir, 2 * steps, setting, lean))
    shutil.rmtree(model_dir, ignore_errors=True)
    return {**figures, "load_1min_before": load}


def medians(trials: list[dict]) -> dict:
    return {key: statistics.median(t[key] for t in trials) for key in trials[0]
            if all(t[key] is not None for t in trials)}


def measure(config: str, steps: int, repeats: int, root: str, cases: list[str]) -> dict:
    base, cache = os.path.join(root, "base"), os.path.join(root, "cache")
    log(f"{config}: first run to step {steps} (fills the cache)")
    run(config, base, steps, cache)
    entries = sum(len(files) for _, _, files in os.walk(cache))
    trials: dict[str, list[dict]] = {case: [] for case in cases}
    for repeat in range(repeats):
        for case in cases:  # interleaved
            trials[case].append(rerun(config, base, cache, root, case, repeat, steps))
            log(f"{config} {case} #{repeat}: to first loop "
                f"{trials[case][-1]['to_first_loop']:.2f}s, load {trials[case][-1]['load_1min_before']:.1f}")
    middle = {case: medians(values) for case, values in trials.items()}
    reference = middle.get("neither")
    ratios = {case: {key: middle[case][key] / reference[key]
                     for key in ("to_first_loop", "startup", "compile", "cpu_to_first_loop",
                                 "cpu_to_train_begin", "process_wall", "process_cpu")}
              for case in cases if reference and case != "neither"}
    return {"config": config, "steps": steps, "cache_entries": entries, "trials": trials,
            "medians": middle, "ratios_vs_neither": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="digits.gin")
    parser.add_argument("--steps", type=int, default=200,
                        help="a multiple of the config's steps_per_fetch (digits: 100)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--quick", action="store_true", help="one config, one repeat, 100 steps")
    result_file.add_arguments(parser, "restart_compile")
    args = parser.parse_args()
    configs = args.configs.split(",")[:1] if args.quick else args.configs.split(",")
    steps, repeats = (100, 1) if args.quick else (args.steps, args.repeats)
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}: use {', '.join(CASES)}")
    load = os.getloadavg()
    results = []
    for config in configs:
        with tempfile.TemporaryDirectory(prefix="tputrain-restart-") as root:
            results.append(measure(config, steps, repeats, root, cases))
    report = {"benchmark": "restart_compile", "load_before": load, "load_after": os.getloadavg(),
              "cpu_count": os.cpu_count(), "results": results}
    result_file.write(report, args.out, "restart_compile", args.tag, quick=args.quick)


if __name__ == "__main__":
    main()
