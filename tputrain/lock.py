"""One run per model_dir: an exclusive lock held by the process that writes it.

Two runs on one model_dir would interleave their checkpoints and rotate each
other's away, both exiting 0. The chief takes `model_dir/.tputrain.lock` with
`fcntl.flock` before it writes anything and holds it until the process ends.
The kernel drops a flock when its holder dies, even by kill -9, so a stale lock
never needs cleaning up. The file names the holder (pid, host, command, start
time) so a refused run can say who has the directory.

Re-entrant within a process: a notebook (or a test) that builds a second
Trainer on the same model_dir keeps the lock it has. Remote paths (gs://,
ram://) cannot be flocked: a warning says the directory is not protected.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from typing import IO

from absl import logging

LOCK_FILE = ".tputrain.lock"
_HELD: dict[str, IO[str]] = {}  # real path of model_dir -> open lock file


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
    if key in _HELD:
        return
    os.makedirs(key, exist_ok=True)
    handle = open(os.path.join(key, LOCK_FILE), "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read()
        handle.close()
        raise ModelDirInUseError(_in_use_message(model_dir, holder)) from None
    handle.seek(0)
    handle.truncate()
    json.dump({"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, handle)
    handle.flush()
    _HELD[key] = handle


def release_model_dir(model_dir: str) -> None:
    """Gives the lock up before the process ends (the process exit does it anyway)."""
    handle = _HELD.pop(os.path.realpath(model_dir), None)
    if handle is not None:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _in_use_message(model_dir: str, holder: str) -> str:
    try:
        info = json.loads(holder)
        who = (f"pid {info['pid']} on host {info['host']} ({info['command']}), started "
               f"{info['started']}")
    except (ValueError, KeyError, TypeError):
        who = "another process"
    return (f"model_dir {model_dir} is in use by {who}: wait for it to finish, stop it, or "
            "choose another --model_dir")
