"""Joining a multi-worker cluster (TF_CONFIG): fail clearly instead of hanging.

`read_tf_config` is the one reader of $TF_CONFIG: the strategy resolver and the
join watchdog both ask it, so a malformed value gives the same `TFConfigError`
whoever reads it first, instead of one reader raising and another ignoring it.

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
import dataclasses
import json
import os
import signal
import subprocess
import sys
from typing import Any, Callable, Iterator


JOIN_TIMEOUT_EXIT_CODE = 3
# The task types that train (and so count towards the cluster's size); an
# "evaluator" or "ps" task is not part of the all-reduce.
_TRAINING_TASKS = ("chief", "worker")


class TFConfigError(ValueError):
    """$TF_CONFIG is set but cannot describe this cluster; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """What $TF_CONFIG says: the training tasks and which one this process is.

    `tasks` lists `(type, index, address)` of every chief and worker, chief
    first; `task_type`/`task_index` are None when TF_CONFIG has no "task".
    """

    tasks: tuple[tuple[str, int, str], ...]
    task_type: str | None = None
    task_index: int | None = None

    @property
    def num_tasks(self) -> int:
        """Chief + worker tasks: the processes that train together."""
        return len(self.tasks)

    @property
    def this_task(self) -> tuple[str, int] | None:
        """(type, index) of this process, or None if TF_CONFIG does not say."""
        if self.task_type is None or self.task_index is None:
            return None
        return self.task_type, self.task_index

    def require_task(self) -> tuple[str, int]:
        """This process's task; TFConfigError if TF_CONFIG has none or names a
        chief/worker the cluster does not list (multi-worker training needs it)."""
        me = self.this_task
        if me is None:
            raise TFConfigError(
                "TF_CONFIG has a cluster but no task: add "
                '"task": {"type": "worker", "index": N} for this process.')
        count = sum(kind == me[0] for kind, _, _ in self.tasks)
        if me[0] in _TRAINING_TASKS and not 0 <= me[1] < count:
            raise TFConfigError(
                f"TF_CONFIG's task is {me[0]} {me[1]}, but its cluster lists {count} "
                f"{me[0]} task(s): use an index in [0, {count})")
        return me


def read_tf_config(raw: str | None = None) -> ClusterSpec | None:
    """$TF_CONFIG (or `raw`) parsed, or None if it is unset or empty.

    Raises `TFConfigError` naming the fix if it is not a JSON object with a
    cluster of address lists and, if given, a task with a type and an int index.
    """
    if raw is None:
        raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TFConfigError(f"TF_CONFIG is not valid JSON ({e}): fix or unset it.") from e
    if not isinstance(config, dict):
        raise TFConfigError("TF_CONFIG must be a JSON object with 'cluster' and 'task'.")
    return ClusterSpec(_training_tasks(config.get("cluster") or {}), *_task(config))


def _training_tasks(cluster: Any) -> tuple[tuple[str, int, str], ...]:
    """(type, index, address) of the chief and workers of TF_CONFIG's "cluster"."""
    if not isinstance(cluster, dict):
        raise TFConfigError("TF_CONFIG's cluster must be a JSON object such as "
                            f'{{"worker": ["host:port", ...]}}, got {cluster!r}')
    tasks = []
    for kind in _TRAINING_TASKS:
        addresses = cluster.get(kind) or []
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise TFConfigError(f'TF_CONFIG\'s cluster "{kind}" must be a list of '
                                f'"host:port" addresses, got {addresses!r}')
        tasks.extend((kind, index, address) for index, address in enumerate(addresses))
    return tuple(tasks)


def _task(config: dict) -> tuple[str | None, int | None]:
    """(type, index) of TF_CONFIG's "task", or (None, None) if it lacks either."""
    task = config.get("task") or {}
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        return None, None
    index = task["index"]
    if isinstance(index, bool) or not isinstance(index, int):
        raise TFConfigError(f"TF_CONFIG's task index must be an int, got {index!r}")
    return str(task["type"]), index


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


@contextlib.contextmanager
def join_watchdog(timeout: float = 300.0) -> Iterator[None]:
    """Ends the process with `JOIN_TIMEOUT_EXIT_CODE` and a message naming the missing
    tasks if the body (building the strategy) outlasts `timeout` seconds in a
    multi-task TF_CONFIG cluster; a no-op otherwise.

    A watchdog subprocess does the waiting (see `_WATCHDOG`); the body closing its
    stdin pipe tells it the cluster formed.
    """
    spec = read_tf_config()  # a malformed TF_CONFIG fails here, as it would in the resolver
    if spec is None or spec.num_tasks < 2:
        yield
        return
    me = spec.this_task
    names = ",".join(f"{kind} {index}={address}" for kind, index, address in spec.tasks)
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
