"""Where a process's start-up began, as far as tputrain can vouch for it: its import.

The process's own start (`/proc/<pid>/stat`, else `psutil`) is when its PID was
made, which is not when Python started: `sh -c 'pip install ... && exec tputrain
...'` (the usual Vertex, Kubernetes and Docker command) runs the install in the
process that then becomes Python, so its start time holds the install. Goodput's
start-up therefore counts from the moment `tputrain` was imported (this module is
its first import; it imports no TensorFlow), and reports the time before it apart:
the interpreter, the modules imported before tputrain and whatever ran in the
process before it exec'd Python. Import tputrain first and TensorFlow's import is
start-up.
"""

from __future__ import annotations

import os
import time
from typing import Any

IMPORTED_AT = time.time()  # epoch seconds at tputrain's import
IMPORTED_PERF = time.perf_counter()  # the same moment on the monotonic clock
SOURCE = "import of tputrain"


def process_start_time(pid: int | None = None) -> tuple[float, str]:
    """The process's start (epoch seconds) and where it came from: /proc, psutil or
    the import of tputrain."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])  # field 22: starttime
        # The boot clock to the nanosecond (/proc/uptime rounds to 10 ms, which put the
        # start after a shell's first command); the ticks are floored, so the start
        # read is never later than the true one.
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK")), "/proc"
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME
        pass
    try:
        import psutil  # optional: /proc is read first anyway
        return psutil.Process(pid).create_time(), "psutil"
    except Exception:  # pylint: disable=broad-except  (no psutil, or its psutil.Error)
        return IMPORTED_AT, SOURCE


def vouched() -> dict[str, Any]:
    """This process's start-up origin: `start` (epoch seconds of tputrain's import)
    and its `source`; `process_start` (the PID's start) and `before`, the seconds
    between the two, which goodput reports apart and does not count."""
    process_start, source = process_start_time()
    return {"start": IMPORTED_AT, "source": SOURCE, "process_start": process_start,
            "process_start_source": source, "before": max(0.0, IMPORTED_AT - process_start)}
