"""Empty inputs: one error that names what holds nothing, before anything reads for ever.

A repeated input with no examples never yields a batch, and nothing ends the wait:
a seeded shuffle builds each epoch from its index (`tputrain.data.epochs`) and
reads 2**62 empty epochs, a mixture draws from a source that never gives, a
filter that drops everything filters for ever; the main thread waits inside
TensorFlow at 100% CPU. So the input builders look before they build:

* a file pattern whose files are all 0 bytes is refused when it is globbed (local
  files: one `stat` each; remote ones are left to the next check, one request a
  file would cost too much);
* each input pipeline's files are read until their first record, once, when the
  dataset is built (`yields`): none is an `EmptyInputError`;
* with a `to_static` (packing, a filter of your own), one pass of the examples
  through it must give a row.

Each costs one record read (or one row made) when the dataset is built, and
nothing per batch. A read that fails (a corrupt file, a record that does not
match the spec) is not called empty: the pipeline's own first read reports it,
with the file and record named.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tputrain.data.options import without_autotune

NO_BATCH = "yields no batch"


class EmptyInputError(ValueError):
    """An input, a file pattern, a mixture source or a `to_static` holds no examples."""


def check_not_all_empty(pattern: str, files: Sequence[str]) -> None:
    """Refuses a pattern whose matched files are all 0 bytes (local paths only)."""
    if not files or any("://" in path for path in files):
        return
    sizes = {}
    for path in files:
        try:
            sizes[path] = tf.io.gfile.stat(path).length
        except tf.errors.OpError:
            return  # unreadable: the read names it
    if all(size == 0 for size in sizes.values()):
        raise EmptyInputError(
            f"the file pattern {pattern!r} {NO_BATCH}: every file it matches is empty "
            f"(0-byte, e.g. {sorted(files)[0]}): write the data again "
            "(tputrain.data.write_tfrecords) or fix the pattern")


def yields(dataset: tf.data.Dataset) -> bool:
    """Whether one pass of `dataset` gives an element (read eagerly, up to the first);
    True when the read fails, which the pipeline's own read reports better."""
    if not tf.executing_eagerly():
        return True
    try:
        for _ in without_autotune(dataset.take(1)):
            return True
    except tf.errors.OpError:
        return True
    return False


def count(dataset: tf.data.Dataset) -> int:
    """The elements of one pass of a finite `dataset` (for an error message)."""
    return int(dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
