"""Joining a multi-worker cluster (TF_CONFIG): fail clearly instead of hanging.

`MultiWorkerMirroredStrategy()` blocks, silently and without a deadline, until
every task in TF_CONFIG has started, and holds the GIL while it waits (no Python
thread of the process runs). `join_watchdog` bounds that wait from a small
watchdog process: if the strategy is not built within `timeout` seconds it
names the tasks that are not reachable and ends the process with exit code 3.
Once the cluster is up, a worker that dies makes the others' collectives fail,
so they exit non-zero rather than hang (see docs/fault_tolerance.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
from typing import Callable, Iterator

import gin

JOIN_TIMEOUT_EXIT_CODE = 3


def cluster_tasks() -> list[tuple[str, int, str]]:
    """[(task type, index, address)] of every chief/worker in $TF_CONFIG ([] if unset)."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return []
    try:
        cluster = json.loads(raw).get("cluster") or {}
    except (json.JSONDecodeError, AttributeError):
        return []
    return [(kind, index, address) for kind in ("chief", "worker")
            for index, address in enumerate(cluster.get(kind, []))]


def this_task() -> tuple[str, int] | None:
    try:
        task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task") or {}
        return task["type"], int(task["index"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None


# Runs in a separate small Python process: the strategy's C++ wait holds the GIL,
# so no thread of the waiting process can run. argv: parent pid, timeout, message.
_WATCHDOG = r"""
import os, select, signal, socket, sys, time
parent, timeout, tasks, me = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
ready, _, _ = select.select([sys.stdin], [], [], timeout)
if ready:  # the parent closed the pipe: joined (or gone)
    sys.exit(0)
missing = []
for task in tasks.split(","):
    name, address = task.split("=")
    if name == me:
        continue
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
    except (OSError, ValueError):
        missing.append(f"{name} ({address})")
if missing:
    problem = (", ".join(missing) + f" did not join within {timeout:g} s: start every task "
               "with the same TF_CONFIG cluster and its own task index, check the addresses "
               "and firewalls")
else:
    problem = (f"every task answers, but the cluster did not form within {timeout:g} s: "
               "check that all tasks use the same TF_CONFIG cluster")
print(f"tputrain: error: {problem}, or raise join_watchdog.timeout", file=sys.stderr,
      flush=True)
os.kill(parent, signal.SIGQUIT)  # the parent turned SIGQUIT into _exit(3)
time.sleep(5)
try:
    os.kill(parent, signal.SIGKILL)
except OSError:
    pass
"""


def _exit_on_sigquit() -> Callable[[], None]:
    """Makes SIGQUIT call C `_exit(3)` (3 == SIGQUIT): no GIL needed, so it works while
    TF's C++ code holds it. Returns a function restoring the previous handler."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        previous = libc.signal(signal.SIGQUIT, ctypes.cast(libc._exit, ctypes.c_void_p))
    except (OSError, AttributeError):  # not glibc-like: the watchdog's SIGKILL follows
        return lambda: None
    return lambda: libc.signal(signal.SIGQUIT, previous)


@gin.configurable
@contextlib.contextmanager
def join_watchdog(timeout: float = 300.0) -> Iterator[None]:
    """Ends the process with `JOIN_TIMEOUT_EXIT_CODE` and a message naming the missing
    tasks if the body (building the strategy) outlasts `timeout` seconds in a
    multi-task TF_CONFIG cluster; a no-op otherwise.

    A watchdog subprocess does the waiting (see `_WATCHDOG`); the body closing its
    stdin pipe tells it the cluster formed.
    """
    tasks = cluster_tasks()
    if len(tasks) < 2:
        yield
        return
    me = this_task()
    names = ",".join(f"{kind} {index}={address}" for kind, index, address in tasks)
    restore = _exit_on_sigquit()
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(timeout), names,
         f"{me[0]} {me[1]}" if me else ""],
        stdin=subprocess.PIPE)
    try:
        yield
    finally:
        watchdog.stdin.close()
        watchdog.wait()
        restore()
