"""N local worker processes as one MultiWorkerMirroredStrategy cluster.

`Launcher` starts N `python -m tputrain.run` processes on this machine, each
with a TF_CONFIG (`tf_configs`) that puts them in one cluster on free
127.0.0.1 ports, relays their output prefixed with `[worker i]`, forwards
signals and decides the exit code. `watch_launcher` is the worker's side: a
worker whose launcher died stops like a preempted one. `tputrain launch`
(tputrain/cli/launch.py) is the command.

Note: TF's gRPC servers listen on all interfaces, not only 127.0.0.1; on a
shared network run the launcher inside a private network namespace (e.g.
`unshare -rn`, then bring up `lo`) or behind a firewall.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from tputrain.fault_tolerance.preemption_early import PREEMPTED_EXIT_CODE

_GRACE_S = 10.0  # between SIGTERM and SIGKILL when stopping a worker
# A worker reads this inherited pipe fd; EOF means the launcher died (even by kill -9).
LAUNCHER_FD_ENV = "TPUTRAIN_LAUNCHER_FD"
_ORPHAN_GRACE_S = 60.0  # an orphaned worker saves and exits 42 within this, or is ended


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports the OS says are free now (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tf_configs(num_workers: int, host: str = "127.0.0.1") -> list[str]:
    """TF_CONFIG of each worker; worker 0 is the chief (MultiWorkerMirrored's rule)."""
    addresses = [f"{host}:{port}" for port in free_ports(num_workers, host)]
    return [json.dumps({"cluster": {"worker": addresses},
                        "task": {"type": "worker", "index": index}})
            for index in range(num_workers)]


def _pump(stream: IO[str], prefix: str, out: IO[str]) -> None:
    for line in stream:
        out.write(prefix + line)
        out.flush()


class Launcher:
    """Starts the workers, relays their output, and decides the exit code."""

    def __init__(self, num_workers: int, run_args: Sequence[str],
                 peer_exit_timeout: float = 60.0, python: str = sys.executable):
        if num_workers < 1:
            raise ValueError(f"--workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.run_args = list(run_args)
        self.peer_exit_timeout = peer_exit_timeout
        self.python = python
        self.processes: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        self.forwarded: int | None = None  # the signal `forward` sends
        self.received: int | None = None  # the signal the launcher got (SIGTERM, SIGINT)
        self.preempting: set[int] = set()  # a worker that dies by one of these was preempted

    def start(self) -> None:
        # The write end stays here, never written: when this process dies, however it
        # dies, the workers read EOF and stop (`watch_launcher`).
        read_fd, self._lifeline = os.pipe()
        for index, config in enumerate(tf_configs(self.num_workers)):
            env = dict(os.environ, TF_CONFIG=config, **{LAUNCHER_FD_ENV: str(read_fd)})
            process = subprocess.Popen(
                [self.python, "-m", "tputrain.run", *self.run_args], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                pass_fds=(read_fd,))
            self.processes.append(process)
            if self.forwarded is not None:  # the launcher was signalled while starting
                process.send_signal(self.forwarded)
            for stream, out in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
                thread = threading.Thread(target=_pump, args=(stream, f"[worker {index}] ", out),
                                          daemon=True)
                thread.start()
                self._threads.append(thread)
        os.close(read_fd)
        _log(f"started {self.num_workers} worker(s): " + ", ".join(
            f"worker {i} pid {p.pid}" for i, p in enumerate(self.processes)))

    def forward(self, signum: int, received: int | None = None) -> None:
        """Sends `signum` to every running worker (preemption: they save and exit 42) and
        to any started after. `received`: the signal the launcher got (a terminal's
        Ctrl-C reaches the workers too). A worker that dies by either of them had no
        handler yet (still starting): preempted like the others, not failed."""
        self.forwarded, self.received = signum, received or signum
        self.preempting.update({signum, self.received})
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signum)

    def wait(self) -> int:
        """Waits for all workers; stops stragglers after a failure; returns the exit code."""
        failed_at: float | None = None
        first_failure: tuple[int, int] | None = None
        stopping = False
        while True:
            codes = [p.poll() for p in self.processes]
            for index, code in enumerate(codes):
                if code not in (None, 0) and first_failure is None:
                    first_failure = (index, code)
                    failed_at = time.monotonic()
                    _log(f"worker {index} exited with {_describe(code)}; waiting up to "
                         f"{self.peer_exit_timeout:g} s for the others to stop")
            if all(code is not None for code in codes):
                break
            if (failed_at is not None and not stopping
                    and time.monotonic() - failed_at > self.peer_exit_timeout):
                stopping = True
                running = [i for i, c in enumerate(codes) if c is None]
                _log(f"stopping worker(s) {running}: still running "
                     f"{self.peer_exit_timeout:g} s after worker {first_failure[0]} failed")
                threading.Thread(target=self._stop, args=(running,), daemon=True).start()
            time.sleep(0.1)
        for thread in self._threads:
            thread.join(timeout=5)
        _log("workers exited with " + ", ".join(
            f"worker {i}: {_describe(p.returncode)}" for i, p in enumerate(self.processes)))
        codes = [self._outcome(p.returncode) for p in self.processes]
        if first_failure is not None:
            first_failure = (first_failure[0], self._outcome(first_failure[1]))
        if all(code == 0 for code in codes):
            return 0
        if all(code == PREEMPTED_EXIT_CODE for code in codes):
            return PREEMPTED_EXIT_CODE
        index, code = first_failure or next((i, c) for i, c in enumerate(codes) if c != 0)
        return code if code > 0 else 1

    def _outcome(self, code: int) -> int:
        """A worker's exit code, 42 for a death by a signal the launcher was sent and
        forwarded (`forward`); any other signal stays a failure."""
        return PREEMPTED_EXIT_CODE if code < 0 and -code in self.preempting else code

    def _stop(self, indices: list[int]) -> None:
        for index in indices:
            self.processes[index].terminate()
        deadline = time.monotonic() + _GRACE_S
        for index in indices:
            try:
                self.processes[index].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.processes[index].kill()


def watch_launcher() -> None:
    """In a worker started by `tputrain launch`: if the launcher dies, stop.

    A thread blocks on the launcher's pipe; EOF (the launcher is gone, even after
    kill -9) sends this process SIGTERM, so it checkpoints and exits 42 like a
    preemption; if it is still alive `_ORPHAN_GRACE_S` later (e.g. its peers are
    gone mid-collective) it exits 1. No-op outside the launcher.
    """
    fd = os.environ.pop(LAUNCHER_FD_ENV, None)
    if fd is None:
        return

    def watch() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        try:  # stderr was a pipe to the launcher: writing to it may fail now
            print("tputrain: the launcher is gone; stopping this worker", file=sys.stderr,
                  flush=True)
        except OSError:
            pass
        time.sleep(_ORPHAN_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="tputrain-launcher-watch", daemon=True).start()


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def _log(message: str) -> None:
    print(f"tputrain launch: {message}", file=sys.stderr, flush=True)
