"""Static shapes for variable-length text: pad-to-max, bucketing and packing, side by side.

    python benchmarks/sequence_packing.py            # a few minutes on 2 busy cores
    python benchmarks/sequence_packing.py --quick    # smoke run (JSON to stdout)

Writes one JSON document to benchmarks/results/<today>-sequence_packing[-<tag>].json.

Documents: the standard library text corpus (`tputrain.data.text_corpus`, the
files `configs/text_lm.gin` trains on), each file split at blank lines into
paragraphs, and paragraphs longer than the row length split into row-length
pieces, so all three contenders train on exactly the same tokens, with the
corpus's own (paragraph) length distribution. Each document is shifted for a
causal LM (`tokens` = BOS + bytes[:-1], `targets` = bytes).

Contenders, the same byte-level Transformer (`TextLMTask`) and the same compiled
train step (XLA, per-token loss over real tokens, Adam):
* `pad`: every document padded to the row length (`pad_sequences`);
* `bucket`: documents grouped by length into buckets (`bucket_by_length`), each
  batch padded to its bucket's length: one compiled program a bucket length;
* `pack`: several documents a row (`pack_sequences`, segment ids and positions),
  next-fit (one open row, the documents' order kept);
* `pack_first_fit`: the same with 8 rows open at once (`bins=8`, first-fit).
Rounds rotate the contenders; each runs a fixed number of batches after a
warm-up that compiles every shape it will see. Reported per contender: the
median real tokens/s (wall and CPU), the real-token share of the positions
computed, and ratios to `pad`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import result_file  # noqa: E402  (benchmarks/, this script's folder)

import tensorflow as tf  # noqa: E402

from tputrain.data.bucketing import bucket_by_length  # noqa: E402
from tputrain.data.packing import pack_sequences  # noqa: E402
from tputrain.data.padding import pad_sequences  # noqa: E402
from tputrain.data.text_corpus import encode_bytes, stdlib_files  # noqa: E402
from tputrain.tasks.text_lm import TextLMTask  # noqa: E402
from tputrain.tasks.text_lm_inputs import shift_for_lm  # noqa: E402


def documents(max_files: int, length: int) -> list[np.ndarray]:
    """Paragraphs of the corpus's files (pieces of at most `length` bytes)."""
    docs = []
    for path in stdlib_files(max_files):
        for paragraph in Path(path).read_bytes().split(b"\n\n"):
            tokens = encode_bytes(paragraph.strip(b"\n"))
            docs += [tokens[i:i + length] for i in range(0, len(tokens), length)]
    return [d for d in docs if len(d)]


def _dataset(docs: list[np.ndarray]) -> tf.data.Dataset:
    def generate() -> Iterator[dict[str, np.ndarray]]:
        for doc in docs:
            yield {"tokens": doc}
    spec = {"tokens": tf.TensorSpec([None], tf.int64)}
    return tf.data.Dataset.from_generator(generate, output_signature=spec).map(shift_for_lm)


def batches(kind: str, docs: list[np.ndarray], length: int, rows: int) -> list[Any]:
    """The contender's batches, materialised (the input is not what is measured)."""
    data = _dataset(docs)
    keys = ["tokens", "targets"]
    if kind == "pad":
        data = pad_sequences(data, length, keys=keys).batch(rows, drop_remainder=True)
    elif kind == "bucket":
        buckets = sorted({n for n in (64, 128, 256) if n < length} | {length})
        data = bucket_by_length(data, buckets, rows, keys=keys)
    else:
        bins = 8 if kind == "pack_first_fit" else 1
        data = pack_sequences(data, length, keys=keys, bins=bins).batch(rows, drop_remainder=True)
    return list(data)


def train_step(task: TextLMTask):
    model = task.build_model()
    optimizer = tf.keras.optimizers.Adam(1e-3)

    @tf.function(jit_compile=True, reduce_retracing=False)
    def step(tokens, segment_ids, positions, targets, weights):
        with tf.GradientTape() as tape:
            logits = model({"tokens": tokens, "segment_ids": segment_ids,
                            "positions": positions}, training=True)
            per_token = task.compute_loss(targets, logits)
            loss = tf.reduce_sum(per_token * weights) / tf.reduce_sum(weights)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def _run(step, batch) -> None:
    step(tf.cast(batch["tokens"], tf.int32), tf.cast(batch["segment_ids"], tf.int32),
         tf.cast(batch["positions"], tf.int32), tf.cast(batch["targets"], tf.int32),
         tf.cast(batch["loss_weights"], tf.float32)).numpy()


def measure(step, data: list[Any], count: int, start: int) -> dict[str, float]:
    chosen = [data[(start + i) % len(data)] for i in range(count)]
    real = sum(float(tf.reduce_sum(b["loss_weights"])) for b in chosen)
    slots = sum(int(tf.size(b["loss_weights"])) for b in chosen)
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in chosen:
        _run(step, batch)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"real_tokens_per_second": real / wall, "real_tokens_per_cpu_second": real / cpu,
            "real_token_share": real / slots}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    result_file.add_arguments(parser, "sequence_packing")
    options = parser.parse_args()
    length, rows = (128, 4) if options.quick else (512, 8)
    files, count = (10, 3) if options.quick else (60, 12)
    docs = documents(files, length)
    kinds = ("pad", "bucket", "pack", "pack_first_fit")
    data = {kind: batches(kind, docs, length, rows) for kind in kinds}
    task = TextLMTask(sequence_length=length, width=64, num_layers=2, num_heads=4,
                      static_length=False)
    steps = {kind: train_step(task) for kind in kinds}
    for kind in kinds:  # compile every shape the contender will see
        for shape in {int(b["tokens"].shape[1]): b for b in data[kind]}.values():
            _run(steps[kind], shape)
    results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for number in range(options.rounds):
        order = kinds[number % len(kinds):] + kinds[:number % len(kinds)]
        for kind in order:
            results[kind].append(measure(steps[kind], data[kind], count, number * count))
            print(f"round {number} {kind}: {results[kind][-1]}", file=sys.stderr)
    report = _report(results, docs, length, rows, files)
    result_file.write(report, options.out, "sequence_packing", options.tag, options.quick)


def _report(results, docs, length, rows, files) -> dict[str, Any]:
    medians = {kind: {name: statistics.median(r[name] for r in runs) for name in runs[0]}
               for kind, runs in results.items()}
    lengths = [len(d) for d in docs]
    return {
        "benchmark": "sequence_packing", "row_length": length, "rows_a_batch": rows,
        "files": files, "documents": len(docs),
        "document_length": {"median": float(np.median(lengths)), "mean": float(np.mean(lengths)),
                            "p90": float(np.percentile(lengths, 90)), "max": int(max(lengths))},
        "contenders": medians,
        "ratios": {f"{kind}_vs_pad": {
            "real_tokens_per_second": medians[kind]["real_tokens_per_second"]
            / medians["pad"]["real_tokens_per_second"],
            "real_tokens_per_cpu_second": medians[kind]["real_tokens_per_cpu_second"]
            / medians["pad"]["real_tokens_per_cpu_second"]}
            for kind in ("bucket", "pack", "pack_first_fit")},
        "goals": {"packing's real-token share >= 95%":
                  max(medians["pack"]["real_token_share"],
                      medians["pack_first_fit"]["real_token_share"]) >= 0.95},
        "load_average": list(__import__("os").getloadavg()),
    }


if __name__ == "__main__":
    main()
