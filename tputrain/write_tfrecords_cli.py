"""`tputrain write-tfrecords --input=data.npz --output_prefix=DIR/train`: arrays to shards.

Reads a `.npz` (every array is a feature; they share the leading example
dimension) or a `.csv` with a header row (every column is a scalar feature;
integer columns become int64, other numeric columns float32, the rest
strings) and writes sharded TFRecords plus the manifest that
`TFRecordInput(manifest=...)` reads, choosing the shard count from
`--target_shard_mb` and `--num_hosts` unless `--num_shards` is given.
"""

from __future__ import annotations

import csv
import sys

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS


def _column(values: list[str]) -> np.ndarray:
    """int64 if every value is an integer, else float32 if numeric, else str."""
    for dtype in (np.int64, np.float32):
        try:
            return np.array([dtype(v) if dtype is np.float32 else int(v) for v in values],
                            dtype=dtype)
        except ValueError:
            continue
    return np.array(values, dtype=str)


def read_csv(path: str) -> dict[str, np.ndarray]:
    """Columns of a CSV file with a header row, typed per column."""
    import tensorflow as tf

    with tf.io.gfile.GFile(path, "r") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise ValueError(f"{path} is empty: a header row and data rows are needed") from None
        rows = list(reader)
    if not rows:
        raise ValueError(f"{path} has a header but no rows")
    if len(set(header)) != len(header) or not all(header):
        raise ValueError(f"{path}: the header {header} needs unique, non-empty column names")
    for number, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise ValueError(f"{path} line {number} has {len(row)} fields but the header has "
                             f"{len(header)}")
    return {name: _column([row[i] for row in rows]) for i, name in enumerate(header)}


def read_npz(path: str) -> dict[str, np.ndarray]:
    import tensorflow as tf

    with tf.io.gfile.GFile(path, "rb") as f:
        with np.load(f, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    if not arrays:
        raise ValueError(f"{path} holds no arrays")
    return arrays


def read_input(path: str) -> dict[str, np.ndarray]:
    if path.endswith(".npz"):
        return read_npz(path)
    if path.endswith(".csv"):
        return read_csv(path)
    raise ValueError(f"--input={path}: use a .npz or a .csv file")


def define_flags() -> None:
    flags.DEFINE_string("input", None, "A .npz or .csv file.")
    flags.DEFINE_string("output_prefix", None, "Shards are written as PREFIX-00000-of-0000N."
                        "tfrecord and the manifest as PREFIX.manifest.json.")
    flags.DEFINE_integer("num_shards", None, "Number of shards; default: from --target_shard_mb.")
    flags.DEFINE_integer("num_hosts", 1, "Hosts that will read the data (at least one shard each).")
    flags.DEFINE_float("target_shard_mb", 128.0, "Target shard size in MB (uncompressed).")
    flags.DEFINE_enum("compression", "none", ["none", "gzip", "zlib"], "Shard compression.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.input or not FLAGS.output_prefix:
        raise app.UsageError("pass --input=FILE.npz|FILE.csv and --output_prefix=DIR/NAME")
    from tputrain.data import write_tfrecords
    from tputrain.data.manifest import manifest_path

    compression = None if FLAGS.compression == "none" else FLAGS.compression.upper()
    try:
        examples = read_input(FLAGS.input)
        paths = write_tfrecords(examples, FLAGS.output_prefix, FLAGS.num_shards, compression,
                                num_hosts=FLAGS.num_hosts, target_shard_mb=FLAGS.target_shard_mb)
    except (ValueError, TypeError, OSError) as error:
        print(f"tputrain write-tfrecords: error: {error}", file=sys.stderr)
        sys.exit(2)
    count = len(next(iter(examples.values())))
    print(f"wrote {count} examples to {len(paths)} shard(s) {FLAGS.output_prefix}-*; manifest "
          f"{manifest_path(FLAGS.output_prefix)}")


def console_main() -> None:
    """Entry point of `tputrain write-tfrecords`."""
    from tputrain.run import list_in_help

    define_flags()
    list_in_help(("input", "output_prefix", "num_shards", "num_hosts", "target_shard_mb",
                  "compression"))
    app.run(main)


if __name__ == "__main__":
    console_main()
