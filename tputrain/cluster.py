"""Joining a multi-worker cluster (TF_CONFIG): fail clearly instead of hanging.

`MultiWorkerMirroredStrategy()` blocks, silently and without a deadline, until
every task in TF_CONFIG has started. `join_watchdog` bounds that wait: if the
strategy is not built within `timeout` seconds it names the tasks that are not
reachable, and exits the process (a C++ call cannot be interrupted otherwise).
Once the cluster is up, a worker that dies makes the others' collectives fail,
so they exit non-zero rather than hang (see docs/fault_tolerance.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from typing import Iterator

import gin
from absl import logging

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


def unreachable_tasks(timeout: float = 1.0) -> list[str]:
    """Other tasks whose address does not accept a TCP connection right now."""
    me = this_task()
    missing = []
    for kind, index, address in cluster_tasks():
        if me == (kind, index):
            continue
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                pass
        except (OSError, ValueError):
            missing.append(f"{kind} {index} ({address})")
    return missing


@gin.configurable
@contextlib.contextmanager
def join_watchdog(timeout: float = 300.0) -> Iterator[None]:
    """Exits with `JOIN_TIMEOUT_EXIT_CODE` if the body (building the strategy) outlasts
    `timeout` seconds in a multi-task TF_CONFIG cluster; a no-op otherwise."""
    if len(cluster_tasks()) < 2:
        yield
        return
    done = threading.Event()

    def watch():
        if done.wait(timeout):
            return
        missing = unreachable_tasks()
        if missing:
            problem = (f"{', '.join(missing)} did not join within {timeout:g} s: start "
                       "every task with the same TF_CONFIG cluster and its own task index, "
                       "check the addresses and firewalls")
        else:
            problem = (f"every task answers, but the cluster did not form within {timeout:g} s: "
                       "check that all tasks use the same TF_CONFIG cluster")
        message = f"tputrain: error: {problem}, or raise join_watchdog.timeout"
        logging.error("%s", message)
        print(message, file=sys.stderr, flush=True)
        os._exit(JOIN_TIMEOUT_EXIT_CODE)  # the strategy's C++ wait cannot be interrupted

    thread = threading.Thread(target=watch, name="tputrain-join-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
