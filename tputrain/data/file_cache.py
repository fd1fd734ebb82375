"""An on-disk cache's file names: each names the data it holds.

`TFRecordInput(cache='<prefix>')` (and `TFDSInput`) writes each pipeline's
records to files under the prefix on their first pass and reads those files
from then on. tf.data serves whatever a cache file of the given name holds, so
the name carries a short hash of the input's identity: for TFRecords, every
file's path, size, modification time and first bytes, and the read options
(features, label, shuffle, seed, ...). Rewritten data, or another split given
the same prefix (an eval input beside the train one), gets a file of its own
instead of the old or the other split's records; a resumed run of unchanged data
and options names the same file, and reads the cache its first run wrote.
Caches of older data stay on disk until their files are deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import time
from typing import Any, Callable, Iterator, Sequence

import tensorflow as tf
from absl import logging

from tputrain.data.context import InputContext

_HEAD_BYTES = 4096  # each file's first bytes are hashed: a same-size rewrite shows


def cache_file(owner: str, prefix: str, identity: Any, context: InputContext) -> str:
    """This pipeline's cache file under `prefix` for data of `identity` (JSON-able;
    a hash of it goes in the name); the prefix's folder is made if missing."""
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=repr)
                         .encode()).hexdigest()[:12]
    folder = prefix.rpartition("/")[0]
    if folder and not tf.io.gfile.isdir(folder):
        try:
            tf.io.gfile.makedirs(folder)
        except tf.errors.OpError as error:
            raise ValueError(f"{owner}: cannot make the cache folder {folder!r} "
                             f"({error.message}): give cache a writable path prefix") from None
    return (f"{prefix}-{context.input_pipeline_id:05d}-of-"
            f"{context.num_input_pipelines:05d}-{key}")


def written_cache(cached: tf.data.Dataset, path: str, owner: str) -> tf.data.Dataset:
    """`cached` (a `Dataset.cache(path)`), its file written whole first when it is not
    yet: tf.data makes every iterator of an unwritten cache a writer, and a run opens
    its input more than once (a probe, the host iterator, a restore), so the second
    to finish failed ("Existing cache files found"). One pass here, which the first
    epoch would have made anyway, under a lock of tputrain's (`_writing`): another
    process waits for it and then reads the cache."""
    if tf.io.gfile.exists(f"{path}.index"):  # finished: tf.data merged its parts into it
        return cached
    with _writing(path):
        if tf.io.gfile.exists(f"{path}.index"):  # another process wrote it meanwhile
            return cached
        logging.info("%s: writing the cache %s: one pass over this pipeline's data, before "
                     "the first batch", owner, path)
        started = time.perf_counter()
        count = int(cached.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
        logging.info("%s: wrote the cache %s (%d examples, %.1f s)", owner, path, count,
                     time.perf_counter() - started)
    return cached


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """An exclusive lock on `path`.writing for the pass (local files: `flock`, which
    the kernel releases when a writer is killed). Holding it, tf.data's lock files and
    parts are a killed writer's leftovers, and go. Other file systems: no lock."""
    if "://" in path:
        yield
        return
    with open(f"{path}.writing", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for leftover in tf.io.gfile.glob(f"{path}_*"):
                tf.io.gfile.remove(leftover)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def files_identity(paths: Sequence[str]) -> list[list[Any]]:
    """Each file's path, size, modification time (ns) and a hash of its first bytes:
    what changes when the file is rewritten."""
    return [[path, *file_stamp(path).values()] for path in paths]


def file_stamp(path: str) -> dict[str, int | str]:
    """A file's size, modification time (ns) and a hash of its first bytes (a rewrite
    of the same size, e.g. its records reordered, changes the others); -1 and "" for
    a file that cannot be read."""
    size, mtime = _stat(path)
    return {"size": size, "mtime_nsec": mtime, "head": _head_hash(path)}


def callable_name(function: Callable[..., Any] | None) -> str | None:
    """A function by its module and name (not its address, which differs per process)."""
    if function is None:
        return None
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{getattr(function, '__module__', '')}.{name}"


def callable_identity(function: Callable[..., Any] | None) -> list[Any] | None:
    """A function by its name, its code and the plain values it closes over or takes
    by default: a changed body, or the same closure made with another value, names
    another cache (the name alone served the old function's examples). Stable across
    processes: objects without a plain value count by their type."""
    if function is None:
        return None
    if isinstance(function, functools.partial):
        return ["partial", callable_identity(function.func),
                _plain(function.args), _plain(function.keywords)]
    target = function if hasattr(function, "__code__") else type(function).__call__
    cells = getattr(target, "__closure__", None) or ()
    return [callable_name(function), _code_hash(getattr(target, "__code__", None)),
            _plain([_cell(cell) for cell in cells]),
            _plain(getattr(target, "__defaults__", None)),
            _plain(getattr(target, "__kwdefaults__", None)),
            _plain(getattr(function, "__dict__", None) if target is not function else None)]


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None


def _code_hash(code: Any) -> str | None:
    """SHA-256 of a code object's bytecode, names and constants (nested code too)."""
    if code is None:
        return None
    digest = hashlib.sha256(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            const = _code_hash(const)
        elif isinstance(const, frozenset):  # `x in {"a", "b"}`: its order is the hash seed's
            const = sorted(map(repr, const))
        digest.update(repr(const).encode())
    return digest.hexdigest()[:16]


def _plain(value: Any) -> Any:
    """`value` as JSON-able data: plain values as they are, arrays by their bytes'
    hash, functions by `callable_identity`, other objects by their type's name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return hashlib.sha256(value).hexdigest()[:16]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "dtype") and hasattr(value, "tobytes"):  # NumPy arrays, scalars
        return [str(value.dtype), list(getattr(value, "shape", ())),
                hashlib.sha256(value.tobytes()).hexdigest()[:16]]
    if callable(value) and (hasattr(value, "__code__") or isinstance(value, functools.partial)):
        return callable_identity(value)
    return type(value).__qualname__


def _stat(path: str) -> tuple[int, int]:
    try:
        stat = tf.io.gfile.stat(path)
    except tf.errors.OpError:
        return -1, -1
    return int(stat.length), int(stat.mtime_nsec)


def _head_hash(path: str) -> str:
    try:
        with tf.io.gfile.GFile(path, "rb") as file:
            return hashlib.sha256(file.read(_HEAD_BYTES)).hexdigest()[:16]
    except tf.errors.OpError:
        return ""
