"""Atomic writes: a reader, or a rerun after a kill, sees the old file or the new one
whole, never half of one, and two writers of the same path never share a temp file.

Every file tputrain writes in place (records, JSON state, configs, exports, caches)
goes through this module, and so can a user's action:

    tputrain.write_atomically(path, text_or_bytes)
    with tputrain.atomic_path(path) as temp:   # a writer that wants a path (h5, SavedModel)
        model.save_weights(temp)

How: the data goes to a temp file (or folder) in the target's folder, named
`<name>.tmp-<host>-<pid>-<random>` (unique per writer, and a killed writer's temps
are recognised by `temp_owner`); on a local disk the temp's files are fsynced
before the rename, so a power loss after the rename cannot leave the new name on
empty data, and the folder is fsynced after it, so the rename itself survives. The
rename is the last step. `gs://` and other `tf.io.gfile` paths work the same way
(an object appears whole when its write closes; there is nothing to fsync).
TensorFlow is imported only for a path that needs it or once it is loaded: the XLA
cache's bookkeeping is written before (`import tputrain` imports no TensorFlow).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import uuid
from typing import Any, Iterator

TEMP_MARK = ".tmp-"
_TEMP_NAME = re.compile(r"^\.?(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-(?P<token>[0-9a-f]{8})"
                        r"(?P<suffix>\.[A-Za-z0-9]+)?$")


def temp_path(target: str, keep_suffix: bool = False, hidden: bool = False) -> str:
    """A temp name for `target` in its folder, unique to this writer: host, pid, random.

    `keep_suffix`: end it in the target's extension too (writers that check it: Keras'
    `.keras`). `hidden`: begin it with a dot, so that a glob of the targets ("train-*",
    the shards of a TFRecord write) never matches a killed writer's temp."""
    folder, name = os.path.split(target.rstrip("/"))
    suffix = os.path.splitext(name)[1] if keep_suffix else ""
    host = socket.gethostname().replace("/", "_")
    name = f"{'.' if hidden else ''}{name}{TEMP_MARK}{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return os.path.join(folder, name + suffix) if folder else name + suffix


def temp_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of the writer of a temp `name` (a base name), or None if it is none."""
    match = _TEMP_NAME.match(os.path.basename(name.rstrip("/")))
    return (match.group("host"), int(match.group("pid"))) if match else None


def left_by_dead_writer(name: str) -> bool:
    """Whether `name` is a temp of a writer on this host that is no longer running (a
    killed one): safe to remove. A live writer's, or another host's, is not touched
    (a reused pid reads as alive: the temp is kept, never wrongly removed)."""
    owner = temp_owner(name)
    if owner is None or owner[0] != socket.gethostname().replace("/", "_"):
        return False
    try:
        os.kill(owner[1], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process
        return False
    return False


def is_temp(name: str) -> bool:
    """Whether `name` (a path or a base name) is a temp file of this module's writes."""
    return temp_owner(name) is not None


def _is_local(path: str) -> bool:
    return "://" not in path


def _gfile(*paths: str) -> Any:
    """`tf.io.gfile` when a path needs it or TensorFlow is loaded (its file events are
    the ones tests watch), else None: plain `os` calls on a local disk."""
    if "tensorflow" in sys.modules or not all(_is_local(p) for p in paths):
        import tensorflow as tf

        return tf.io.gfile
    return None


def _fsync(path: str) -> None:
    """Flushes a local file, or every file in a local folder and the folder, to disk."""
    if os.path.isdir(path):
        for folder, _, names in os.walk(path):
            for name in names:
                _fsync_one(os.path.join(folder, name), os.O_RDONLY)
            _fsync_one(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    else:
        _fsync_one(path, os.O_RDONLY)


def _fsync_one(path: str, flags: int) -> None:
    handle = os.open(path, flags)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _remove(path: str) -> None:
    gfile = _gfile(path)
    if gfile is None:
        if os.path.isdir(path):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)
    elif gfile.isdir(path):
        gfile.rmtree(path)
    elif gfile.exists(path):
        gfile.remove(path)


def _rename(source: str, target: str, overwrite: bool) -> None:
    if (not overwrite and _is_local(source) and _is_local(target)
            and not os.path.isdir(source) and _link(source, target)):
        os.remove(source)
        return
    gfile = _gfile(source, target)
    if gfile is not None:
        gfile.rename(source, target, overwrite=overwrite)
    elif overwrite:
        os.replace(source, target)
    elif os.path.lexists(target):
        raise FileExistsError(f"{target} already exists")
    else:  # a folder: rename refuses a target folder that has files
        os.rename(source, target)


def _link(source: str, target: str) -> bool:
    """Hard-links `source` at `target`, which fails if `target` exists, however late
    another writer made it (a check, then a rename, would replace that writer's file).
    False where the file system has no hard links (the caller checks, then renames)."""
    try:
        os.link(source, target)
    except FileExistsError:
        raise FileExistsError(f"{target} already exists") from None
    except OSError:
        return False
    return True


def move(source: str, target: str, overwrite: bool = True, durable: bool = True) -> None:
    """Renames `source` to `target` (any `tf.io.gfile` path); on a local disk the
    data is flushed first and the folder after (`durable`), so the rename survives a
    crash. The one rename of the package: writers use `atomic_path` around it."""
    local = _is_local(target) and _is_local(source)
    if durable and local:
        _fsync(source)
    _rename(source, target, overwrite)
    if durable and local:
        _fsync_one(os.path.dirname(os.path.abspath(target)), os.O_RDONLY)


@contextlib.contextmanager
def atomic_path(path: str, overwrite: bool = True, keep_suffix: bool = False,
                durable: bool = True, hidden: bool = False) -> Iterator[str]:
    """Yields a temp path beside `path` to write a file or a folder at; when the block
    ends without error it is renamed over `path` (see `move`), else removed.

    `overwrite=False`: a `path` that exists meanwhile raises `tf.errors.AlreadyExistsError`
    (or `FileExistsError`) and the temp is removed; the caller decides what that means. A
    local file is hard-linked into place, so another writer's file stands however late it
    came (the first record wins); a folder or a `gs://` object is checked, then renamed.
    `durable=False` skips the fsyncs (caches that may be lost); `keep_suffix`, `hidden`:
    see `temp_path`."""
    parent = os.path.dirname(path.rstrip("/"))
    if parent:
        gfile = _gfile(parent)
        gfile.makedirs(parent) if gfile is not None else os.makedirs(parent, exist_ok=True)
    temp = temp_path(path, keep_suffix=keep_suffix, hidden=hidden)
    try:
        yield temp
        move(temp, path.rstrip("/"), overwrite=overwrite, durable=durable)
    finally:
        _remove(temp)


def write_atomically(path: str, data: str | bytes, durable: bool = True) -> str:
    """Writes `data` (text, or bytes) to `path` whole: a reader, or a run after a kill,
    sees the old file or the new one. Any `tf.io.gfile` path (local, `gs://`). Returns
    `path`. For a writer that wants a path of its own (h5, SavedModel), `atomic_path`."""
    mode = "wb" if isinstance(data, bytes) else "w"
    with atomic_path(path, durable=durable) as temp:
        gfile = _gfile(temp)
        with (gfile.GFile(temp, mode) if gfile is not None
              else open(temp, mode, encoding=None if "b" in mode else "utf-8")) as f:
            f.write(data)
    return path
