"""Corrupt or truncated TFRecord data: name the file, or skip it and count.

TensorFlow reports a bad record as `DataLossError: corrupted record at 162`:
a byte offset, but no file. tputrain keeps the fast path untouched and pays
only when something breaks:

* Strict (the default): `explain_data_loss` turns that error into a one-line
  `CorruptRecordError` naming the file and the record index, by re-reading the
  files the process's `TFRecordInput` pipelines read (only after a failure).
* `TFRecordInput(skip_corrupt=True)`: each file is read with
  `ignore_errors`, which stops that file at its first unreadable record; a
  check at the end of each file prints to stderr how many records were skipped
  (exact when a manifest gives the file's count, else estimated from the bytes
  left).
  TFRecord framing cannot be resynchronised after a bad length field, so the
  rest of that file is skipped, not only the bad record.
"""

from __future__ import annotations

import re
import struct
import sys
from typing import Iterable

import tensorflow as tf

from tputrain.data.manifest import RECORD_OVERHEAD
_OFFSET = re.compile(r"(?:corrupted|truncated) record at (\d+)")
_FIX = ("rewrite the file (tputrain.data.write_tfrecords) or set TFRecordInput.skip_corrupt=True "
        "to skip bad records")

# Files read by TFRecordInput pipelines in this process -> compression type, in the
# order their pipelines were last built (the newest pipeline is the likeliest culprit).
_FILES_READ: dict[str, str] = {}


class CorruptRecordError(IOError):
    """A TFRecord file has an unreadable record; the message names file and record."""


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C, rotated and offset (for header checks only)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _looks_like(head: bytes) -> str:
    if head[:2] == b"\x1f\x8b":
        return "it is gzip-compressed: set compression_type='GZIP' if it holds TFRecords"
    stripped = head.lstrip()
    if stripped[:1] in (b"{", b"["):
        return f"it looks like JSON text: {stripped[:24]!r}"
    text = head.decode("utf-8", "replace").rstrip("\ufffd")  # 32 bytes may cut a character
    if text and all(c != "\ufffd" and (c.isprintable() or c.isspace()) for c in text):
        return f"it looks like text: {head[:24]!r}"
    return "its first 12 bytes are not a TFRecord length header (bad checksum)"


def not_a_tfrecord(path: str, compression_type: str | None = None) -> str | None:
    """Why `path` is clearly not a TFRecord file (reads 32 bytes), or None if it may be one.

    An uncompressed TFRecord file starts with a record length (8 bytes) and its
    masked CRC-32C (4 bytes); a file whose header fails that check was never
    written as TFRecords (a corrupt record further in keeps a valid header).
    """
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            head = f.read(32)
    except tf.errors.OpError:
        return None
    if compression_type == "GZIP":
        return None if head[:2] == b"\x1f\x8b" else (
            "it is not gzip-compressed, but compression_type='GZIP' is set")
    if compression_type:
        return None
    if len(head) < 12:
        return None if not head else f"it has {len(head)} bytes, fewer than a record header"
    if struct.unpack("<I", head[8:12])[0] == masked_crc32c(head[:8]):
        return None
    return _looks_like(head)


def register_files(files: Iterable[str], compression_type: str | None) -> None:
    """Remembers files a pipeline reads, so a later DataLossError can be located."""
    for path in files:
        _FILES_READ.pop(path, None)  # re-registered: now among the newest
        _FILES_READ[path] = compression_type or ""


def _count_readable(path: str, compression: str) -> tuple[int, int]:
    """(records, bytes incl. framing) read from the start until the first error."""
    records = tf.data.TFRecordDataset(path, compression_type=compression).ignore_errors()
    count, size = records.reduce(
        (tf.constant(0, tf.int64), tf.constant(0, tf.int64)),
        lambda state, r: (state[0] + 1,
                          state[1] + tf.cast(tf.strings.length(r), tf.int64) + RECORD_OVERHEAD))
    return int(count), int(size)


def _first_error(path: str, compression: str) -> str | None:
    """The error message of reading `path` strictly, or None if it reads cleanly."""
    try:
        tf.data.TFRecordDataset(path, compression_type=compression).reduce(
            tf.constant(0, tf.int64), lambda n, _: n + 1)
    except (tf.errors.DataLossError, tf.errors.OutOfRangeError) as error:
        return error.message.split("[Op:")[0].strip().split("}} ")[-1]
    return None


def locate_corruption(files: Iterable[str], compression_type: str | None = None,
                      offset: int | None = None) -> tuple[str, int, int, str] | None:
    """Finds the first unreadable file: (path, record index, byte offset, reason), or None.

    `offset` (from TF's message) puts the files whose size fits it first. Reads
    whole files: for the error path only.
    """
    compression = compression_type or ""
    files = list(files)
    if offset is not None and not compression:
        sizes = {}
        for path in files:
            try:
                sizes[path] = tf.io.gfile.stat(path).length
            except tf.errors.OpError:
                sizes[path] = -1
        files.sort(key=lambda p: sizes[p] < offset)  # Stable: candidates first.
    for path in files:
        reason = _first_error(path, compression)
        if reason is not None:
            count, consumed = _count_readable(path, compression)
            return path, count, consumed, reason
    return None


def _still_readable(path: str) -> bool:
    """Whether a registered file is there; a file of an older pipeline whose filesystem
    is gone (a bucket's emulator stopped, no network) is passed over, not raised."""
    try:
        return tf.io.gfile.exists(path)
    except tf.errors.OpError:
        return False


def explain_data_loss(error: Exception) -> Exception:
    """Returns a one-line `CorruptRecordError` for a TF DataLossError, or `error` itself.

    Looks only at files read by `TFRecordInput` pipelines in this process.
    """
    if not isinstance(error, tf.errors.DataLossError) or not _FILES_READ:
        return error
    match = _OFFSET.search(str(error))
    offset = int(match.group(1)) if match else None
    # Newest pipelines first: in a process that built several (a notebook, eval and
    # train), an older one's file that is also corrupt must not be named instead.
    by_compression: dict[str, list[str]] = {}
    for path, compression in reversed(list(_FILES_READ.items())):
        if _still_readable(path):
            by_compression.setdefault(compression, []).append(path)
    for compression, files in by_compression.items():
        found = locate_corruption(files, compression, offset)
        if found is not None:
            path, index, consumed, reason = found
            why = not_a_tfrecord(path, compression) if index == 0 else None
            if why is not None:
                return CorruptRecordError(
                    f"{path} is not a TFRecord file ({why}) but file_pattern matches it: "
                    "narrow file_pattern to the shards (e.g. '<prefix>-*.tfrecord') or "
                    "move the file elsewhere")
            where = f"record {index}" + ("" if compression else f" (byte {consumed})")
            return CorruptRecordError(
                f"corrupt TFRecord file {path}: {where} is unreadable ({reason}): {_FIX}")
    return error


def read_skipping_corrupt(path: tf.Tensor, size: tf.Tensor, expected: tf.Tensor,
                          compression_type: str | None, buffer_size: int | None = None
                          ) -> tf.data.Dataset:
    """One file's records, stopping at the first unreadable one and logging the loss.

    `size` is the file's size in bytes (-1: unknown) and `expected` its record
    count (-1: unknown, e.g. no manifest). A truncation is detected when the bytes
    read (uncompressed files) fall short of `size`, or the records read fall short
    of `expected`. Runs inside tf.data (in a per-file `interleave` function).
    """
    compression = compression_type or ""
    records = tf.data.TFRecordDataset(path, compression_type=compression,
                                      buffer_size=buffer_size).ignore_errors()
    marked = records.map(lambda r: (r, tf.constant(False))).concatenate(
        tf.data.Dataset.from_tensors((tf.constant(b""), tf.constant(True))))

    def check(state, element):
        count, consumed = state
        record, is_end = element

        known_size = tf.logical_and(tf.constant(not compression), size >= 0)

        def report():
            average = consumed // tf.maximum(count, 1)
            lost_bytes = tf.where(known_size, size - consumed, tf.constant(0, tf.int64))
            estimate = tf.where(expected >= 0, expected - count,
                                tf.maximum(lost_bytes // tf.maximum(average, 1), 1))
            exact = tf.where(expected >= 0, tf.constant(""), tf.constant("~"))
            message = tf.strings.join([
                "tputrain: TFRecordInput skipped ", exact, tf.strings.as_string(estimate),
                " corrupt or unreadable record(s) of ", path, ": reading stopped at record ",
                tf.strings.as_string(count), " after ", tf.strings.as_string(consumed), " of ",
                tf.strings.as_string(size), " bytes"])
            # stderr, not TF's C++ log: TF_CPP_MIN_LOG_LEVEL=2 would hide a warning.
            tf.print(message, output_stream=sys.stderr)
            return tf.constant(True)

        truncated = tf.logical_or(tf.logical_and(expected >= 0, count < expected),
                                  tf.logical_and(known_size, consumed < size))
        logged = tf.cond(tf.logical_and(is_end, truncated), report, lambda: tf.constant(False))
        with tf.control_dependencies([logged]):
            step = tf.cast(tf.logical_not(is_end), tf.int64)
            new_state = (count + step,
                         consumed + step * (tf.cast(tf.strings.length(record), tf.int64)
                                            + RECORD_OVERHEAD))
        return new_state, (record, is_end)

    checked = marked.scan((tf.constant(0, tf.int64), tf.constant(0, tf.int64)), check)
    return checked.filter(lambda record, is_end: tf.logical_not(is_end)).map(
        lambda record, is_end: record)
