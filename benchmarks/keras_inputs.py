"""`tputrain.fit`'s train input from a batched dataset: KerasTask's pipeline against the
one it replaced, per batch, in CPU time of the process (the input threads' included).

    python benchmarks/keras_inputs.py                 # ~1 minute
    python benchmarks/keras_inputs.py --quick         # smoke run (JSON to stdout)

Writes one JSON document to benchmarks/results/<today>-keras_inputs[-<tag>].json.

The user's dataset is the training-loop benchmark's MLP input: 16 cached batches of
256 x 512 float32 features and int64 labels, `.batch(256, drop_remainder=True)`.
Contenders, for 1 and 2 replicas (per-replica batches of 256 and 128):
* `keras_task`: `KerasTask.build_inputs("train")`, which cuts the replicas' slices
  from the user's batches (`rebatch`);
* `unbatch_batch`: the pipeline it replaced (before 2026-11-30): the user's dataset
  unbatched, repeated and batched again per replica;
* `as_is`: the user's batches repeated, untouched (what `fit` reads on one replica):
  the floor.
Rounds rotate the order; each contender drains a fresh iterator (a warm-up, then a
fixed number of batches in a compiled loop, `input_pipeline.drain`). Medians of CPU
milliseconds a batch, and the ratios `unbatch_batch / keras_task` (> 1: the new
pipeline costs less) measured side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import result_file  # noqa: E402  (benchmarks/, this script's folder)
from input_pipeline import drain  # noqa: E402
from machine import cpu_kind, cpu_model  # noqa: E402
import tputrain  # noqa: E402
from tputrain.data import InputContext  # noqa: E402

GLOBAL_BATCH = 256


def log(message: str) -> None:
    print(f"[keras_inputs] {message}", file=sys.stderr, flush=True)


def user_dataset(features: int, batches: int) -> tf.data.Dataset:
    rng = np.random.RandomState(0)
    x = rng.randn(batches * GLOBAL_BATCH, features).astype(np.float32)
    y = rng.randint(0, 10, batches * GLOBAL_BATCH).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(
        GLOBAL_BATCH, drop_remainder=True).cache()


def contenders(data: tf.data.Dataset, replicas: int) -> dict[str, tf.data.Dataset]:
    model = keras.Sequential([keras.Input((data.element_spec[0]["x"].shape[-1],), name="x"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    task = tputrain.KerasTask(model, data, shuffle=False)
    rows = GLOBAL_BATCH // replicas
    context = InputContext(num_input_pipelines=1, input_pipeline_id=0,
                           num_replicas_in_sync=replicas, global_batch_size=GLOBAL_BATCH)
    return {"keras_task": task.build_inputs("train", context),
            "unbatch_batch": data.unbatch().repeat().batch(rows, drop_remainder=True),
            "as_is": data.repeat()}


def cpu_ms_per_batch(dataset: tf.data.Dataset, batches: int) -> float:
    iterator = iter(dataset)
    drain(iterator, tf.constant(max(2, batches // 4)))  # warm-up
    start = time.process_time()
    drain(iterator, tf.constant(batches))
    return 1e3 * (time.process_time() - start) / batches


def bench(replicas: int, repeats: int, batches: int, features: int) -> dict:
    datasets = contenders(user_dataset(features, 16), replicas)
    names = list(datasets)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            times[name].append(cpu_ms_per_batch(datasets[name], batches))
        log(f"{replicas} replica(s), round {round_index + 1}/{repeats}: " + ", ".join(
            f"{n} {times[n][-1]:.3f} ms" for n in names))
    medians = {name: statistics.median(values) for name, values in times.items()}
    paired = [old / new for old, new in zip(times["unbatch_batch"], times["keras_task"])]
    return {"per_replica_batch": GLOBAL_BATCH // replicas,
            "cpu_ms_per_batch": {n: round(v, 4) for n, v in medians.items()},
            "all_cpu_ms_per_batch": {n: [round(x, 4) for x in v] for n, v in times.items()},
            "unbatch_batch_vs_keras_task_cpu": round(statistics.median(paired), 3),
            "keras_task_vs_as_is_cpu": round(medians["keras_task"] / medians["as_is"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batches, two rounds")
    parser.add_argument("--repeats", type=int, default=7)
    result_file.add_arguments(parser, "keras_inputs")
    args = parser.parse_args()
    repeats, batches, features = (2, 20, 16) if args.quick else (args.repeats, 400, 512)
    load_before = os.getloadavg()
    start = time.perf_counter()
    results = {f"replicas_{r}": bench(r, repeats, batches, features) for r in (1, 2)}
    report = {"benchmark": "keras_inputs",
              "command": "python benchmarks/keras_inputs.py " + " ".join(sys.argv[1:]),
              "machine": {"cpu": cpu_model(), "cpu_flags": cpu_kind(), "cores": os.cpu_count(),
                          "tensorflow": tf.__version__, "load_average_before": load_before,
                          "load_average_after": os.getloadavg()},
              "method": __doc__.split("\n\n", 2)[2].strip(),
              "batches_a_round": batches, "rounds": repeats, "results": results,
              "seconds": time.perf_counter() - start}
    result_file.write(report, args.out, "keras_inputs", args.tag, args.quick)


if __name__ == "__main__":
    main()
