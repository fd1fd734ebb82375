"""Communication: what a bfloat16 all-reduce and gradient packing buy, measured.

    python benchmarks/communication.py            # ~6 minutes on 2 cores
    python benchmarks/communication.py --quick    # smoke run, small model (JSON to stdout)

Writes one JSON document to benchmarks/results/<today>-communication[-<tag>].json
(`--out PATH`, `--out -` for stdout; progress goes to stderr). Three setups,
each in its own processes, train the same MLP (1024-2048-2048-10, 25 MB of
float32 gradients, SGD with momentum, random in-memory data) with the same
per-replica batch:

* `mirrored`: one process, the CPU split into logical devices, tputrain's
  MirroredStrategy over 2 and over 4 of them (the all-reduce is memory traffic);
* `workers_2`, `workers_4`: 2 and 4 worker processes on 127.0.0.1, one
  MultiWorkerMirroredStrategy cluster (the all-reduce goes over gRPC on loopback;
  TF_CONFIGs from `tputrain.distribution.launch.tf_configs`).

Within a setup every contender is built in the same processes: the all-reduce in
float32 or bfloat16 (`CommunicationOptions.allreduce_dtype`), and on workers
for each `CommunicationOptions.bytes_per_pack` (0: one pack; 64 KiB and 4 MiB:
three and two packs of this model's six gradients, `num_packs` in the JSON).
Each is traced and warmed up, then measured in rounds of one compiled loop
(`Trainer.run_loop`) each, contender order rotating every round; medians are
reported, and ratios are medians of per-round ratios. Beside wall-clock steps/s,
steps per CPU-second (summed over the setup's processes) are less disturbed by
other jobs on a shared machine. The all-reduce alone is timed in a compiled
loop (`tputrain.distribution.communication.measure_allreduce`, what every run's
`comm/allreduce_fraction` and `tputrain diagnose` use); divided by the step
time it gives its fraction of the step.

Note: TF's gRPC servers listen on all interfaces, not only 127.0.0.1; on a shared
network run this inside a private network namespace (`unshare -rn`, then
`ip link set lo up`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import result_file  # benchmarks/, this script's folder

KIB, MIB = 1 << 10, 1 << 20
PACKS = (0, 64 * KIB, 4 * MIB)
DTYPES = ("float32", "bfloat16")


def log(message: str) -> None:
    print(f"[communication] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small model, short loops, 2 repeats: a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="measured rounds (5)")
    parser.add_argument("--steps", type=int, default=None, help="steps per loop (5)")
    parser.add_argument("--batch", type=int, default=16, help="examples per replica")
    parser.add_argument("--setups", default="mirrored,workers_2,workers_4")
    # Internal: one process of a setup.
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    result_file.add_arguments(parser, "communication")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.steps = args.steps or (2 if args.quick else 5)
    args.widths = (256, 512, 512) if args.quick else (1024, 2048, 2048)
    return args


# --------------------------------------------------------------- one process


def build_task(widths: tuple[int, ...], batch: int) -> Any:
    """The MLP task (imports TensorFlow: only in the setup's processes)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tputrain

    class MLPTask(tputrain.Task):
        """features -> Dense(width, relu)... -> 10 logits, on random in-memory batches."""

        def build_model(self) -> keras.Model:
            x = inputs = keras.Input((widths[0],), name="x")
            for units in widths[1:]:
                x = keras.layers.Dense(units, activation="relu")(x)
            return keras.Model({"x": inputs}, keras.layers.Dense(10, dtype="float32")(x))

        def build_inputs(self, split, input_context):
            per_replica = input_context.get_per_replica_batch_size(
                input_context.global_batch_size)
            rng = np.random.RandomState(input_context.input_pipeline_id)
            x = rng.randn(8 * per_replica, widths[0]).astype(np.float32)
            y = rng.randint(0, 10, 8 * per_replica).astype(np.int64)
            dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y))
            dataset = dataset.batch(per_replica, drop_remainder=True).cache()
            return (dataset.repeat() if split == "train" else dataset).prefetch(2)

        def compute_loss(self, labels, outputs):
            return keras.losses.sparse_categorical_crossentropy(labels, outputs,
                                                                from_logits=True)

        def build_optimizer(self):
            return keras.optimizers.SGD(1e-3, momentum=0.9)

    return MLPTask()


def pack_label(pack: int) -> str:
    """0, 64KiB, 4MiB."""
    return f"{pack // MIB}MiB" if pack >= MIB else f"{pack // KIB}KiB" if pack else "0"


def use_pack(trainer: Any) -> None:
    """Makes the next traced collectives of `trainer`'s strategy pack `bytes_per_pack`.

    MultiWorkerMirroredStrategy reads its communication options when a function is
    traced. One cluster serves every pack size, so that they are measured in
    interleaved rounds: two such strategies in one process clash on collective
    keys. A benchmark-only trick; a run sets `CommunicationOptions.bytes_per_pack`.
    """
    if hasattr(trainer.strategy.extended, "_communication_options"):
        trainer.strategy.extended._communication_options = (  # pylint: disable=protected-access
            trainer.communication.for_multi_worker())


def build_contenders(setup: str, args: argparse.Namespace) -> dict[str, Any]:
    """{name: Trainer}: each all-reduce dtype on each strategy (mirrored) or pack size
    (workers) of the setup."""
    import tensorflow as tf

    import tputrain
    from tputrain.distribution.communication import CommunicationOptions

    if setup == "mirrored":
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        variants = [(f"{n}_replicas_", tf.distribute.MirroredStrategy(
            cpus[:n], cross_device_ops=tf.distribute.ReductionToOneDevice()), 0) for n in (2, 4)]
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        variants = [(f"pack_{pack_label(pack)}_", strategy, pack) for pack in PACKS]
    contenders = {}
    for prefix, strategy, pack in variants:
        for dtype in DTYPES:
            replicas = strategy.num_replicas_in_sync
            contenders[prefix + dtype] = tputrain.Trainer(
                build_task(args.widths, args.batch), tempfile.mkdtemp(prefix="tputrain-comm-"),
                strategy=strategy, train_steps=10**9, steps_per_loop=args.steps,
                global_batch_size=args.batch * replicas, report_mfu=False,
                communication=CommunicationOptions(allreduce_dtype=dtype, bytes_per_pack=pack))
    return contenders


def num_packs(trainer: Any) -> int:
    """How many all-reduces the gradients are packed into (TF's own grouping, which
    packs them in reverse order and never splits a tensor)."""
    from tensorflow.python.distribute import cross_device_utils  # pylint: disable=no-name-in-module

    import tensorflow as tf

    wire = tf.as_dtype(trainer.communication.allreduce_dtype)
    specs = [tf.TensorSpec(v.shape, wire) for v in trainer.model.trainable_variables]
    return len(cross_device_utils.group_by_size(specs[::-1], trainer.communication.bytes_per_pack))


def allreduce_alone(trainer: Any, repeats: int) -> dict[str, float]:
    """The all-reduce of the trainer's gradients alone, in a compiled loop (as the
    measurement behind `comm/allreduce_fraction` times it, with more time)."""
    from tputrain.distribution.communication import gradient_bytes, measure_allreduce
    from tputrain.loop.hosts import MaxOverHosts

    strategy, dtype = trainer.strategy, trainer.communication.allreduce_dtype
    variables = trainer.model.trainable_variables
    use_pack(trainer)
    return {"replicas": strategy.num_replicas_in_sync, "global_batch": trainer.global_batch_size,
            "num_packs": num_packs(trainer) if trainer.num_hosts > 1 else None,
            "gradient_bytes": gradient_bytes(variables, dtype, strategy.num_replicas_in_sync),
            "allreduce_seconds": measure_allreduce(
                strategy, variables, dtype, 1.0, MaxOverHosts(strategy, trainer.num_hosts),
                repeats=repeats)}


def measure_process(setup: str, args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of one loop per contender (order rotating), then the all-reduce alone."""
    contenders = build_contenders(setup, args)
    names = list(contenders)
    for trainer in contenders.values():  # traced and warmed up, not timed
        use_pack(trainer)
        trainer.run_loop(args.steps)
        trainer.run_loop(args.steps)
    results = {name: {"wall": [], "cpu": []} for name in names}
    for round_ in range(args.repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = time.perf_counter(), time.process_time()
            _, steps, _ = contenders[name].run_loop(args.steps)
            assert steps == args.steps, (name, steps)
            results[name]["wall"].append(time.perf_counter() - wall)
            results[name]["cpu"].append(time.process_time() - cpu)
    for name in names:
        results[name].update(allreduce_alone(contenders[name], args.repeats))
    return results


def worker_main(args: argparse.Namespace) -> None:
    """One process of a setup: measures, writes its JSON to `--worker_out`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from absl import logging

    import tputrain
    from tputrain.distribution.strategy import split_cpu

    logging.set_verbosity(logging.WARNING)
    tputrain.show_progress(False)
    if args.worker == "mirrored":
        split_cpu(4)
    results = measure_process(args.worker, args)
    with open(args.worker_out, "w") as out:
        json.dump(results, out)


# --------------------------------------------------------------- the parent


def run_setup(setup: str, args: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    """Starts the setup's processes (TF_CONFIG each for workers), returns their results."""
    from tputrain.distribution.launch import tf_configs  # no TensorFlow in the parent

    count = int(setup.split("_")[1]) if setup.startswith("workers_") else 1
    configs = tf_configs(count) if count > 1 else [None]
    work = tempfile.mkdtemp(prefix="tputrain-comm-bench-")
    processes = []
    for index, config in enumerate(configs):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("TF_CONFIG", None)
        if config:
            env["TF_CONFIG"] = config
        out, err = os.path.join(work, f"{index}.json"), open(os.path.join(work, f"{index}.log"), "w")
        command = [sys.executable, os.path.abspath(__file__), *argv,
                   "--worker", "mirrored" if count == 1 else "workers", "--worker_out", out]
        processes.append((subprocess.Popen(command, env=env, stdout=err, stderr=err), out, err))
    results = []
    for process, out, err in processes:
        code = process.wait(timeout=1800)
        err.close()
        if code:
            with open(err.name) as text:
                raise SystemExit(f"{setup}: a process exited {code}:\n{text.read()[-3000:]}")
        with open(out) as data:
            results.append(json.load(data))
    return results


def summarise(processes: list[dict[str, Any]], steps: int) -> dict[str, dict[str, Any]]:
    """Per contender: medians over rounds (wall from process 0, the chief; CPU time
    summed over the processes), the all-reduce alone and its fraction of the step."""
    summary = {}
    for name, chief in processes[0].items():
        cpu = [sum(p[name]["cpu"][r] for p in processes) for r in range(len(chief["wall"]))]
        rate = statistics.median(steps / w for w in chief["wall"])
        summary[name] = {
            "steps_per_second": rate,
            "steps_per_cpu_second": statistics.median(steps / c for c in cpu),
            "examples_per_second": rate * chief["global_batch"],
            "step_ms": 1e3 / rate, "replicas": chief["replicas"], "num_packs": chief["num_packs"],
            "gradient_bytes": chief["gradient_bytes"],
            "allreduce_ms": 1e3 * chief["allreduce_seconds"],
            "allreduce_fraction": min(1.0, chief["allreduce_seconds"] * rate),
            "_per_round": {"wall": chief["wall"], "cpu": cpu},
        }
    return summary


def ratio(summary: dict[str, dict[str, Any]], a: str, b: str) -> dict[str, float]:
    """a over b: medians of per-round ratios of steps/s (wall and CPU), and of all-reduce time."""
    rounds_a, rounds_b = summary[a]["_per_round"], summary[b]["_per_round"]
    return {
        "steps_per_second": statistics.median(
            wb / wa for wa, wb in zip(rounds_a["wall"], rounds_b["wall"])),
        "steps_per_cpu_second": statistics.median(
            cb / ca for ca, cb in zip(rounds_a["cpu"], rounds_b["cpu"])),
        "allreduce_time": summary[a]["allreduce_ms"] / max(summary[b]["allreduce_ms"], 1e-9),
    }


def ratios(setup: str, summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """bf16 against fp32 on each strategy; each pack size against one pack (fp32, bf16)."""
    out = {}
    prefixes = sorted({name.rsplit("_", 1)[0] + "_" for name in summary})
    for prefix in prefixes:
        out[f"{setup}.{prefix}bf16_vs_fp32"] = ratio(summary, prefix + "bfloat16",
                                                     prefix + "float32")
    for prefix in prefixes:
        if prefix.startswith("pack_") and prefix != "pack_0_":
            for dtype in DTYPES:
                out[f"{setup}.{prefix}vs_pack_0.{dtype}"] = ratio(
                    summary, prefix + dtype, "pack_0_" + dtype)
    return out


def environment() -> dict[str, Any]:
    import importlib.metadata as metadata

    return {"tensorflow": metadata.version("tensorflow"), "keras": metadata.version("keras"),
            "python": platform.python_version(), "cores": os.cpu_count(),
            "load_average_before": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    report: dict[str, Any] = {
        "command": "python benchmarks/communication.py " + " ".join(argv),
        "environment": environment(),
        "model": {"widths": [*args.widths, 10], "per_replica_batch": args.batch,
                  "steps_per_loop": args.steps, "repeats": args.repeats,
                  "optimizer": "SGD(momentum=0.9)"},
        "setups": {}, "ratios": {}}
    started = time.perf_counter()
    for setup in args.setups.split(","):
        log(f"{setup}: starting")
        summary = summarise(run_setup(setup, args, argv), args.steps)
        report["ratios"].update(ratios(setup, summary))
        for record in summary.values():
            record.pop("_per_round")
        report["setups"][setup] = summary
        log(f"{setup}: done at {time.perf_counter() - started:.0f} s")
    report["environment"]["load_average_after"] = os.getloadavg()[0]
    report["environment"]["seconds"] = round(time.perf_counter() - started, 1)
    result_file.write(report, args.out, "communication", args.tag, args.quick)


if __name__ == "__main__":
    main()
