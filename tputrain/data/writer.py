"""Writing examples as sharded TFRecord files that `TFRecordInput` can read.

Every example must have the same keys and the same shape per key: TPUs need
static shapes, so pad variable-length data before writing. Shards are written
atomically: a crash never leaves a half-written shard under a final name.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Iterable, Mapping

import numpy as np
import tensorflow as tf

_COMPRESSION_TYPES = (None, "", "ZLIB", "GZIP")
_INT64_MAX = np.iinfo(np.int64).max


def _as_array(key: str, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind == "O":
        # Python strings/bytes of different lengths: store them as bytes.
        flat = array.ravel()
        if not all(isinstance(v, (bytes, str)) for v in flat):
            raise TypeError(
                f"feature {key!r}: object arrays must hold only bytes or str, "
                f"got {sorted({type(v).__name__ for v in flat})}")
        array = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in flat],
                         dtype=object).reshape(array.shape)
    elif array.dtype.kind not in "fiubSU":
        raise TypeError(
            f"feature {key!r}: dtype {array.dtype} cannot be stored in a tf.train.Example: "
            "use a float, integer, bool, bytes or str array")
    return array


def _to_feature(key: str, array: Any) -> tf.train.Feature:
    array = np.asarray(array)  # A row of an object array may be a bare bytes object.
    flat = array.ravel()
    kind = array.dtype.kind
    if kind == "f":
        return tf.train.Feature(float_list=tf.train.FloatList(value=flat.tolist()))
    if kind in "iub":
        if kind == "u" and flat.size and int(flat.max()) > _INT64_MAX:
            raise ValueError(f"feature {key!r}: value {int(flat.max())} does not fit in int64")
        return tf.train.Feature(int64_list=tf.train.Int64List(value=flat.astype(np.int64).tolist()))
    if kind == "U":
        return tf.train.Feature(
            bytes_list=tf.train.BytesList(value=[s.encode("utf-8") for s in flat.tolist()]))
    # "S" (fixed-width bytes) or "O" already normalised to bytes by _as_array.
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=list(flat.tolist())))


def _serialize(example: Mapping[str, np.ndarray]) -> bytes:
    features = {key: _to_feature(key, value) for key, value in example.items()}
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


def _columns(examples: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
    """Validates a dict of arrays; returns the arrays and their common leading dim."""
    if not examples:
        raise ValueError("examples is an empty dict: give at least one feature")
    columns = {}
    for key, value in examples.items():
        if not isinstance(key, str):
            raise TypeError(f"feature names must be str, got {key!r}")
        array = _as_array(key, value)
        if array.ndim == 0:
            raise ValueError(
                f"feature {key!r} is a scalar: a dict of arrays needs a leading "
                "example dimension on every value")
        columns[key] = array
    lengths = {key: array.shape[0] for key, array in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            "all arrays need the same leading (example) dimension, got "
            + ", ".join(f"{key!r}: {n}" for key, n in lengths.items()))
    num_examples = next(iter(lengths.values()))
    if num_examples == 0:
        raise ValueError("examples is empty (leading dimension 0): nothing to write")
    return columns, num_examples


def feature_spec_for(examples: Mapping[str, Any]) -> dict[str, tf.io.FixedLenFeature]:
    """Returns the `FixedLenFeature` spec that reads back a dict of arrays.

    Floats read back as float32, integers and bools as int64, bytes and str as
    string, each with shape `array.shape[1:]`; this is what `write_tfrecords`
    stores.
    """
    columns, _ = _columns(examples)
    spec = {}
    for key, array in columns.items():
        kind = array.dtype.kind
        dtype = tf.float32 if kind == "f" else tf.int64 if kind in "iub" else tf.string
        spec[key] = tf.io.FixedLenFeature(list(array.shape[1:]), dtype)
    return spec


class _ExampleChecker:
    """Checks that streamed examples all have the first example's keys and shapes."""

    def __init__(self):
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def __call__(self, index: int, example: Any) -> dict[str, np.ndarray]:
        if not isinstance(example, Mapping):
            raise TypeError(
                f"example {index} is a {type(example).__name__}: examples must be a "
                "dict of arrays or an iterable of dicts")
        arrays = {key: _as_array(key, value) for key, value in example.items()}
        shapes = {key: array.shape for key, array in arrays.items()}
        if self._shapes is None:
            if not shapes:
                raise ValueError(f"example {index} has no features")
            self._shapes = shapes
        elif shapes.keys() != self._shapes.keys():
            raise ValueError(
                f"example {index} has keys {sorted(shapes)} but example 0 has "
                f"{sorted(self._shapes)}: every example needs the same features")
        else:
            for key, shape in shapes.items():
                if shape != self._shapes[key]:
                    raise ValueError(
                        f"feature {key!r} has shape {shape} in example {index} but "
                        f"{self._shapes[key]} in example 0: TPUs need static shapes, "
                        "pad every example to the same shape")
        return arrays


def write_tfrecords(
    examples: Mapping[str, Any] | Iterable[Mapping[str, Any]],
    output_prefix: str,
    num_shards: int,
    compression_type: str | None = None,
) -> list[str]:
    """Writes examples to `num_shards` TFRecord files; returns their paths in order.

    Args:
        examples: a dict of arrays sharing a leading (example) dimension, split
            into contiguous near-equal blocks, one per shard; or an iterable of
            dicts of scalars/arrays, dealt round-robin over the shards.
            Floats are stored as float_list, integers and bools as int64_list,
            bytes and str as bytes_list; arrays are flattened (read them back
            with a `FixedLenFeature` of the original shape, see
            `feature_spec_for`).
        output_prefix: shards are named
            `{output_prefix}-{i:05d}-of-{num_shards:05d}.tfrecord`. Any
            `tf.io.gfile` path works (local, gs://, ram://); the parent
            directory is created.
        num_shards: number of files. Use at least as many as the hosts that will
            read them, so each host can read whole files.
        compression_type: None, "ZLIB" or "GZIP"; the reader needs the same.

    All shards are first written under temporary names in the same directory
    and renamed only once every shard is complete; on an error the temporary
    files are removed and no final-name shard is written.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    if compression_type not in _COMPRESSION_TYPES:
        raise ValueError(
            f"compression_type must be None, 'ZLIB' or 'GZIP', got {compression_type!r}")
    if not isinstance(output_prefix, str) or not output_prefix:
        raise ValueError(f"output_prefix must be a non-empty path, got {output_prefix!r}")

    paths = [f"{output_prefix}-{i:05d}-of-{num_shards:05d}.tfrecord" for i in range(num_shards)]
    directory = os.path.dirname(output_prefix)
    if directory:
        tf.io.gfile.makedirs(directory)
    # Hidden, and not ending in ".tfrecord", so that globs such as
    # "prefix-*" or "*.tfrecord" never pick up a shard left by a killed writer.
    token = uuid.uuid4().hex
    temp_paths = [os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{token}")
                  for path in paths]
    options = tf.io.TFRecordOptions(compression_type=compression_type or "")
    writers = []
    try:
        for temp_path in temp_paths:
            writers.append(tf.io.TFRecordWriter(temp_path, options))
        if isinstance(examples, Mapping):
            columns, num_examples = _columns(examples)
            if num_examples < num_shards:
                raise ValueError(
                    f"cannot split {num_examples} examples into {num_shards} shards "
                    f"without empty shards: use num_shards <= {num_examples}")
            for shard, writer in enumerate(writers):
                begin = shard * num_examples // num_shards
                end = (shard + 1) * num_examples // num_shards
                for i in range(begin, end):
                    writer.write(_serialize({key: col[i] for key, col in columns.items()}))
        else:
            if isinstance(examples, (str, bytes)):
                raise TypeError("examples must be a dict of arrays or an iterable of dicts")
            check = _ExampleChecker()
            num_examples = 0
            for index, example in enumerate(examples):
                writers[index % num_shards].write(_serialize(check(index, example)))
                num_examples += 1
            if num_examples == 0:
                raise ValueError("examples is empty: nothing to write")
            if num_examples < num_shards:
                raise ValueError(
                    f"got {num_examples} examples for {num_shards} shards, which would "
                    f"leave empty shards: use num_shards <= {num_examples}")
        for writer in writers:
            writer.close()
        for temp_path, path in zip(temp_paths, paths):
            tf.io.gfile.rename(temp_path, path, overwrite=True)
    except BaseException:
        for writer in writers:
            writer.close()
        for temp_path in temp_paths:
            if tf.io.gfile.exists(temp_path):
                tf.io.gfile.remove(temp_path)
        raise
    return paths
