"""The manifest: a small JSON file that describes a set of TFRecord shards.

`write_tfrecords` writes one next to the shards (`{prefix}.manifest.json`) so
that readers need no hand-written feature spec: it records the number of
examples, the feature spec (shape and dtype of every feature; a variable-length
one has shape `[null]`), the compression and every shard with its example count. Shard paths are stored relative to
the manifest, so a directory can be copied (e.g. to gs://) as a whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterable, Mapping

import tensorflow as tf

from tputrain.checkpointing.atomic import atomic_path, is_temp

MANIFEST_SUFFIX = ".manifest.json"
# Beside the shards while write_tfrecords renames them into place (`commit_marker`): a
# kill between two renames leaves a mix of two writes, which readers refuse while it is there.
COMMIT_SUFFIX = ".commit-in-progress"
# The TFRecord files' format, for their writer and readers: the compressions a
# manifest may record, and the framing bytes of each record (length (8) + length
# CRC (4) + data CRC (4)), which sizes and byte offsets count.
COMPRESSION_TYPES = (None, "", "ZLIB", "GZIP")
RECORD_OVERHEAD = 16
_FORMAT = "tputrain.tfrecord_manifest"
_VERSION = 1
# Version 2 adds variable-length features (shape [null]); written only when there is one,
# so readers of version 1 keep reading what they always could, and refuse the rest by name.
_VAR_LEN_VERSION = 2
_VERSIONS = (_VERSION, _VAR_LEN_VERSION)
# Files write_tfrecords makes besides the shards: temp shards and spools of a write in
# progress or killed (hidden, "<name>.tmp-<host>-<pid>-<hex>", the atomic-write helper's,
# or from older versions "<name>.tmp-<hex>"; "<prefix>.spool-<hex>"), and manifest temp
# files (older versions wrote "<manifest>.tmp").
# A parsed feature: fixed-length, or variable-length (a rank-1 RaggedFeature).
FeatureSpec = tf.io.FixedLenFeature | tf.io.RaggedFeature
_TEMP_FILE = re.compile(r"^\..+\.(tmp|spool)-[0-9a-f]{32}$")
_BLOCKS_CACHE = re.compile(r"^\..+\.blocks-\d+\.json$")  # tputrain.data.blocks' scan cache
_SHARD_FILE = re.compile(r"^(.+)-\d{5}-of-\d{5}\.tfrecord$")


class IncompleteWriteError(ValueError):
    """The shards of a prefix are a write_tfrecords that did not finish renaming them."""


def commit_marker(output_prefix: str) -> str:
    """The file that marks `output_prefix` while `write_tfrecords` renames its shards
    into place (written before the first rename, removed after the manifest)."""
    return output_prefix + COMMIT_SUFFIX


def mark_committing(output_prefix: str) -> str:
    """Writes `commit_marker(output_prefix)` (durably, before any shard is renamed)."""
    path = commit_marker(output_prefix)
    with atomic_path(path, hidden=True) as temp, tf.io.gfile.GFile(temp, "w") as f:
        f.write("write_tfrecords is renaming the shards of this prefix into place; if this "
                "file stays, the write was stopped half-way: rerun it\n")
    return path


def check_committed(output_prefix: str) -> None:
    """Refuses the shards of `output_prefix` while its commit marker is there: a
    write_tfrecords stopped (killed) between two renames, or renaming now, left new
    shards beside old ones, the same sizes maybe, under the old manifest."""
    marker = commit_marker(output_prefix)
    if tf.io.gfile.exists(marker):
        raise IncompleteWriteError(
            f"the shards of {output_prefix} may mix two writes: a write_tfrecords to that "
            f"prefix was stopped while renaming its shards into place (or is doing so now; "
            f"{marker} says so): rerun the write (tputrain.data.write_tfrecords, or "
            f"`tputrain write-tfrecords --output_prefix={output_prefix}`), which removes it")


def check_shards_committed(files: Iterable[str]) -> None:
    """`check_committed` for the prefix of each writer-named shard among `files` (one
    lookup per prefix)."""
    prefixes = {manifest[:-len(MANIFEST_SUFFIX)] for manifest in map(manifest_for_shard, files)
                if manifest is not None}
    for prefix in sorted(prefixes):
        check_committed(prefix)


def writer_side_file(path: str) -> str | None:
    """Why `path` is a file `write_tfrecords` made that is not a shard, or None.

    A glob such as "DIR/train*" also matches the manifest and, after an
    interrupted write, temp files; `TFRecordInput` skips these by name.
    """
    name = os.path.basename(path.rstrip("/"))
    if name.endswith(MANIFEST_SUFFIX):
        return "a tputrain manifest"
    if name.endswith(MANIFEST_SUFFIX + ".tmp"):
        return "a manifest temp file"
    if name.endswith(COMMIT_SUFFIX):
        return "the mark of a write renaming its shards (or stopped while it did)"
    if _TEMP_FILE.match(name) or is_temp(name):
        return "a temp file of a write in progress or interrupted"
    if _BLOCKS_CACHE.match(name):
        return "a cache of a shard's block offsets"
    return None


def manifest_for_shard(path: str) -> str | None:
    """The manifest `write_tfrecords` would have written next to this shard, by its name."""
    directory, name = os.path.split(path)
    match = _SHARD_FILE.match(name)
    return os.path.join(directory, match.group(1) + MANIFEST_SUFFIX) if match else None


@dataclasses.dataclass(frozen=True)
class Shard:
    """One TFRecord file: its path (relative to the manifest) and its contents."""

    path: str
    num_examples: int
    num_bytes: int
    # Byte offset of every `Manifest.block_records`-th record (uncompressed shards
    # written by write_tfrecords; None otherwise): where a positional reader seeks.
    block_offsets: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        entry = {"path": self.path, "num_examples": self.num_examples,
                 "num_bytes": self.num_bytes}
        if self.block_offsets is not None:
            entry["block_offsets"] = list(self.block_offsets)
        return entry


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a set of shards holds. `location` is the manifest's own path, if read."""

    num_examples: int
    features: dict[str, FeatureSpec]
    shards: tuple[Shard, ...]
    compression_type: str | None = None
    location: str | None = None
    block_records: int | None = None  # records a block (`Shard.block_offsets`), if recorded

    def files(self) -> list[str]:
        """Shard paths, resolved against the manifest's directory."""
        directory = os.path.dirname(self.location) if self.location else ""
        return [shard.path if "://" in shard.path or os.path.isabs(shard.path)
                else os.path.join(directory, shard.path) for shard in self.shards]

    def examples_per_file(self) -> dict[str, int]:
        return dict(zip(self.files(), (shard.num_examples for shard in self.shards)))

    def shard_at(self, path: str) -> Shard | None:
        """The shard read at `path` (a resolved path, as `files` gives), or None."""
        return dict(zip(self.files(), self.shards)).get(path)

    def to_json(self) -> dict[str, Any]:
        var_len = any(is_var_len(spec) for spec in self.features.values())
        return {
            "format": _FORMAT,
            "version": _VAR_LEN_VERSION if var_len else _VERSION,
            "num_examples": self.num_examples,
            "compression_type": self.compression_type,
            "features": {name: {"shape": [None] if is_var_len(spec) else list(spec.shape),
                                "dtype": tf.as_dtype(spec.dtype).name}
                         for name, spec in self.features.items()},
            "shards": [shard.to_json() for shard in self.shards],
            **({"block_records": self.block_records} if self.block_records else {}),
        }


def is_var_len(spec: Any) -> bool:
    """Whether a parsed feature spec is variable-length (a rank-1 `RaggedFeature`)."""
    return isinstance(spec, tf.io.RaggedFeature)


def var_len_feature(dtype: Any) -> tf.io.RaggedFeature:
    """The spec of a variable-length feature: one rank-1 row of values per example."""
    return tf.io.RaggedFeature(tf.as_dtype(dtype), row_splits_dtype=tf.int64)


def _feature_from_json(entry: Mapping[str, Any]) -> FeatureSpec:
    shape = list(entry["shape"])
    if shape == [None]:
        return var_len_feature(entry["dtype"])
    return tf.io.FixedLenFeature(shape, tf.as_dtype(entry["dtype"]))


def manifest_path(output_prefix: str) -> str:
    """Where `write_tfrecords(..., output_prefix)` puts the manifest."""
    return output_prefix + MANIFEST_SUFFIX


def write_manifest(path: str, manifest: Manifest) -> str:
    """Writes the manifest atomically (temp file, then rename); returns `path`.

    The temp file is hidden and unique, so a glob of the shards never matches it
    and concurrent writers do not share one.
    """
    with atomic_path(path, hidden=True) as temp, tf.io.gfile.GFile(temp, "w") as f:
        json.dump(manifest.to_json(), f, indent=1)
        f.write("\n")
    return path


def _fail(path: str, problem: str) -> None:
    raise ValueError(f"{path} is not a tputrain TFRecord manifest: {problem}; write the data with "
                     "tputrain.data.write_tfrecords (or `tputrain write-tfrecords`)")


def parse_manifest(data: Mapping[str, Any], location: str | None = None) -> Manifest:
    """Validates a manifest's JSON content."""
    where = location or "manifest"
    if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
        _fail(where, f"'format' is not {_FORMAT!r}")
    if data.get("version") not in _VERSIONS:
        _fail(where, f"unsupported version {data.get('version')!r} (this tputrain reads "
              f"versions {_VERSION} and {_VAR_LEN_VERSION})")
    try:
        features = {name: _feature_from_json(f) for name, f in data["features"].items()}
        shards = tuple(Shard(str(s["path"]), int(s["num_examples"]), int(s["num_bytes"]),
                             _offsets(s.get("block_offsets")))
                       for s in data["shards"])
        block_records = int(data["block_records"]) if data.get("block_records") else None
        num_examples = int(data["num_examples"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        _fail(where, f"bad or missing field ({type(error).__name__}: {error})")
    if not shards:
        _fail(where, "it lists no shards")
    if sum(s.num_examples for s in shards) != num_examples:
        _fail(where, f"num_examples {num_examples} is not the sum of the shards' counts")
    return Manifest(num_examples, features, shards, data.get("compression_type") or None, location,
                    block_records)


def _offsets(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(offset) for offset in value)


def read_manifest(path: str) -> Manifest:
    """Reads and validates `path` (any tf.io.gfile path); refuses the shards of a
    write stopped while it renamed them (`check_committed`): its manifest is the old one."""
    if path.endswith(MANIFEST_SUFFIX):
        check_committed(path[:-len(MANIFEST_SUFFIX)])
    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(f"no manifest at {path!r}: check the path; write_tfrecords writes "
                                f"'<output_prefix>{MANIFEST_SUFFIX}'")
    if tf.io.gfile.isdir(path):
        raise IsADirectoryError(f"the manifest {path!r} is a folder: pass the "
                                f"'<output_prefix>{MANIFEST_SUFFIX}' file inside it")
    with tf.io.gfile.GFile(path, "r") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            _fail(path, f"invalid JSON ({error})")
    return parse_manifest(data, path)
