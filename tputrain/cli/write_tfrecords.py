"""`tputrain write-tfrecords --input=data.npz --output_prefix=DIR/train`: arrays to shards.

Reads a `.npz` (every array is a feature; they share the leading example
dimension) or a `.csv` with a header row (every column is a scalar feature;
integer columns become int64, other numeric columns float32, the rest
strings) and writes sharded TFRecords plus the manifest that
`TFRecordInput(manifest=...)` reads, choosing the shard count from
`--target_shard_mb` and `--num_hosts` unless `--num_shards` is given.
"""

from __future__ import annotations

import errno
import sys

import tensorflow as tf
from absl import flags, logging

from tputrain.checkpointing.files import first_line
from tputrain.cli.common import list_in_help, reject_arguments, run_command
from tputrain.data import write_tfrecords
from tputrain.data.manifest import manifest_path
from tputrain.data.arrays import check_output_prefix, read_input

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("input", None, "A .npz or .csv file.", **fv)
    flags.DEFINE_string("output_prefix", None, "Shards are written as PREFIX-00000-of-0000N."
                        "tfrecord and the manifest as PREFIX.manifest.json.", **fv)
    flags.DEFINE_integer("num_shards", None, "Number of shards; default: from "
                         "--target_shard_mb.", **fv)
    flags.DEFINE_integer("num_hosts", 1, "Hosts that will read the data (at least one shard "
                         "each).", **fv)
    flags.DEFINE_float("target_shard_mb", 128.0, "Target shard size in MB (uncompressed).", **fv)
    flags.DEFINE_enum("compression", "none", ["none", "gzip", "zlib"], "Shard compression.",
                      **fv)
    list_in_help(("input", "output_prefix", "num_shards", "num_hosts", "target_shard_mb",
                  "compression"), flag_values)


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    if not FLAGS.input or not FLAGS.output_prefix:
        print("tputrain write-tfrecords: error: pass --input=FILE.npz|FILE.csv and "
              "--output_prefix=DIR/NAME", file=sys.stderr)
        sys.exit(2)
    compression = None if FLAGS.compression == "none" else FLAGS.compression.upper()
    try:
        examples = read_input(FLAGS.input)
        check_output_prefix(FLAGS.output_prefix)
        verbosity = logging.get_verbosity()
        logging.set_verbosity(logging.WARNING)  # its own INFO line: the one below says it
        try:
            paths = write_tfrecords(examples, FLAGS.output_prefix, FLAGS.num_shards, compression,
                                    num_hosts=FLAGS.num_hosts,
                                    target_shard_mb=FLAGS.target_shard_mb)
        finally:
            logging.set_verbosity(verbosity)
    except (ValueError, TypeError, OSError, tf.errors.OpError) as error:
        print(f"tputrain write-tfrecords: error: {_one_line(error, FLAGS.output_prefix)}",
              file=sys.stderr)
        sys.exit(2)
    count = len(next(iter(examples.values())))
    print(f"wrote {count} examples to {len(paths)} shard(s) {FLAGS.output_prefix}-*; manifest "
          f"{manifest_path(FLAGS.output_prefix)}")


def _one_line(error: Exception, prefix: str) -> str:
    """The error in one line; a full disk (TensorFlow's ResourceExhaustedError or
    OSError ENOSPC) with the fix. The write removed its temp shards either way."""
    text = first_line(error)
    if getattr(error, "errno", None) == errno.ENOSPC or "no space left" in text.lower():
        return (f"the disk is full writing {prefix}-* ({text}): free some space or choose "
                "an --output_prefix on a larger disk (nothing was written: the temporary "
                "shards are removed)")
    return text


def console_main() -> None:
    """`tputrain write-tfrecords`."""
    define_flags()
    run_command(main)
