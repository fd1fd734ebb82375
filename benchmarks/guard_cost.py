"""What the NaN/Inf guard costs: guard on vs off on 1 replica, 2 replicas and 2 workers.

    python benchmarks/guard_cost.py                  # every run, 5 rounds, ~40 minutes
    python benchmarks/guard_cost.py --runs workers_2.mlp,replica_1.transformer
    python benchmarks/guard_cost.py --quick          # smoke run (JSON to stdout)

Writes benchmarks/results/<today>-guard_cost[-<tag>].json (`--out`, `--tag`). Guard on
is `NonFiniteGuard()` (policy "raise"), guard off `NonFiniteGuard(policy=None)`;
everything else is the Trainer's defaults. The figure is the median over rounds of
(steps per CPU-second with the guard on) / (the same with it off), the two measured
back to back in each round, their order alternating: on a shared machine a slow spell
hits both halves of a round alike, and CPU time counts this job's work only.

* `replica_1`, `replicas_2`: benchmarks/train_loop.py's `tputrain` and
  `tputrain_no_guard` contenders (its MLP and Transformer), each in a process of
  its own, timed from the end of each call's first loop to the end of its last; on
  2 replicas each process's CPU is split into 2 logical devices (MirroredStrategy).
* `workers_2`: each round one `tputrain launch --workers 2` run of train_loop.py's
  MLP with the guard on and one with it off (one MultiWorkerMirroredStrategy
  cluster on 127.0.0.1, in a private network namespace where `unshare` allows).
  Every worker notes its step and CPU time after each loop (`CpuClock`, this module
  imported with `--gin_import=guard_cost`); the rate is the steps from the end of
  the first loop to the end of the last over both workers' CPU time between them,
  so start-up, compilation and the final checkpoint are outside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gin

import result_file  # benchmarks/, this script's folder
import train_loop
import tputrain

HERE = Path(__file__).resolve().parent
GOAL = 0.99
RUNS = ("replica_1.mlp", "replica_1.transformer", "replicas_2.mlp", "replicas_2.transformer",
        "workers_2.mlp")


def log(message: str) -> None:
    print(f"[guard_cost] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------- inside a launched worker


@gin.configurable
class CpuClock(tputrain.Action):
    """Appends (step, wall time, this process's CPU time) after every loop to
    `out_dir/worker-<task index>.jsonl`."""

    def __init__(self, out_dir: str = gin.REQUIRED):
        index = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
        self.path = Path(out_dir) / f"worker-{index}.jsonl"

    def on_loop_end(self, context, step, logs) -> None:
        record = {"step": int(step), "wall": time.perf_counter(), "cpu": time.process_time()}
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")


gin.external_configurable(train_loop.MLPTask, "BenchMLPTask")

WORKER_CONFIG = """
Trainer.task = @BenchMLPTask()
BenchMLPTask.features = {features}
BenchMLPTask.hidden = {hidden}
Trainer.global_batch_size = {batch}
Trainer.train_steps = {steps}
Trainer.steps_per_loop = {loop}
Trainer.checkpoint_every = 1000000000
Trainer.eval_steps = 1
Trainer.seed = 0
Trainer.guard = @NonFiniteGuard()
NonFiniteGuard.policy = {policy}
Trainer.actions = [@CpuClock()]
CpuClock.out_dir = '{out_dir}'
"""


# ------------------------------------------------------------- the parent


def _in_netns(command: list[str]) -> list[str]:
    """`command` in a private network namespace with only loopback, where possible:
    TF's gRPC servers listen on every interface."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return command
    probe = subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"],
                           capture_output=True, check=False)
    if probe.returncode:
        return command
    return ["unshare", "-rn", "sh", "-c", "ip link set lo up && exec " + shlex.join(command)]


def launched_rate(guard: bool, args: argparse.Namespace, root: Path) -> dict[str, float]:
    """One 2-worker run: steps per CPU-second (both workers) and per wall second of
    its loops after the first."""
    run = Path(tempfile.mkdtemp(prefix=f"guard-{'on' if guard else 'off'}-", dir=root))
    quick = args.quick
    config = WORKER_CONFIG.format(
        features=64 if quick else 512, hidden="(128, 128)" if quick else "(1024, 1024)",
        batch=64 if quick else 256, steps=args.worker_steps, loop=args.worker_loop,
        policy="'raise'" if guard else "None", out_dir=run)
    (run / "config.gin").write_text(config)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = _in_netns([sys.executable, "-m", "tputrain.run", "launch", "--workers", "2",
                         "--gin_import=guard_cost", f"--gin_file={run / 'config.gin'}",
                         f"--model_dir={run / 'model'}"])
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False,
                          timeout=1800)
    if done.returncode:
        raise RuntimeError(f"tputrain launch exited {done.returncode}: {done.stderr[-3000:]}")
    clocks = [[json.loads(line) for line in (run / f"worker-{i}.jsonl").read_text().splitlines()]
              for i in range(2)]
    steps = clocks[0][-1]["step"] - clocks[0][0]["step"]
    cpu = sum(c[-1]["cpu"] - c[0]["cpu"] for c in clocks)
    wall = clocks[0][-1]["wall"] - clocks[0][0]["wall"]
    shutil.rmtree(run, ignore_errors=True)
    return {"steps_per_cpu_second": steps / cpu, "steps_per_second": steps / wall,
            "steps": steps}


def workers_2(args: argparse.Namespace) -> dict[str, Any]:
    """Guard on and off as 2-worker launches, alternating which goes first."""
    root = Path(tempfile.mkdtemp(prefix="guard-cost-"))
    rounds: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for repeat in range(args.repeats):
        for guard in ((True, False) if repeat % 2 == 0 else (False, True)):
            rounds["on" if guard else "off"].append(launched_rate(guard, args, root))
        log(f"workers_2: round {repeat + 1}/{args.repeats}: on/off "
            f"{rounds['on'][-1]['steps_per_cpu_second'] / rounds['off'][-1]['steps_per_cpu_second']:.3f}"
            f", load {os.getloadavg()[0]:.1f}")
    shutil.rmtree(root, ignore_errors=True)
    cpu = {k: [r["steps_per_cpu_second"] for r in v] for k, v in rounds.items()}
    wall = {k: [r["steps_per_second"] for r in v] for k, v in rounds.items()}
    return {"model": "MLP 512-1024-1024-10, Adam, global batch 256" if not args.quick
            else "MLP 64-128-128-10", "steps_per_run": args.worker_steps,
            "steps_per_loop": args.worker_loop,
            "guard_on_vs_off_cpu_paired": _paired(cpu["on"], cpu["off"]),
            "guard_on_vs_off_wall_paired": _paired(wall["on"], wall["off"]),
            "per_round_cpu": [a / b for a, b in zip(cpu["on"], cpu["off"])],
            "steps_per_cpu_second": {k: statistics.median(v) for k, v in cpu.items()},
            "steps_per_second": {k: statistics.median(v) for k, v in wall.items()}}


def _paired(on: list[float], off: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(on, off))


def replicas(count: int, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """train_loop.py's guard-on and guard-off contenders on `count` replicas."""
    kinds = [train_loop.TputrainContender, train_loop.TputrainNoGuardContender]
    spec = train_loop.workload(workload, args.quick)
    ks = [max(spec.ks)] if args.one_k else spec.ks  # the MLP's best in earlier runs: 50
    result = train_loop.run_workload(workload, args.quick, "float32", kinds, args.repeats,
                                     {}, ks=ks, replicas=count)
    key = "tputrain_vs_tputrain_no_guard"
    on, off = result["tputrain"], result["tputrain_no_guard"]
    k_on, k_off = str(on["best_steps_per_call"]), str(off["best_steps_per_call"])
    cpu_on = on["by_steps_per_call_cpu_time"][k_on]["all"]
    cpu_off = off["by_steps_per_call_cpu_time"][k_off]["all"]
    return {"model": train_loop.workload(workload, args.quick).model,
            "guard_on_vs_off_cpu_paired": result["ratios_cpu_time_paired"][key],
            "guard_on_vs_off_wall": result["ratios"][key],
            "per_round_cpu": [a / b for a, b in zip(cpu_on, cpu_off)],
            "steps_per_cpu_second": {"on": on["steps_per_cpu_second"],
                                     "off": off["steps_per_cpu_second"]},
            "steps_per_second": {"on": on["steps_per_second"], "off": off["steps_per_second"]},
            "train_loop_result": result}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (5)")
    parser.add_argument("--runs", default=",".join(RUNS), help="<setup>.<workload>, in order")
    parser.add_argument("--one_k", action="store_true",
                        help="only train_loop.py's largest steps per loop (half the time)")
    parser.add_argument("--worker_steps", type=int, default=None,
                        help="steps of each 2-worker run (300)")
    parser.add_argument("--worker_loop", type=int, default=50, help="steps per loop there")
    result_file.add_arguments(parser, "guard_cost")
    args = parser.parse_args()
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.worker_steps = args.worker_steps or (40 if args.quick else 300)
    if args.quick:
        args.worker_loop = min(args.worker_loop, 10)
    if any(run.split(".")[0] not in ("replica_1", "replicas_2", "workers_2")
           or (run.startswith("workers_2") and run != "workers_2.mlp") for run in args.runs.split(",")):
        parser.error(f"--runs: each one of {', '.join(RUNS)}")
    return args


def main() -> None:
    args = parse_args()
    started = time.time()
    report: dict[str, Any] = {
        "benchmark": "guard_cost", "command": " ".join(["python benchmarks/guard_cost.py",
                                                        *sys.argv[1:]]),
        "goal": GOAL, "repeats": args.repeats,
        "machine": {"cores": os.cpu_count(), "load_average_before": os.getloadavg()},
        "method": __doc__.split("\n\n", 2)[2].strip(), "setups": {}}
    loads = [os.getloadavg()[0]]
    out = args.out or ("-" if args.quick else str(result_file.dated_path("guard_cost", args.tag)))
    for run in args.runs.split(","):
        setup, name = run.split(".")
        if setup == "workers_2":
            report["setups"][run] = workers_2(args)
        else:
            report["setups"][run] = replicas(1 if setup == "replica_1" else 2, name, args)
        log(f"{run}: guard on/off (CPU, paired) "
            f"{report['setups'][run]['guard_on_vs_off_cpu_paired']:.3f}")
        loads.append(os.getloadavg()[0])
        report["machine"].update({"load_average_after": os.getloadavg(),
                                  "load_average_1min": {"min": min(loads), "max": max(loads)}})
        report["seconds"] = time.time() - started
        if out != "-":  # after every run: a stopped benchmark keeps what it measured
            result_file.write(report, out, "guard_cost")
    if out == "-":
        result_file.write(report, out, "guard_cost")


if __name__ == "__main__":
    main()
