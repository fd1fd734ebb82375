"""The manifest: a small JSON file that describes a set of TFRecord shards.

`write_tfrecords` writes one next to the shards (`{prefix}.manifest.json`) so
that readers need no hand-written feature spec: it records the number of
examples, the feature spec (shape and dtype of every feature), the compression
and every shard with its example count. Shard paths are stored relative to
the manifest, so a directory can be copied (e.g. to gs://) as a whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import tensorflow as tf

MANIFEST_SUFFIX = ".manifest.json"
_FORMAT = "tputrain.tfrecord_manifest"
_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Shard:
    """One TFRecord file: its path (relative to the manifest) and its contents."""

    path: str
    num_examples: int
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a set of shards holds. `location` is the manifest's own path, if read."""

    num_examples: int
    features: dict[str, tf.io.FixedLenFeature]
    shards: tuple[Shard, ...]
    compression_type: str | None = None
    location: str | None = None

    def files(self) -> list[str]:
        """Shard paths, resolved against the manifest's directory."""
        directory = os.path.dirname(self.location) if self.location else ""
        return [shard.path if "://" in shard.path or os.path.isabs(shard.path)
                else os.path.join(directory, shard.path) for shard in self.shards]

    def examples_per_file(self) -> dict[str, int]:
        return dict(zip(self.files(), (shard.num_examples for shard in self.shards)))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "num_examples": self.num_examples,
            "compression_type": self.compression_type,
            "features": {name: {"shape": list(spec.shape), "dtype": tf.as_dtype(spec.dtype).name}
                         for name, spec in self.features.items()},
            "shards": [dataclasses.asdict(shard) for shard in self.shards],
        }


def manifest_path(output_prefix: str) -> str:
    """Where `write_tfrecords(..., output_prefix)` puts the manifest."""
    return output_prefix + MANIFEST_SUFFIX


def write_manifest(path: str, manifest: Manifest) -> str:
    """Writes the manifest atomically (temp file, then rename); returns `path`."""
    temp = f"{path}.tmp"
    with tf.io.gfile.GFile(temp, "w") as f:
        json.dump(manifest.to_json(), f, indent=1)
        f.write("\n")
    tf.io.gfile.rename(temp, path, overwrite=True)
    return path


def _fail(path: str, problem: str) -> None:
    raise ValueError(f"{path} is not a tputrain TFRecord manifest: {problem}; write the data with "
                     "tputrain.data.write_tfrecords (or `tputrain write-tfrecords`)")


def parse_manifest(data: Mapping[str, Any], location: str | None = None) -> Manifest:
    """Validates a manifest's JSON content."""
    where = location or "manifest"
    if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
        _fail(where, f"'format' is not {_FORMAT!r}")
    if data.get("version") != _VERSION:
        _fail(where, f"unsupported version {data.get('version')!r} (this tputrain reads {_VERSION})")
    try:
        features = {name: tf.io.FixedLenFeature(list(f["shape"]), tf.as_dtype(f["dtype"]))
                    for name, f in data["features"].items()}
        shards = tuple(Shard(str(s["path"]), int(s["num_examples"]), int(s["num_bytes"]))
                       for s in data["shards"])
        num_examples = int(data["num_examples"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        _fail(where, f"bad or missing field ({type(error).__name__}: {error})")
    if not shards:
        _fail(where, "it lists no shards")
    if sum(s.num_examples for s in shards) != num_examples:
        _fail(where, f"num_examples {num_examples} is not the sum of the shards' counts")
    return Manifest(num_examples, features, shards, data.get("compression_type") or None, location)


def read_manifest(path: str) -> Manifest:
    """Reads and validates `path` (any tf.io.gfile path)."""
    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(f"no manifest at {path!r}: check the path; write_tfrecords writes "
                                f"'<output_prefix>{MANIFEST_SUFFIX}'")
    with tf.io.gfile.GFile(path, "r") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            _fail(path, f"invalid JSON ({error})")
    return parse_manifest(data, path)
