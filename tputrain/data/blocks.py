"""Blocks: where every K-th record of a TFRecord shard starts, so a reader can begin
anywhere in a data set without reading what comes before.

A block is K consecutive records of one file (the last block of a file may be
shorter): its file, the byte offset of its first record, that record's index in
the file, and its record count. The positional input (`tputrain.data.positional`)
reads blocks at their byte offsets, so its position is a few integers and a resume
seeks instead of re-reading.

Where the offsets come from:

* shards `write_tfrecords` wrote: their manifest records them (the writer knows
  every record's length as it writes), trusted while the shard is the size the
  manifest says (a shard rewritten after its manifest is scanned, with a warning);
* any other shard: a one-time scan of its record headers (8-byte length, then the
  next header length + 8 bytes further on; no record is read or parsed), cached
  in a small JSON file beside the shard (hidden: `.NAME.blocks-K.json`), or, where
  the data folder is read-only, in `cache_dir` (the Trainer's model_dir). A cache
  whose shard's size, modification time or first 4 KiB differ is scanned again.

Compressed shards (GZIP, ZLIB) have no byte offsets a reader can seek to: their
blocks record only the first record's index, and a block is read by skipping that
many records of its file (cheap at the record level, but not free).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from typing import Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.atomic import write_atomically
from tputrain.data.file_cache import file_stamp
from tputrain.data.manifest import RECORD_OVERHEAD, Manifest

BLOCK_RECORDS = 256  # records a block: the reads' unit (long enough to cost what a scan costs)
_CACHE_FORMAT = "tputrain.tfrecord_blocks"
_HEADER = 12  # length (8) + its CRC (4)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Every block of a set of files, in file order (one row per block)."""

    files: tuple[str, ...]
    file_index: np.ndarray  # int64 [B]: index into `files`
    offsets: np.ndarray  # int64 [B]: byte offset of the block's first record (-1: compressed)
    first: np.ndarray  # int64 [B]: index of the block's first record in its file
    counts: np.ndarray  # int64 [B]: records in the block

    @property
    def num_records(self) -> int:
        return int(self.counts.sum())


def blocks_of(num_records: int, offsets: Sequence[int] | None, block_records: int
              ) -> list[tuple[int, int, int]]:
    """(byte offset or -1, first record, count) of each block of a file of `num_records`."""
    firsts = range(0, num_records, block_records)
    if offsets is not None and len(offsets) != len(firsts):
        raise ValueError(f"{len(offsets)} block offsets for {num_records} records in blocks "
                         f"of {block_records}: the manifest or cache is inconsistent; "
                         "delete the cache or write the data again")
    return [(offsets[i] if offsets is not None else -1, first,
             min(block_records, num_records - first)) for i, first in enumerate(firsts)]


def scan_offsets(path: str, block_records: int) -> tuple[list[int], int]:
    """(byte offset of every `block_records`-th record, record count) of an uncompressed
    TFRecord file, from its record headers alone."""
    size = tf.io.gfile.stat(path).length
    offsets: list[int] = []
    position = count = 0
    with tf.io.gfile.GFile(path, "rb") as f:
        while position < size:
            if count % block_records == 0:
                offsets.append(position)
            f.seek(position)
            header = f.read(_HEADER)
            if len(header) < _HEADER:
                break
            position += struct.unpack("<Q", header[:8])[0] + RECORD_OVERHEAD
            count += 1
    if position != size:
        raise tf.errors.DataLossError(
            None, None, f"{path} is not a whole TFRecord file (a record header at byte "
            f"{position} points past its {size} bytes): is it truncated, compressed "
            "(set compression_type) or not a TFRecord file?")
    return offsets, count


def _cache_paths(path: str, block_records: int, cache_dir: str | None) -> list[str]:
    directory, name = os.path.split(path)
    paths = [os.path.join(directory, f".{name}.blocks-{block_records}.json")]
    if cache_dir is not None:
        key = hashlib.sha256(path.encode()).hexdigest()[:16]
        paths.append(os.path.join(cache_dir, "input_blocks", f"{name}.{key}.{block_records}.json"))
    return paths


def _read_cache(candidates: list[str], stamp: dict[str, int | str]
                ) -> tuple[list[int], int] | None:
    for candidate in candidates:
        try:
            with tf.io.gfile.GFile(candidate, "r") as f:
                data = json.load(f)
        except (tf.errors.OpError, OSError, ValueError):
            continue
        if data.get("format") == _CACHE_FORMAT and all(
                data.get(key) == value for key, value in stamp.items()):
            return [int(o) for o in data["offsets"]], int(data["records"])
    return None


def _write_cache(candidates: list[str], offsets: list[int], count: int,
                 stamp: dict[str, int | str]) -> None:
    """Beside the data, else in the fallback folder; a cache nowhere is only logged."""
    text = json.dumps({"format": _CACHE_FORMAT, **stamp, "records": count,
                       "offsets": offsets})
    for candidate in candidates:
        try:
            tf.io.gfile.makedirs(os.path.dirname(candidate))
            write_atomically(candidate, text, durable=False)
            return
        except (tf.errors.OpError, OSError):
            continue
    logging.warning("tputrain: could not cache the block offsets of %s (tried %s): the "
                    "next run scans it again; give a writable cache_dir", candidates[0],
                    candidates)


def cached_offsets(path: str, block_records: int, cache_dir: str | None) -> tuple[list[int], int]:
    """A shard's block offsets and record count: from its cache, else scanned once and
    cached."""
    stamp = file_stamp(path)
    candidates = _cache_paths(path, block_records, cache_dir)
    found = _read_cache(candidates, stamp)
    if found is not None:
        return found
    logging.info("tputrain: scanning the record headers of %s once (no manifest offsets)", path)
    offsets, count = scan_offsets(path, block_records)
    _write_cache(candidates, offsets, count, stamp)
    return offsets, count


def _count_records(path: str, compression: str | None) -> int:
    dataset = tf.data.TFRecordDataset(path, compression_type=compression or "")
    return int(dataset.reduce(np.int64(0), lambda n, _: n + 1))


def _matches(path: str, num_bytes: int, manifest: Manifest) -> bool:
    """The shard at `path` is the size its manifest says; else a warning: the manifest
    is stale (the file was rewritten after it) and its counts and offsets are not used."""
    size = tf.io.gfile.stat(path).length
    if size == num_bytes:
        return True
    logging.warning("tputrain: %s is %d bytes but its manifest %s says %d: the manifest is "
                    "stale (the shard was rewritten after it), so its blocks are found by a "
                    "scan; rewrite the data with write_tfrecords, or delete the manifest",
                    path, size, manifest.location, num_bytes)
    return False


def file_blocks(path: str, manifest: Manifest | None, block_records: int,
                compression: str | None, cache_dir: str | None) -> list[tuple[int, int, int]]:
    """One file's blocks: the manifest's offsets when it has them for this block size,
    else the scan (uncompressed) or a record count (compressed)."""
    shard = manifest.shard_at(path) if manifest is not None else None
    if shard is not None and not _matches(path, shard.num_bytes, manifest):
        shard = None
    if shard is not None and manifest.block_records == block_records and (
            shard.block_offsets is not None or compression):
        return blocks_of(shard.num_examples, None if compression else shard.block_offsets,
                         block_records)
    if compression:
        count = shard.num_examples if shard is not None else _count_records(path, compression)
        return blocks_of(count, None, block_records)
    offsets, count = cached_offsets(path, block_records, cache_dir)
    return blocks_of(count, offsets, block_records)


def block_table(files: Sequence[str], manifests: Sequence[Manifest] = (),
                block_records: int = BLOCK_RECORDS, compression: str | None = None,
                cache_dir: str | None = None) -> Blocks:
    """The blocks of `files` (in their order), from the manifests that list them or a scan."""
    rows: list[tuple[int, int, int, int]] = []
    for index, path in enumerate(files):
        manifest = next((m for m in manifests if m.shard_at(path) is not None), None)
        rows += [(index, *block) for block in
                 file_blocks(path, manifest, block_records, compression, cache_dir)]
    table = np.array(rows, np.int64).reshape([-1, 4])
    return Blocks(tuple(files), table[:, 0], table[:, 1], table[:, 2], table[:, 3])
