"""Writing examples as sharded TFRecord files (plus a manifest) that tputrain reads.

Every example must have the same keys and the same shape per key, except
variable-length features (rank 1, any length per example, given as a list of
arrays, a `tf.RaggedTensor`, or named in `var_len`): the manifest records them
with shape `[None]` and `TFRecordInput` reads them for packing, bucketing or
padding to the static shapes TPUs need. The writer takes a
dict of arrays, any iterable of dicts (numpy or Python values), or a
`tf.data.Dataset` of dicts (e.g. a TFDS split); chooses the number of shards
from a target shard size and the number of hosts; writes the shards in
parallel threads (file I/O and compression run outside the GIL); and writes a
JSON manifest that `TFRecordInput(manifest=...)` reads instead of a
hand-written feature spec. Shards are written atomically: a crash never
leaves a half-written shard under a final name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import queue
import re
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.atomic import TEMP_MARK, left_by_dead_writer, move, temp_path
from tputrain.core.checks import check_int
from tputrain.data.example_codec import encode_example
from tputrain.data import var_len as vl
from tputrain.data.stages import repeats_forever
from tputrain.data.blocks import BLOCK_RECORDS
from tputrain.data.manifest import (COMMIT_SUFFIX, COMPRESSION_TYPES, MANIFEST_SUFFIX, RECORD_OVERHEAD, Manifest,
                                    Shard, commit_marker, manifest_path, mark_committing, var_len_feature,
                                    write_manifest)

_SIZE_SAMPLE = 256  # examples serialized to estimate the data size
_CHUNK = 256  # records handed to a writer thread at once
DEFAULT_TARGET_SHARD_MB = 128.0


def _as_array(key: str, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind in "SU" and not isinstance(value, np.ndarray):
        # Python bytes/str (and lists of them) become numpy's fixed-width strings,
        # which drop trailing NULs (b"a\x00" -> b"a"): keep the Python objects.
        array = np.array(value, dtype=object)
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


def _kind(array: np.ndarray) -> str:
    kind = array.dtype.kind
    return "float" if kind == "f" else "int64" if kind in "iub" else "bytes"


def _check_var_len(var_len: Iterable[str], keys: Iterable[str]) -> frozenset[str]:
    names = frozenset([var_len] if isinstance(var_len, str) else var_len)
    unknown = sorted(names - set(keys))
    if unknown:
        raise ValueError(f"var_len names {unknown[0]!r}, which is not a feature: use some "
                         f"of {sorted(keys)}")
    return names


def _columns(examples: Mapping[str, Any], var_len: Iterable[str] = ()
             ) -> tuple[dict[str, np.ndarray | list[np.ndarray]], int]:
    """Validates a dict of arrays; returns the arrays (a list of rows for a variable-length
    feature) and their common leading dim."""
    if not examples:
        raise ValueError("examples is an empty dict: give at least one feature")
    var_len = _check_var_len(var_len, examples)
    columns = {}
    for key, value in examples.items():
        if not isinstance(key, str):
            raise TypeError(f"feature names must be str, got {key!r}")
        if key in var_len or vl.is_ragged(value):
            columns[key] = vl.column_rows(key, value, _as_array)
            continue
        array = _as_array(key, value)
        if array.ndim == 0:
            raise ValueError(
                f"feature {key!r} is a scalar: a dict of arrays needs a leading "
                "example dimension on every value")
        columns[key] = array
    lengths = {key: len(array) for key, array in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            "all arrays need the same leading (example) dimension, got "
            + ", ".join(f"{key!r}: {n}" for key, n in lengths.items()))
    num_examples = next(iter(lengths.values()))
    if num_examples == 0:
        raise ValueError("examples is empty (leading dimension 0): nothing to write")
    return columns, num_examples


def _spec(shapes: Mapping[str, tuple[int | None, ...]], kinds: Mapping[str, str]
          ) -> dict[str, tf.io.FixedLenFeature | tf.io.RaggedFeature]:
    dtypes = {"float": tf.float32, "int64": tf.int64, "bytes": tf.string}
    return {key: var_len_feature(dtypes[kinds[key]]) if shape == vl.VAR_LEN_SHAPE
            else tf.io.FixedLenFeature(list(shape), dtypes[kinds[key]])
            for key, shape in shapes.items()}


def _column_facts(columns: Mapping[str, np.ndarray | list[np.ndarray]]
                  ) -> tuple[dict[str, tuple[int | None, ...]], dict[str, str]]:
    """Each column's per-example shape ((None,) when variable-length) and stored kind."""
    shapes, kinds = {}, {}
    for key, column in columns.items():
        if isinstance(column, list):
            shapes[key], kinds[key] = vl.VAR_LEN_SHAPE, vl.column_kind(key, column, _kind)
        else:
            shapes[key], kinds[key] = column.shape[1:], _kind(column)
    return shapes, kinds


def feature_spec_for(examples: Mapping[str, Any], var_len: Iterable[str] = ()
                     ) -> dict[str, tf.io.FixedLenFeature | tf.io.RaggedFeature]:
    """Returns the feature spec that reads back a dict of arrays.

    Floats read back as float32, integers and bools as int64, bytes and str as
    string, each a `FixedLenFeature` of shape `array.shape[1:]`, or, for a
    variable-length feature (a list of rank-1 rows of different lengths, a
    `tf.RaggedTensor`, or a name in `var_len`), a `RaggedFeature`; this is what
    `write_tfrecords` stores (and records in its manifest).
    """
    return _spec(*_column_facts(_columns(examples, var_len)[0]))


class _ExampleChecker:
    """Checks that streamed examples all have the first example's keys, shapes and kinds
    (variable-length features: rank 1 of any length, one kind over the non-empty rows)."""

    def __init__(self, var_len: Iterable[str] = ()):
        self.var_len = frozenset([var_len] if isinstance(var_len, str) else var_len)
        self.shapes: dict[str, tuple[int | None, ...]] | None = None
        self.kinds: dict[str, str | None] = {}
        self._kind_from: dict[str, int] = {}  # the example a feature's kind was seen in

    def __call__(self, index: int, example: Any) -> dict[str, np.ndarray | None]:
        if not isinstance(example, Mapping):
            hint = (" (a tf.data/TFDS element (features, label)? map it to one dict first)"
                    if isinstance(example, tuple) else "")
            raise TypeError(
                f"example {index} is a {type(example).__name__}: examples must be a "
                f"dict of arrays or an iterable of dicts{hint}")
        arrays = {key: _as_array(key, value) for key, value in example.items()}
        shapes = {key: vl.VAR_LEN_SHAPE if key in self.var_len else array.shape
                  for key, array in arrays.items()}
        if self.shapes is None:
            self._first(index, shapes)
        elif shapes.keys() != self.shapes.keys():
            raise ValueError(
                f"example {index} has keys {sorted(shapes)} but example 0 has "
                f"{sorted(self.shapes)}: every example needs the same features")
        for key, array in arrays.items():
            if key in self.var_len:
                array = vl.check_row(key, f"example {index}", array)
                self._check_kind(index, key, vl.row_kind(array, _kind))
                arrays[key] = vl.stored_row(array)
                continue
            if array.shape != self.shapes[key]:
                raise ValueError(
                    f"feature {key!r} has shape {array.shape} in example {index} but "
                    f"{self.shapes[key]} in example 0: TPUs need static shapes, "
                    "pad every example to the same shape, or store it as variable-length "
                    f"(var_len=[{key!r}]) and pack it when reading")
            self._check_kind(index, key, _kind(array))
        return arrays

    def _first(self, index: int, shapes: dict[str, tuple[int | None, ...]]) -> None:
        if not shapes:
            raise ValueError(f"example {index} has no features")
        if not all(isinstance(key, str) for key in shapes):
            raise TypeError(f"feature names must be str, got {sorted(map(repr, shapes))}")
        _check_var_len(self.var_len, shapes)
        self.shapes = shapes

    def _check_kind(self, index: int, key: str, kind: str | None) -> None:
        """The first kind seen is the feature's; an empty variable-length row (None) fits any."""
        known = self.kinds.get(key)
        if kind is None or kind == known:
            return
        if known is None:
            self.kinds[key], self._kind_from[key] = kind, index
            return
        raise ValueError(f"feature {key!r} is {kind} in example {index} but {known} in example "
                         f"{self._kind_from[key]}: cast it to one type")

    def stored_kinds(self) -> dict[str, str]:
        """Every feature's kind; a variable-length one whose rows were all empty: float."""
        return {key: self.kinds.get(key) or "float" for key in self.shapes or {}}


def _dataset_examples(dataset: tf.data.Dataset) -> Iterator[Mapping[str, Any]]:
    """A tf.data.Dataset's elements as dicts of numpy values (batched reads when static)."""
    spec = dataset.element_spec
    if isinstance(spec, Mapping) and all(
            getattr(s, "shape", None) is not None and s.shape.is_fully_defined()
            for s in spec.values()):
        for batch in dataset.batch(1024).as_numpy_iterator():
            n = len(next(iter(batch.values())))
            for i in range(n):
                yield {key: value[i] for key, value in batch.items()}
    else:
        yield from dataset.as_numpy_iterator()


def _known_length(examples: Any) -> int | None:
    if isinstance(examples, tf.data.Dataset):
        cardinality = int(examples.cardinality())
        if repeats_forever(examples):
            raise ValueError("the dataset is infinite (repeat()?): write a finite dataset")
        return cardinality if cardinality >= 0 else None
    try:
        return len(examples)
    except TypeError:
        return None


def choose_num_shards(total_bytes: float, num_examples: int, num_hosts: int = 1,
                      target_shard_mb: float = DEFAULT_TARGET_SHARD_MB) -> int:
    """Shards of about `target_shard_mb` MB, at least one per host, a multiple of the hosts.

    A multiple of the host count lets every host read the same number of whole
    files (`TFRecordInput` shards by file). Never more shards than examples.
    """
    if num_examples < num_hosts:
        raise ValueError(f"{num_examples} example(s) cannot fill one shard for each of "
                         f"{num_hosts} hosts: write more data or use fewer hosts")
    by_size = math.ceil(total_bytes / (target_shard_mb * 2**20))
    shards = max(by_size, num_hosts, 1)
    shards = math.ceil(shards / num_hosts) * num_hosts
    if shards > num_examples:
        shards = (num_examples // num_hosts) * num_hosts
    return shards


class _ShardWriters:
    """Temp-named shard files written by background threads; renamed on commit.

    Worker thread w owns shards w, w + W, ...; each shard's records stay in
    order. Serialization happens in the caller's thread; TFRecordWriter.write
    (compression, file I/O) runs in the workers without the GIL.
    """

    def __init__(self, prefix: str, paths: list[str], compression_type: str | None,
                 num_workers: int):
        self.prefix, self.paths = prefix, paths
        self.marker: str | None = None  # the commit marker, once written (`commit`)
        self._renamed = 0
        # Hidden, and not ending in ".tfrecord", so that globs such as "prefix-*" or
        # "*.tfrecord" never pick up a shard left by a killed writer.
        self.temp_paths = [temp_path(p, hidden=True) for p in paths]
        options = tf.io.TFRecordOptions(compression_type=compression_type or "")
        self.counts = [0] * len(paths)
        # Byte offset of every BLOCK_RECORDS-th record of each shard (uncompressed only:
        # a compressed file has no offset a reader can seek to).
        self.offsets: list[list[int]] | None = (None if compression_type else
                                                [[] for _ in paths])
        self._bytes = [0] * len(paths)
        self._writers: list[tf.io.TFRecordWriter] = []
        self._pending: list[list[bytes]] = [[] for _ in paths]
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        try:
            for temp in self.temp_paths:
                self._writers.append(tf.io.TFRecordWriter(temp, options))
        except BaseException:
            self.abort()
            raise
        self._queues = [queue.Queue(maxsize=8) for _ in range(max(1, min(num_workers, len(paths))))]
        for q in self._queues:
            thread = threading.Thread(target=self._work, args=(q,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            shard, records = item
            if self._error is not None:
                continue  # Drain after a failure.
            try:
                writer = self._writers[shard]
                for record in records:
                    writer.write(record)
            except BaseException as error:  # Re-raised in the caller's thread.
                self._error = error

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _flush(self, shard: int) -> None:
        records, self._pending[shard] = self._pending[shard], []
        if records:
            self._queues[shard % len(self._queues)].put((shard, records))
            self._check()

    def write(self, shard: int, record: bytes) -> None:
        if self.offsets is not None:
            if self.counts[shard] % BLOCK_RECORDS == 0:
                self.offsets[shard].append(self._bytes[shard])
            self._bytes[shard] += len(record) + RECORD_OVERHEAD
        self._pending[shard].append(record)
        self.counts[shard] += 1
        if len(self._pending[shard]) >= _CHUNK:
            self._flush(shard)

    def _stop(self) -> None:
        for q in self._queues if self._threads else []:
            q.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def commit(self) -> list[int]:
        """Flushes, closes and renames every shard; returns the shards' sizes in bytes."""
        for shard in range(len(self.paths)):
            self._flush(shard)
        self._stop()
        self._check()
        for writer in self._writers:
            writer.close()
        # Renamed one by one over an earlier write's shards: until `_finish` removes the
        # marker, readers refuse the prefix (a kill here leaves a mix of two writes).
        self.marker = mark_committing(self.prefix)
        for temp, path in zip(self.temp_paths, self.paths):
            move(temp, path)
            self._renamed += 1
        return [tf.io.gfile.stat(path).length for path in self.paths]

    def abort(self) -> None:
        """Stops the threads and removes every temp file. A close that fails (it flushes
        what is buffered: on a full disk it raises again) or a removal that fails must
        not keep the other temps from going, nor hide the error that got here."""
        self._stop()
        for writer in self._writers:
            with contextlib.suppress(Exception):
                writer.close()
        # The marker stays once a shard was renamed: the prefix is a mix until a rerun.
        for temp in self.temp_paths + ([self.marker] if self.marker and not self._renamed else []):
            try:
                _remove_if_exists(temp)
            except (tf.errors.OpError, OSError) as error:
                logging.warning("write_tfrecords: could not remove the temp shard %s: %s",
                                temp, error)


def _shard_paths(output_prefix: str, num_shards: int) -> list[str]:
    return [f"{output_prefix}-{i:05d}-of-{num_shards:05d}.tfrecord" for i in range(num_shards)]


def _estimate_bytes(sample: list[bytes], num_examples: int) -> float:
    return (sum(map(len, sample)) / len(sample) + RECORD_OVERHEAD) * num_examples


def write_tfrecords(
    examples: Mapping[str, Any] | Iterable[Mapping[str, Any]] | tf.data.Dataset,
    output_prefix: str,
    num_shards: int | None = None,
    compression_type: str | None = None,
    *,
    num_hosts: int = 1,
    target_shard_mb: float = DEFAULT_TARGET_SHARD_MB,
    num_workers: int | None = None,
    manifest: bool = True,
    var_len: Iterable[str] = (),
) -> list[str]:
    """Writes examples to sharded TFRecord files; returns the shard paths in order.

    Args:
        examples: a dict of arrays sharing a leading (example) dimension, split
            into contiguous near-equal blocks, one per shard; or an iterable of
            dicts of scalars/arrays, or a finite `tf.data.Dataset` of dicts (a
            TFDS split), dealt round-robin over the shards.
            Floats are stored as float_list, integers and bools as int64_list,
            bytes and str as bytes_list; arrays are flattened (read them back
            with a `FixedLenFeature` of the original shape, see
            `feature_spec_for`, or simply through the manifest). Bytes are
            written exactly, NULs included, when given as Python objects
            (lists, object arrays): a numpy `S` array has already dropped
            each value's trailing NULs.
        output_prefix: shards are named
            `{output_prefix}-{i:05d}-of-{num_shards:05d}.tfrecord`, the manifest
            `{output_prefix}.manifest.json`. Any `tf.io.gfile` path works
            (local, gs://, ram://); the parent directory is created.
        num_shards: number of files; None chooses it (`choose_num_shards`): about
            `target_shard_mb` MB each (uncompressed size), at least `num_hosts`,
            rounded up to a multiple of `num_hosts`.
        compression_type: None, "ZLIB" or "GZIP"; the manifest records it.
        num_hosts: hosts that will read the data (for the automatic shard count).
        target_shard_mb: wanted shard size; 100-200 MB reads well from local
            disks and GCS alike.
        num_workers: threads writing shards; None: min(shards, 8).
        manifest: also write the JSON manifest (count, feature spec, shards); False
            removes the manifest an earlier write to the prefix left.
        var_len: names of variable-length features (rank 1, any length, empty
            included; read back as a `RaggedFeature`). Rows of different
            lengths, a `tf.RaggedTensor` or a dataset feature of shape `[None]`
            are variable-length without being named.

    An iterable of unknown length with `num_shards=None` is first spooled to a
    temporary file to learn its size. All shards are written under temporary
    names in the same directory and renamed only once every shard is complete;
    on an error the temporary files are removed and nothing is left behind.
    """
    num_shards, target = _check_arguments(examples, output_prefix, num_shards, compression_type,
                                          num_hosts, target_shard_mb, num_workers)
    _prepare_folder(output_prefix)
    if isinstance(examples, Mapping):
        written = _write_columns(examples, num_shards, target, var_len)
    else:
        written = _write_stream(examples, num_shards, target, var_len)
    return _finish(written, target, manifest)


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where and how the shards go: the settings every write path shares."""

    prefix: str
    compression_type: str | None
    num_hosts: int
    target_shard_mb: float
    workers: int

    def choose(self, total_bytes: float, num_examples: int) -> int:
        """The automatic shard count for this much data (`choose_num_shards`)."""
        return choose_num_shards(total_bytes, num_examples, self.num_hosts, self.target_shard_mb)

    def writers(self, num_shards: int) -> _ShardWriters:
        """Opens the temp-named shard files and their writer threads."""
        return _ShardWriters(self.prefix, _shard_paths(self.prefix, num_shards),
                             self.compression_type, self.workers)


class _Written(NamedTuple):
    """What a write path leaves for the manifest and the log line."""

    writers: _ShardWriters
    sizes: list[int]
    shapes: Mapping[str, tuple[int, ...]]
    kinds: Mapping[str, str]


def _check_arguments(examples: Any, output_prefix: Any, num_shards: Any, compression_type: Any,
                     num_hosts: Any, target_shard_mb: Any, num_workers: int | None
                     ) -> tuple[int | None, _Target]:
    """Rejects bad arguments, each naming the fix, before any file is touched."""
    num_shards = check_int("write_tfrecords", "num_shards", num_shards, 1, allow_none=True)
    num_hosts = check_int("write_tfrecords", "num_hosts", num_hosts, 1)
    if not target_shard_mb or target_shard_mb <= 0:
        raise ValueError(f"target_shard_mb must be > 0, got {target_shard_mb!r}")
    if compression_type not in COMPRESSION_TYPES:
        raise ValueError(
            f"compression_type must be None, 'ZLIB' or 'GZIP', got {compression_type!r}")
    if not isinstance(output_prefix, str) or not output_prefix:
        raise ValueError(f"output_prefix must be a non-empty path, got {output_prefix!r}")
    if isinstance(examples, (str, bytes)):
        raise TypeError("examples must be a dict of arrays, an iterable of dicts or a "
                        "tf.data.Dataset of dicts")
    return num_shards, _Target(output_prefix, compression_type, num_hosts, target_shard_mb,
                               num_workers or 8)


def _write_columns(examples: Mapping[str, Any], num_shards: int | None,
                   target: _Target, var_len: Iterable[str]) -> _Written:
    """A dict of arrays: every row is at hand, so shard i gets the i-th contiguous block."""
    columns, num_examples = _columns(examples, var_len)
    shapes, kinds = _column_facts(columns)

    def row(i: int) -> bytes:
        return encode_example({key: vl.stored_row(col[i]) if isinstance(col, list) else col[i]
                               for key, col in columns.items()})

    if num_shards is None:
        step = max(1, num_examples // _SIZE_SAMPLE)
        sample = [row(i) for i in range(0, num_examples, step)[:_SIZE_SAMPLE]]
        num_shards = target.choose(_estimate_bytes(sample, num_examples), num_examples)
    if num_examples < num_shards:
        raise ValueError(
            f"cannot split {num_examples} examples into {num_shards} shards "
            f"without empty shards: use num_shards <= {num_examples}")
    writers = target.writers(num_shards)

    def fill() -> None:
        for shard in range(num_shards):
            begin = shard * num_examples // num_shards
            end = (shard + 1) * num_examples // num_shards
            for i in range(begin, end):
                writers.write(shard, row(i))

    return _Written(writers, _commit_or_abort(writers, fill), shapes, kinds)


def _write_stream(examples: Iterable[Mapping[str, Any]] | tf.data.Dataset,
                  num_shards: int | None, target: _Target, var_len: Iterable[str]) -> _Written:
    """An iterable or dataset of dicts: checked as it streams, dealt round-robin.

    A dataset's rank-1 features of unknown length are variable-length. The spool
    file (if the count had to be learned that way) is removed on the way out,
    whether the write succeeded or not.
    """
    var_len = set([var_len] if isinstance(var_len, str) else var_len)
    if isinstance(examples, tf.data.Dataset) and isinstance(examples.element_spec, Mapping):
        var_len |= {key for key, spec in examples.element_spec.items()
                    if getattr(spec, "shape", None) is not None
                    and spec.shape.rank == 1 and spec.shape[0] is None}
    check = _ExampleChecker(var_len)
    length = _known_length(examples)
    source = (_dataset_examples(examples) if isinstance(examples, tf.data.Dataset)
              else iter(examples))
    records = (encode_example(check(i, example)) for i, example in enumerate(source))
    with contextlib.ExitStack() as cleanup:
        if num_shards is None:
            num_shards, records = _stream_shard_count(records, length, target, cleanup)
        writers = target.writers(num_shards)
        sizes = _commit_or_abort(writers, lambda: _deal(writers, records, num_shards))
    return _Written(writers, sizes, check.shapes, check.stored_kinds())


def _stream_shard_count(records: Iterator[bytes], length: int | None, target: _Target,
                        cleanup: contextlib.ExitStack) -> tuple[int, Iterator[bytes]]:
    """Chooses the shard count of a stream; returns it and the records to write.

    A known length needs only a sample for the size estimate (put back in front);
    an unknown one is spooled to a hidden temp file first, which `cleanup` removes.
    """
    if length is not None:
        sample = list(itertools.islice(records, _SIZE_SAMPLE))
        if not sample:
            raise ValueError("examples is empty: nothing to write")
        num_shards = target.choose(_estimate_bytes(sample, length), length)
        return num_shards, itertools.chain(sample, records)
    spool, count, total = _spool(records, target.prefix)
    cleanup.callback(_remove_if_exists, spool)
    if count == 0:
        raise ValueError("examples is empty: nothing to write")
    return target.choose(total, count), (r.numpy() for r in tf.data.TFRecordDataset(spool))


def _deal(writers: _ShardWriters, records: Iterable[bytes], num_shards: int) -> None:
    """Record i goes to shard i % num_shards; fails rather than leave a shard empty."""
    num_examples = 0
    for index, record in enumerate(records):
        writers.write(index % num_shards, record)
        num_examples += 1
    if num_examples == 0:
        raise ValueError("examples is empty: nothing to write")
    if num_examples < num_shards:
        raise ValueError(
            f"got {num_examples} examples for {num_shards} shards, which would "
            f"leave empty shards: use num_shards <= {num_examples}")


def _commit_or_abort(writers: _ShardWriters, fill: Callable[[], None]) -> list[int]:
    """Runs `fill` then commits; on any error removes every temp shard, so no
    half-written shard is ever left behind. Returns the shards' sizes."""
    try:
        fill()
        return writers.commit()
    except BaseException:
        writers.abort()
        raise


def _finish(written: _Written, target: _Target, manifest: bool) -> list[str]:
    """Writes the manifest (if asked) and logs the totals; returns the shard paths."""
    writers, sizes = written.writers, written.sizes
    paths = writers.paths
    if manifest:
        offsets = writers.offsets or [None] * len(paths)
        shards = tuple(Shard(os.path.basename(path), count, size,
                             None if offset is None else tuple(offset))
                       for path, count, size, offset in zip(paths, writers.counts, sizes, offsets))
        write_manifest(manifest_path(target.prefix),
                       Manifest(sum(writers.counts), _spec(written.shapes, written.kinds), shards,
                                target.compression_type or None,
                                block_records=None if writers.offsets is None else BLOCK_RECORDS))
    logging.info("write_tfrecords: %d examples in %d shard(s) %s-*, %.1f MB", sum(writers.counts),
                 len(paths), target.prefix, sum(sizes) / 2**20)
    _remove_earlier_shards(target.prefix, paths)
    if not manifest:
        _remove_earlier_manifest(target.prefix)
    _remove_if_exists(commit_marker(target.prefix))  # whole: readers take it again
    return paths


def _remove_earlier_manifest(prefix: str) -> None:
    """Removes the manifest an earlier write to `prefix` left, once this write (with no
    manifest) is whole: its counts and offsets describe other shards, and a reader
    that finds it beside these would trust them."""
    path = manifest_path(prefix)
    if tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)
        logging.info("write_tfrecords: removed the manifest of an earlier write, %s (this "
                     "write has none: manifest=False)", path)


def _remove_earlier_shards(prefix: str, paths: list[str]) -> None:
    """Removes the shards an earlier write to `prefix` left (another shard count), once
    this write is whole: the glob `prefix-*` must read this write's examples only."""
    pattern = re.compile(re.escape(os.path.basename(prefix)) + r"-\d{5}-of-\d{5}\.tfrecord$")
    stale = [path for path in tf.io.gfile.glob(f"{prefix}-*-of-*.tfrecord")
             if path not in paths and pattern.match(os.path.basename(path))]
    for path in stale:
        tf.io.gfile.remove(path)
    if stale:
        logging.info("write_tfrecords: removed %d shard(s) of an earlier write to %s-*",
                     len(stale), prefix)


def _prepare_folder(prefix: str) -> None:
    """Creates the folder of `prefix`; removes the temp files a killed write to `prefix`
    left there (its temp shards, spool and manifest temp: hidden, named by host and
    pid), before this write needs the room. A live writer's (another process writing
    the prefix now) are left alone."""
    directory, base = os.path.split(prefix)
    if directory:
        tf.io.gfile.makedirs(directory)
    ours = re.compile(r"\." + re.escape(base) + r"(-\d{5}-of-\d{5}\.tfrecord|\.spool|"
                      + re.escape(MANIFEST_SUFFIX) + "|" + re.escape(COMMIT_SUFFIX) + ")"
                      + re.escape(TEMP_MARK))
    killed = [path for path in tf.io.gfile.glob(os.path.join(directory, f".{base}*{TEMP_MARK}*"))
              if ours.match(os.path.basename(path)) and left_by_dead_writer(path)]
    for path in killed:
        _remove_if_exists(path)
    if killed:
        logging.info("write_tfrecords: removed %d temp file(s) of a killed write to %s: %s",
                     len(killed), prefix, ", ".join(sorted(killed)))


def _remove_if_exists(path: str) -> None:
    if tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)


def _spool(records: Iterable[bytes], output_prefix: str) -> tuple[str, int, int]:
    """Writes records to one hidden temp file; returns (path, count, bytes incl. framing)."""
    path = temp_path(f"{output_prefix}.spool", hidden=True)  # a killed one's is found
    count = total = 0
    try:
        with tf.io.TFRecordWriter(path) as writer:
            for record in records:
                writer.write(record)
                count += 1
                total += len(record) + RECORD_OVERHEAD
    except BaseException:
        if tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)
        raise
    return path, count, total
