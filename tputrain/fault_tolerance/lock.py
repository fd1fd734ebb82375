"""One run per model_dir: an exclusive lock held by the process that writes it.

Two runs on one model_dir would interleave their checkpoints and rotate each
other's away, both exiting 0. The chief takes `model_dir/.tputrain.lock` with
`fcntl.flock` after pre-flight (which only reads and writes probe files) and
before its first checkpoint, summary or config, and holds it until it ends.
The kernel drops a flock when its holder dies, even by kill -9, so a stale lock
never needs cleaning up. The file names the holder (pid, host, command, start
time) so a refused run can say who has the directory.

Re-entrant within a process: a notebook (or a test) that builds a second
Trainer on the same model_dir keeps the lock it has. Remote paths (gs://,
ram://) cannot be flocked and a lease with heartbeats would still race on
object stores without preconditions, so they are not locked: a warning says so.
A local lock file that cannot be created (a model_dir that is not writable, or
a `.tputrain.lock` that is not a file) is not fatal here: a warning says the
directory is not locked, and pre-flight is what names an unusable model_dir.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
import time
from typing import IO

from absl import logging

from tputrain.checkpointing.run_directory import RunDirectory

LOCK_FILE = RunDirectory.LOCK
_HELD: dict[str, IO[str]] = {}  # real path of model_dir -> open, flocked lock file


class ModelDirInUseError(OSError):
    """Another process is training in this model_dir."""


def lock_model_dir(model_dir: str) -> None:
    """Takes (or keeps) this process's exclusive lock on `model_dir`.

    Raises `ModelDirInUseError` naming the process that holds it.
    """
    if "://" in model_dir:
        logging.warning("tputrain: %s is not a local path: it cannot be locked, so make sure "
                        "no other run writes to it", model_dir)
        return
    key = os.path.realpath(model_dir)
    if _still_held(key):
        return
    path = RunDirectory(key).lock
    try:
        os.makedirs(key, exist_ok=True)
        handle = open(path, "a+", encoding="utf-8")
    except OSError as error:  # unwritable, a file, ...: pre-flight names those
        logging.warning("tputrain: cannot create %s (%s): %s is not locked against a "
                        "second process", path, error, key)
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read()
        handle.close()
        raise ModelDirInUseError(_in_use_message(model_dir, holder)) from None
    _HELD[key] = handle
    _write_holder(handle)


def release_model_dir(model_dir: str) -> None:
    """Gives the lock up before the process ends (the process exit does it anyway)."""
    handle = _HELD.pop(os.path.realpath(model_dir), None)
    if handle is not None:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _still_held(key: str) -> bool:
    """Whether this process holds the lock on the file now at `key` (the directory may
    have been deleted and made again since: then that lock protects nothing)."""
    handle = _HELD.get(key)
    if handle is None:
        return False
    try:
        if os.stat(RunDirectory(key).lock).st_ino == os.fstat(handle.fileno()).st_ino:
            return True
    except OSError:
        pass
    release_model_dir(key)
    return False


def _write_holder(handle: IO[str]) -> None:
    """Names this process in the lock file, for the message a refused run prints."""
    holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    try:  # unbuffered: a failed write must not be retried when the file is closed
        os.ftruncate(handle.fileno(), 0)
        os.write(handle.fileno(), holder.encode("utf-8"))
    except OSError as error:  # e.g. a full disk: the lock holds, unnamed
        logging.warning("tputrain: could not name this process in %s: %s", handle.name, error)


def _in_use_message(model_dir: str, holder: str) -> str:
    try:
        info = json.loads(holder)
        who = (f"pid {info['pid']} on host {info['host']} ({info['command']}), started at "
               f"{info['started']}")
    except (ValueError, KeyError, TypeError):
        who = "another process (it has not named itself yet)"
    return (f"model_dir {model_dir} is in use by {who}: wait for it to finish, stop it, or "
            "choose another --model_dir")
