"""Input pipeline: TFRecordInput against a naive pipeline and the raw read ceiling,
and the input stall that training and `tputrain diagnose` report for the configs.

    python benchmarks/input_pipeline.py            # ~5-10 minutes on 2 busy cores
    python benchmarks/input_pipeline.py --quick    # smoke run (JSON to stdout)

Writes one JSON document to benchmarks/results/<today>-input_pipeline[-<tag>].json
(`--out PATH`, `--out -` for stdout; progress goes to stderr).

1. Reading (one process, side by side): 16 shards of parse-heavy examples (512
   floats, 64 int64 tokens, a label and a raw 32x32x3 image as one bytes value,
   the set FINDINGS measured), written to a temp dir (read from the page cache);
   then the same with the image as a uint8 array, which `write_tfrecords` stores
   as 3072 int64 varints (`reading_int64_image`): decoding those dominates and
   costs the same per value whether parsed per example or per batch. Contenders:
   * `naive`: one sequential `TFRecordDataset` over all files, per-example
     `tf.io.parse_single_example` mapped serially, batch, no prefetch;
   * `tfrecord_input`: `TFRecordInput` as used for training (file shuffle,
     interleaved reads, record shuffle, batch-then-parse, prefetch);
   * `tfrecord_input_no_shuffle`: the same without shuffling;
   * `raw_read`: the same bytes read sequentially, batched and prefetched, never
     parsed (the issue's ceiling);
   * `raw_read_interleaved`: read like TFRecordInput reads (16 files interleaved
     in parallel), never parsed: the ceiling for TFRecordInput's own reading.
   Rounds (contender order rotating) run one contender at a time on a fresh
   iterator: a warm-up (fills shuffle and prefetch buffers), then a fixed number
   of batches drained by a compiled loop (no Python per batch); medians of
   examples/s are reported with the ratios.
2. Training: `tputrain --gin_file=C` runs in a subprocess for digits.gin,
   synthetic_transformer.gin and slow_input.gin (shortened where noted), and the
   `input/stall_fraction` each loop wrote to TensorBoard is read back; the
   median over loops after the first (which also holds tracing) is reported.
3. `tputrain diagnose --json` on the same configs: stall, bottleneck, run time.

The machine is shared with other jobs: compare ratios measured side by side,
and expect run-to-run noise of several percent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tputrain.data import InputContext, TFRecordInput, write_tfrecords  # noqa: E402
import result_file  # noqa: E402  (benchmarks/, this script's folder)

NUM_SHARDS = 16
BATCH = 256


def log(message: str) -> None:
    print(f"[input_pipeline] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ reading


def write_data(directory: str, num_examples: int, image_as: str) -> tuple[list[str], dict]:
    """16 shards; the image is a uint8 [32, 32, 3] array (stored by write_tfrecords as
    3072 int64 varints: parse-heavy) or its raw bytes (one bytes value: light)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(num_examples, 32, 32, 3), dtype=np.uint8)
    examples = {
        "floats": rng.normal(size=(num_examples, 512)).astype(np.float32),
        "image": (images if image_as == "uint8_array"
                  else np.array([image.tobytes() for image in images], dtype=object)),
        "tokens": rng.integers(0, 30000, size=(num_examples, 64)),
        "label": rng.integers(0, 1000, size=num_examples),
    }
    paths = write_tfrecords(examples, os.path.join(directory, "bench"), NUM_SHARDS)
    image_spec = (tf.io.FixedLenFeature([32, 32, 3], tf.int64) if image_as == "uint8_array"
                  else tf.io.FixedLenFeature([], tf.string))
    spec = {"floats": tf.io.FixedLenFeature([512], tf.float32),
            "image": image_spec,
            "tokens": tf.io.FixedLenFeature([64], tf.int64),
            "label": tf.io.FixedLenFeature([], tf.int64)}
    return paths, spec


def contenders(paths: list[str], spec: dict) -> dict[str, tf.data.Dataset]:
    def naive() -> tf.data.Dataset:
        records = tf.data.TFRecordDataset(paths).repeat()  # one reader, file after file
        return records.map(lambda r: tf.io.parse_single_example(r, spec)).batch(
            BATCH, drop_remainder=True)

    def raw_read() -> tf.data.Dataset:  # the ceiling: sequential, no parsing
        records = tf.data.TFRecordDataset(paths).repeat()
        return records.batch(BATCH, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    def raw_read_interleaved() -> tf.data.Dataset:  # TFRecordInput's reads, no parsing
        files = tf.data.Dataset.from_tensor_slices(paths).repeat()
        records = files.interleave(tf.data.TFRecordDataset, cycle_length=NUM_SHARDS,
                                   num_parallel_calls=tf.data.AUTOTUNE)
        return records.batch(BATCH, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    context = InputContext(global_batch_size=BATCH)
    pattern = os.path.join(os.path.dirname(paths[0]), "bench-*.tfrecord")
    return {
        "naive": naive(),
        "tfrecord_input": TFRecordInput(pattern, spec, label_key="label")(context),
        "tfrecord_input_no_shuffle": TFRecordInput(pattern, spec, label_key="label",
                                                   shuffle=False)(context),
        "raw_read": raw_read(),
        "raw_read_interleaved": raw_read_interleaved(),
    }


@tf.function
def drain(iterator, n):
    for _ in tf.range(n):
        tf.nest.map_structure(tf.identity, iterator.get_next())
    return n


def bench_reading(num_examples: int, repeats: int, image_as: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="tputrain-bench-") as directory:
        start = time.perf_counter()
        paths, spec = write_data(directory, num_examples, image_as)
        size = sum(os.path.getsize(p) for p in paths)
        log(f"wrote {num_examples} examples, {size / 2**20:.0f} MB in {NUM_SHARDS} shards in "
            f"{time.perf_counter() - start:.1f}s")
        datasets = contenders(paths, spec)
        batches = max(4, num_examples // BATCH // 2)  # half an epoch per round
        warmup = tf.constant(max(2, batches // 2))
        rates: dict[str, list[float]] = {name: [] for name in datasets}
        names = list(datasets)
        freeing = []
        for round_index in range(repeats):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in order:
                # One contender at a time, on a fresh iterator: no other pipeline's
                # background threads compete, and no buffer filled while another ran
                # is drained for free. The warm-up fills the shuffle buffer.
                iterator = iter(datasets[name])
                drain(iterator, warmup)
                start = time.perf_counter()
                drain(iterator, tf.constant(batches))
                rates[name].append(batches * BATCH / (time.perf_counter() - start))
                start = time.perf_counter()
                del iterator  # can block while tf.data's autotuning winds down
                freeing.append(time.perf_counter() - start)
            log(f"round {round_index + 1}/{repeats}: " + ", ".join(
                f"{n} {rates[n][-1]:,.0f}" for n in names))
        log(f"freeing an iterator took {statistics.median(freeing):.2f}s (median), "
            f"{max(freeing):.2f}s (max), outside the timed window")
        medians = {name: statistics.median(values) for name, values in rates.items()}
        return {
            "image_stored_as": image_as,
            "examples": num_examples, "shards": NUM_SHARDS, "batch": BATCH,
            "megabytes": round(size / 2**20, 1), "rounds": repeats,
            "examples_per_batch_round": batches * BATCH,
            "examples_per_second": {k: round(v) for k, v in medians.items()},
            "spread": {k: round((max(v) - min(v)) / statistics.median(v), 3)
                       for k, v in rates.items()},
            "tfrecord_input_vs_naive": round(medians["tfrecord_input"] / medians["naive"], 2),
            "tfrecord_input_no_shuffle_vs_naive": round(
                medians["tfrecord_input_no_shuffle"] / medians["naive"], 2),
            "tfrecord_input_fraction_of_raw_read": round(
                medians["tfrecord_input"] / medians["raw_read"], 3),
            "tfrecord_input_fraction_of_raw_read_interleaved": round(
                medians["tfrecord_input"] / medians["raw_read_interleaved"], 3),
            "naive_fraction_of_raw_read": round(medians["naive"] / medians["raw_read"], 3),
        }


# ----------------------------------------------------------------- training


def stall_from_events(model_dir: str) -> list[tuple[int, float]]:
    values = []
    for path in sorted(tf.io.gfile.glob(os.path.join(model_dir, "train", "events.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == "input/stall_fraction":
                    values.append((event.step, float(tf.make_ndarray(value.tensor))))
    return sorted(values)


def run(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                            timeout=timeout)
    return result, time.perf_counter() - start


def bench_training(configs: dict[str, list[str]]) -> dict:
    results = {}
    for config, params in configs.items():
        with tempfile.TemporaryDirectory(prefix="tputrain-bench-run-") as model_dir:
            result, seconds = run(["-m", "tputrain.run", f"--gin_file={config}",
                                   f"--model_dir={model_dir}",
                                   *[f"--gin_param={p}" for p in params]], timeout=1800)
            if result.returncode:
                raise RuntimeError(f"{config} failed:\n{result.stderr[-3000:]}")
            stalls = stall_from_events(model_dir)
        after_first = [value for _, value in stalls[1:]] or [value for _, value in stalls]
        results[config] = {
            "gin_param": params,
            "median_stall_fraction": round(statistics.median(after_first), 4),
            "max_stall_fraction": round(max(after_first), 4),
            "per_loop": [[step, round(value, 4)] for step, value in stalls],
            "seconds": round(seconds, 1),
        }
        log(f"train {config}: median stall {results[config]['median_stall_fraction']:.2%} "
            f"over {len(after_first)} loop(s), {seconds:.0f}s")
    return results


def bench_diagnose(configs: list[str]) -> dict:
    results = {}
    for config in configs:
        result, seconds = run(["-m", "tputrain.jobs.diagnose", f"--gin_file={config}", "--json"],
                              timeout=600)
        if result.returncode:
            raise RuntimeError(f"diagnose {config} failed:\n{result.stderr[-3000:]}")
        report = json.loads(result.stdout)
        results[config] = {
            key: (round(report[key], 4) if isinstance(report[key], float) else report[key])
            for key in ("stall_fraction", "measured_input_wait_fraction", "bottleneck",
                        "input_only_steps_per_second", "compute_only_steps_per_second",
                        "end_to_end_steps_per_second")}
        results[config]["wall_seconds"] = round(seconds, 1)
        log(f"diagnose {config}: stall {report['stall_fraction']:.1%}, bottleneck "
            f"{report['bottleneck']}, {seconds:.0f}s")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small data, short runs")
    parser.add_argument("--examples", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    result_file.add_arguments(parser, "input_pipeline")
    options = parser.parse_args()
    examples = options.examples or (4096 if options.quick else 32768)
    repeats = options.repeats or (3 if options.quick else 7)
    load_before = os.getloadavg()
    report: dict = {"cpus": os.cpu_count(), "load_average_before": [round(x, 2) for x in load_before]}
    # The goal is measured on FINDINGS' set (512 floats, tokens, the image as raw
    # bytes); storing the image as a uint8 array (3072 int64 varints per example) is
    # heavier still, and reported beside it.
    report["reading"] = bench_reading(examples, repeats, "bytes")
    report["reading_int64_image"] = bench_reading(examples, repeats, "uint8_array")
    lm_steps = ["Trainer.train_steps=20" if options.quick else "Trainer.train_steps=100",
                "Trainer.steps_per_loop=10"]
    report["training"] = bench_training({
        "digits.gin": ["Trainer.train_steps=400"] if options.quick else [],
        "synthetic_transformer.gin": lm_steps,
        "slow_input.gin": ["Trainer.train_steps=100"] if options.quick else [],
    })
    report["diagnose"] = bench_diagnose(["digits.gin", "slow_input.gin",
                                         "synthetic_transformer.gin"])
    training, diagnosis, reading = report["training"], report["diagnose"], report["reading"]
    report["goals"] = {
        "tfrecord_input_vs_naive >= 3": reading["tfrecord_input_vs_naive"] >= 3,
        "digits training stall < 2%": training["digits.gin"]["median_stall_fraction"] < 0.02,
        "synthetic_transformer training stall < 2%":
            training["synthetic_transformer.gin"]["median_stall_fraction"] < 0.02,
        "slow_input training stall > 50%":
            training["slow_input.gin"]["median_stall_fraction"] > 0.5,
        "diagnose digits < 5%": diagnosis["digits.gin"]["stall_fraction"] < 0.05,
        "diagnose slow_input > 50%, bottleneck input":
            diagnosis["slow_input.gin"]["stall_fraction"] > 0.5
            and diagnosis["slow_input.gin"]["bottleneck"] == "input",
        "diagnose digits and slow_input each < 60 s": all(
            diagnosis[c]["wall_seconds"] < 60 for c in ("digits.gin", "slow_input.gin")),
    }
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    result_file.write(report, options.out, "input_pipeline", options.tag, options.quick)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: freeing the long-lived autotuned iterators above can
    # block for tens of seconds (FINDINGS), and everything is written already.
    os._exit(0)


if __name__ == "__main__":
    main()
