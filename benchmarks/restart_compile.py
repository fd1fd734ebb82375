"""A rerun's time to its first trained step, with and without XLA's compilation cache.

    python benchmarks/restart_compile.py                 # ~5 minutes on 2 cores
    python benchmarks/restart_compile.py --quick         # smoke run (JSON to stdout)

A config is trained for `--steps` steps once (its checkpoint, and the cache
that run fills); then, interleaved, `--repeats` reruns of a copy of that
model_dir each train `--steps` more steps: without the cache
(`TPUTRAIN_COMPILE_CACHE=off`) and with it (a copy of the filled cache, so
every rerun finds what the first run compiled, as a restarted job would).
Each rerun's goodput record (`model_dir/goodput/run-*.json`) gives its
start-up (process start to the end of the restore and the actions' set-up)
and the first loop's `compile` seconds; their sum is the time from process
start to the first trained step's loop. Medians, and with/without ratios.

Only XLA programs are cached: a config whose step runs without XLA (digits'
dropout on CPU, see `Trainer.jit_compile`) shows no saving.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import result_file  # noqa: E402  (benchmarks/, this script's folder)


def log(message: str) -> None:
    print(f"[restart_compile] {message}", file=sys.stderr, flush=True)


def run(config: str, model_dir: str, steps: int, cache: str) -> dict:
    """One CLI run to `steps`; its newest goodput record."""
    env = dict(os.environ, TPUTRAIN_COMPILE_CACHE=cache, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_XLA_FLAGS", None)
    command = [sys.executable, "-m", "tputrain.run", f"--gin_file={config}",
               f"--model_dir={model_dir}", f"--gin_param=Trainer.train_steps={steps}",
               f"--gin_param=Trainer.checkpoint_every={steps}",
               f"--gin_param=Trainer.eval_every={steps}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    records = sorted(glob.glob(os.path.join(model_dir, "goodput", "run-*.json")),
                     key=lambda path: int(path.rsplit("-", 1)[1].split(".")[0]))
    with open(records[-1]) as record:
        return json.load(record)


def first_step_seconds(record: dict) -> dict:
    startup = sum(record["startup"].values())
    compile_seconds = record["seconds"]["compile"]
    return {"startup": startup, "compile": compile_seconds, "to_first_loop": startup + compile_seconds}


def measure(config: str, steps: int, repeats: int, root: str) -> dict:
    base, cache = os.path.join(root, "base"), os.path.join(root, "cache")
    log(f"{config}: first run to step {steps} (fills the cache)")
    run(config, base, steps, cache)
    entries = sum(len(files) for _, _, files in os.walk(cache))
    trials: dict[str, list[dict]] = {"without_cache": [], "with_cache": []}
    for repeat in range(repeats):
        for case in trials:  # interleaved
            model_dir = os.path.join(root, f"{case}-{repeat}")
            shutil.copytree(base, model_dir)
            setting = "off"
            if case == "with_cache":
                setting = os.path.join(root, f"cache-{repeat}")
                shutil.copytree(cache, setting)
            record = run(config, model_dir, 2 * steps, setting)
            trials[case].append(first_step_seconds(record))
            log(f"{config} {case} #{repeat}: {trials[case][-1]}")
    medians = {case: {key: statistics.median(t[key] for t in values) for key in values[0]}
               for case, values in trials.items()}
    return {"config": config, "steps": steps, "cache_entries": entries, "trials": trials,
            "medians": medians,
            "ratio_to_first_loop": medians["with_cache"]["to_first_loop"]
            / medians["without_cache"]["to_first_loop"],
            "ratio_compile": medians["with_cache"]["compile"] / medians["without_cache"]["compile"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="synthetic_transformer.gin,digits.gin")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one config, one repeat, 10 steps")
    result_file.add_arguments(parser, "restart_compile")
    args = parser.parse_args()
    configs = args.configs.split(",")[:1] if args.quick else args.configs.split(",")
    steps, repeats = (10, 1) if args.quick else (args.steps, args.repeats)
    load = os.getloadavg()
    results = []
    for config in configs:
        with tempfile.TemporaryDirectory(prefix="tputrain-restart-") as root:
            results.append(measure(config, steps, repeats, root))
    report = {"benchmark": "restart_compile", "load_before": load, "load_after": os.getloadavg(),
              "cpu_count": os.cpu_count(), "results": results}
    result_file.write(report, args.out, "restart_compile", args.tag, quick=args.quick)


if __name__ == "__main__":
    main()
