"""Records that do not match the feature spec: one error naming feature, spec and data.

`tf.io.parse_example` reports a mismatch as an `InvalidArgumentError` such as
"Key: x, Index: 0. Number of float values != expected", naming neither the
file nor the shape the data has. tputrain checks in two places:

* Up front, free of reads: when the shards have a manifest (`write_tfrecords`
  writes one next to them), the requested spec is compared with the manifest's
  (`check_against_manifest`).
* After a failure (error path only): `explain_parse_error` re-reads raw records
  of the files this process's `TFRecordInput` pipelines read, decodes them with
  `tf.train.Example` and names the file, record, feature and what it holds.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterable, Mapping

import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.data.manifest import (FeatureSpec, Manifest, is_var_len, manifest_for_shard,
                                    read_manifest)

_FIX = ("fix the feature spec to match the data (or read with TFRecordInput(manifest=...), which "
        "takes the spec from the manifest), or rewrite the data (tputrain.data.write_tfrecords)")
_FIX_NO_MANIFEST = ("fix the feature spec to match the data (float_list reads as float32, "
                    "int64_list as int64, bytes_list as string; any shape with that many "
                    "values), or rewrite the data (tputrain.data.write_tfrecords)")
_LIST_OF = {tf.float32: "float_list", tf.int64: "int64_list", tf.string: "bytes_list"}
# Parse errors of tf.io.parse_example: the feature's key, and what went wrong.
_KEY = re.compile(r"Key: (.+?), Index: \d+\.\s+(.*?)(?:\n|\s\[|$)")
_MISSING = re.compile(r"Feature: (.+?) \(data type: \w+\) is required but could not be found")
_NOT_EXAMPLE = "Could not parse example input"
_RECORD_BUDGET = 20_000  # records decoded in Python to locate a mismatch: a bounded pause
_MAX_MANIFESTS = 8  # distinct shard prefixes looked up next to the files
_MAX_PIPELINES = 32

# Pipelines built in this process, newest last: files -> (spec, compression).
_PIPELINES: dict[tuple[str, ...], tuple[dict[str, FeatureSpec], str]] = {}


class FeatureSpecError(ValueError):
    """The records do not hold what the feature spec asks for.

    The message names the feature, the spec's shape and dtype, and what the data
    holds (from its manifest, or from a record, naming the file).
    """


def describe_spec(spec: FeatureSpec) -> str:
    """E.g. "float32 [3] (3 values)": what parse_example needs."""
    if is_var_len(spec):
        return f"{tf.as_dtype(spec.dtype).name} [None] (variable-length: any number of values)"
    size = math.prod(spec.shape)
    return (f"{tf.as_dtype(spec.dtype).name} {list(spec.shape)} "
            f"({size} value{'' if size == 1 else 's'})")


def _same_values(wanted: FeatureSpec, actual: FeatureSpec) -> bool:
    """parse_example reads any shape with the same number of values (a reshape), and a
    variable-length spec reads any number; a fixed spec cannot read variable-length data."""
    if tf.as_dtype(wanted.dtype) != tf.as_dtype(actual.dtype):
        return False
    if is_var_len(wanted) or is_var_len(actual):
        return is_var_len(wanted)
    return math.prod(wanted.shape) == math.prod(actual.shape)


def check_against_manifest(features: Mapping[str, FeatureSpec],
                           manifest: Manifest) -> None:
    """Raises `FeatureSpecError` listing every feature the manifest's data cannot fill."""
    where = manifest.location or "the manifest"
    problems = []
    for name, wanted in features.items():
        actual = manifest.features.get(name)
        if actual is None:
            if getattr(wanted, "default_value", None) is None:
                problems.append(f"feature {name!r} ({describe_spec(wanted)}) is not in the data "
                                f"(it has {sorted(manifest.features)})")
        elif not _same_values(wanted, actual):
            fix = (": read it as variable-length, ([None], dtype), and make it static with "
                   "TFRecordInput(to_static=...)"
                   if is_var_len(actual) and not is_var_len(wanted) else "")
            problems.append(f"feature {name!r}: the spec asks for {describe_spec(wanted)} but the "
                            f"data holds {describe_spec(actual)}{fix}")
    if problems:
        raise FeatureSpecError(f"{'; '.join(problems)} (per {where}): {_FIX}")


def manifests_next_to(files: Iterable[str], found: Iterable[str] = ()) -> list[Manifest]:
    """Manifests of these shards: ones the glob matched (`found`) and, by the writer's
    shard names, ones next to them. Unreadable manifests are ignored (a hint only)."""
    files = list(files)
    candidates = dict.fromkeys(found)
    for path in files:
        candidate = manifest_for_shard(path)
        if candidate is not None and len(candidates) < _MAX_MANIFESTS:
            candidates.setdefault(candidate)
    listed = set(files)
    manifests = []
    for path in candidates:
        try:
            if not tf.io.gfile.exists(path):
                continue
            manifest = read_manifest(path)
        except (ValueError, OSError, tf.errors.OpError) as error:
            logging.debug("tputrain: ignoring manifest %s: %s", path, error)
            continue
        if listed.intersection(manifest.files()):  # It describes files being read.
            manifests.append(manifest)
    return manifests


def register_pipeline(files: Iterable[str], features: Mapping[str, FeatureSpec],
                      compression_type: str | None) -> None:
    """Remembers what a pipeline parses, so a later parse error can be located."""
    key = tuple(files)
    _PIPELINES.pop(key, None)
    _PIPELINES[key] = (dict(features), compression_type or "")
    while len(_PIPELINES) > _MAX_PIPELINES:
        _PIPELINES.pop(next(iter(_PIPELINES)))


def _holds(feature: tf.train.Feature) -> str:
    kind = feature.WhichOneof("kind")
    if kind is None:
        return "an empty feature (no values)"
    count = len(getattr(feature, kind).value)
    return f"{kind} of {count} value{'' if count == 1 else 's'}"


def record_mismatch(record: bytes, features: Mapping[str, FeatureSpec]
                    ) -> tuple[str | None, str] | None:
    """(feature, what the record holds) for the first feature it cannot fill, or None.

    The feature is None when the record is not a tf.train.Example at all.
    """
    try:
        example = tf.train.Example.FromString(record)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError; any failure means "not one"
        return None, "not a serialized tf.train.Example"
    present = example.features.feature
    for name, spec in features.items():
        if name not in present:
            if getattr(spec, "default_value", None) is None:
                return name, f"the feature is missing (the record has {sorted(present)})"
            continue
        feature = present[name]
        kind = feature.WhichOneof("kind")
        if is_var_len(spec):  # any number of values; an empty feature has no kind
            if kind not in (None, _LIST_OF[tf.as_dtype(spec.dtype)]):
                return name, _holds(feature)
            continue
        count = len(getattr(feature, kind).value) if kind else 0
        if kind != _LIST_OF[tf.as_dtype(spec.dtype)] or count != math.prod(spec.shape):
            return name, _holds(feature)
    return None


def locate_mismatch(files: Iterable[str], features: Mapping[str, FeatureSpec],
                    compression_type: str | None = None, budget: int = _RECORD_BUDGET
                    ) -> tuple[str, int, str | None, str] | None:
    """(file, record index, feature, what it holds) of the first mismatching record.

    Reads at most `budget` records in all, from the start of each file in turn:
    for the error path only.
    """
    for path in files:
        if budget <= 0:
            return None
        records = tf.data.TFRecordDataset(path, compression_type=compression_type or "")
        try:
            for index, record in enumerate(records.take(budget).as_numpy_iterator()):
                budget -= 1
                found = record_mismatch(record, features)
                if found is not None:
                    return (path, index) + found
        except tf.errors.OpError:  # Unreadable: a corrupt-record error names it elsewhere.
            continue
    return None


def _message(path: str, index: int, name: str | None, holds: str,
             features: Mapping[str, FeatureSpec]) -> str:
    where = f"record {index} of {path}"
    if name is None:
        return (f"{where} is {holds}: TFRecordInput parses tf.train.Example records; "
                "rewrite the data with tputrain.data.write_tfrecords or narrow file_pattern")
    return (f"feature {name!r}: the spec asks for {describe_spec(features[name])} but {where} "
            f"holds {holds}: {_FIX_NO_MANIFEST}")


def _from_tf_message(text: str) -> str | None:
    """A one-line description from TF's parse error alone (no file could be named)."""
    if match := _KEY.search(text):
        return f"feature {match.group(1)!r}: {match.group(2).strip()}"
    if match := _MISSING.search(text):
        return f"feature {match.group(1)!r} is missing from a record"
    if _NOT_EXAMPLE in text:
        return "a record is not a serialized tf.train.Example"
    return None


def explain_parse_error(error: Exception) -> Exception:
    """Returns a one-line `FeatureSpecError` for a parse_example error, else `error`.

    Looks for the culprit record in the files of this process's `TFRecordInput`
    pipelines, newest first; if none is found within the read budget, the
    message is built from TF's own (feature and problem, no file).
    """
    if not isinstance(error, tf.errors.InvalidArgumentError):
        return error
    summary = _from_tf_message(str(error))
    if summary is None:
        return error
    key = next((m.group(1) for m in (_KEY.search(str(error)), _MISSING.search(str(error)))
                if m), None)
    for files, (features, compression) in reversed(list(_PIPELINES.items())):
        if key is not None and key not in features:
            continue  # Another pipeline's parse failed.
        found = locate_mismatch([f for f in files if tf.io.gfile.exists(f)], features,
                                compression)
        if found is not None:
            return FeatureSpecError(_message(*found, features))
    return FeatureSpecError(f"{summary} (tf.io.parse_example): {_FIX_NO_MANIFEST}")


_VALUE_BUDGET = 1_000_000  # records read (parsed a chunk at a time) to locate a bad value


def locate_value(feature: str, is_bad: Callable[[np.ndarray], np.ndarray]
                 ) -> tuple[str, int] | None:
    """(file, record index) of the first record, in file order, whose `feature` holds
    a value `is_bad` (vectorised, per value) flags, in the files of this process's
    newest `TFRecordInput` pipeline that parses `feature`; None if none is found
    within the read budget. Error path only: it reads the files again."""
    for files, (features, compression) in reversed(list(_PIPELINES.items())):
        spec = features.get(feature)
        if spec is None or is_var_len(spec):
            continue
        budget = _VALUE_BUDGET
        for path in files:
            records = tf.data.TFRecordDataset(path, compression_type=compression)
            start = 0
            for chunk in records.take(budget).batch(4096):
                values = tf.io.parse_example(chunk, {feature: spec})[feature].numpy()
                bad = np.flatnonzero(is_bad(values).reshape(len(values), -1).any(axis=1))
                if bad.size:
                    return path, start + int(bad[0])
                start += len(values)
            budget -= start
            if budget <= 0:
                return None
        return None
    return None
