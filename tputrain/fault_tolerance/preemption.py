"""Preemption: on SIGTERM, stop at the next step boundary, checkpoint, exit 42.

Cloud TPU and GCE preemption, Kubernetes and Slurm all send SIGTERM and wait a
grace period before SIGKILL. `PreemptionWatcher` turns the signal into a flag
that the compiled train loop reads before every step, so the run stops after
the step in flight (not at the end of a `steps_per_loop` loop, which can be
minutes), the Trainer saves a checkpoint at that step and raises `Preempted`,
which exits the process with `PREEMPTED_EXIT_CODE` (42, the code TF's
`PreemptionCheckpointHandler` uses). Rerunning the same command resumes exactly.

Why not `tf.distribute.experimental.PreemptionCheckpointHandler`: it checks for
preemption only when its `run()` is called from Python, i.e. once per host
loop here; it probes the GCE metadata server at start (5 s off Google Cloud);
and it exits the process from inside `run()`. A Python signal handler alone is
not enough either: Python runs handlers only between bytecodes, and the main
thread sits in one compiled call for the whole loop. So the C-level handler's
wakeup byte (`signal.set_wakeup_fd`) wakes a watcher thread, which sets a
`tf.Variable` that the running loop reads.

Before training (the CLI builds the Trainer: inputs read, model compiled) there
is nothing to save, and the main thread may wait inside TensorFlow just as long
(a slow first read) or for ever (an input that never yields): `ExitOnSignal`,
the same watcher, exits 42 at once with one line. `tputrain run` installs it
first; `train()` puts its `PreemptionWatcher` over it and back. A SIGTERM before
even that (TensorFlow still importing) was held by the CLI's entry
(`preemption_early`) and is acted on when `ExitOnSignal` is installed.

Ctrl-C: `tputrain run` answers SIGINT as SIGTERM (`set_stop_signals`): the next
step boundary is saved and the run exits 42; a second Ctrl-C before that ends the
process at once (exit 130, as a kill would: every file tputrain writes is written
atomically, the last checkpoint stands). A script's `train()` keeps Python's
KeyboardInterrupt unless it calls `set_stop_signals` too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Sequence

import tensorflow as tf
from absl import logging

from tputrain.fault_tolerance.preemption_early import PREEMPTED_EXIT_CODE, take_early_signal


class Preempted(SystemExit):
    """Training stopped on a preemption signal after saving a checkpoint.

    A `SystemExit` with code 42: uncaught, the process exits 42 without a
    traceback (rerun the same command to resume); catch it to do otherwise.
    """

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return (f"preempted at step {self.step}; saved {self.checkpoint}; rerun the same "
                f"command to resume (exit code {PREEMPTED_EXIT_CODE})")


class SignalWatcher:
    """Calls `request(signum)` when one of `signals` arrives, even while the main
    thread waits inside TensorFlow (a compiled loop, an input read): the C-level
    handler's wakeup byte wakes a watcher thread, since Python runs its own handlers
    only between bytecodes of the main thread.

    `install()` it (main thread only: Python's rule for signal handlers) and
    `uninstall()` after, which restores the previous handlers and wakeup fd. A signal
    the CLI's entry held before any watcher existed (`preemption_early`) is acted on
    at install, as if it had just come.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)):
        self.signals = tuple(signals)
        self._previous: dict[int, object] = {}
        self._previous_wakeup_fd: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    def request(self, signum: int | None = None) -> None:
        """What a signal does (subclasses)."""
        raise NotImplementedError

    def install(self) -> bool:
        """Installs the handlers; returns False (and does nothing) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            logging.warning("tputrain: not on the main thread; SIGTERM will not trigger a "
                            "checkpoint (signal handlers can only be set from the main thread)")
            return False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._python_handler)
        early = take_early_signal(self._previous)  # (the holder is not restored after)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="tputrain-preemption",
                                        daemon=True)
        self._thread.start()
        if early in self.signals:
            self.request(early)
        return True

    def _python_handler(self, signum, frame) -> None:  # runs later, on the main thread
        del frame
        self.request(signum)

    def _watch(self) -> None:
        """Watcher thread: wakes on the C-level handler's byte, while the loop runs."""
        read_fd = self._pipe[0]
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:  # uninstall() closed the pipe
                return
            hits = [b for b in data if b in self.signals]
            if hits:
                self.delivered(hits)

    def delivered(self, signums: list[int]) -> None:
        """The signals the watcher thread woke on, one wakeup byte each (the Python
        handler asks again for each later: `request` is idempotent, a count is not)."""
        self.request(signums[0])

    def uninstall(self) -> None:
        """Restores the previous handlers and wakeup fd; stops the watcher thread."""
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup_fd if self._previous_wakeup_fd is not None
                             else -1)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        read_fd, write_fd = self._pipe
        os.close(write_fd)  # the watcher's read returns b""
        if self._thread is not None:
            self._thread.join(timeout=5)
        os.close(read_fd)
        self._pipe = None
        self._thread = None

    def __enter__(self) -> "SignalWatcher":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()


_stop_signals: tuple[int, ...] = (signal.SIGTERM,)
INTERRUPTED_EXIT_CODE = 130  # a second Ctrl-C: the shell's code for SIGINT


def set_stop_signals(*signals: int) -> None:
    """The signals a Trainer built from now on stops at a step boundary on (SIGTERM by
    default; `tputrain run` adds SIGINT, so Ctrl-C saves before it exits)."""
    global _stop_signals
    _stop_signals = tuple(signals)


def stop_signals() -> tuple[int, ...]:
    return _stop_signals


class PreemptionWatcher(SignalWatcher):
    """Sets `flag` (a host tf.Variable) when one of `signals` (`stop_signals()` by
    default) arrives; a second SIGINT ends the process at once.

    Create it before tracing the loop that reads `flag`; `install()` it while
    training and `uninstall()` after (`SignalWatcher`).
    """

    def __init__(self, signals: Sequence[int] | None = None):
        super().__init__(stop_signals() if signals is None else signals)
        # Outside any strategy scope: one host variable, read by the loop on the host.
        with tf.init_scope(), tf.device("/cpu:0"):
            self.flag = tf.Variable(False, trainable=False, name="tputrain_preempted")
        self._requested = threading.Event()
        self._interrupts = 0  # SIGINTs the watcher thread saw

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def request(self, signum: int | None = None) -> None:
        """Asks the loop to stop at the next step boundary (also callable directly)."""
        if not self._requested.is_set():
            name = signal.Signals(signum).name if signum else "a stop request"
            logging.warning("tputrain: received %s; stopping at the next step boundary to "
                            "save a checkpoint", name)
        self._requested.set()
        self.flag.assign(True)

    def delivered(self, signums: list[int]) -> None:
        """A second Ctrl-C ends the process at once, without saving."""
        self._interrupts += signums.count(signal.SIGINT)
        if self._interrupts >= 2:
            _exit_now("tputrain: a second Ctrl-C: stopping now, without saving; the last "
                      "checkpoint stands: rerun the same command to resume from it",
                      INTERRUPTED_EXIT_CODE)
        super().delivered(signums)


class ExitOnSignal(SignalWatcher):
    """Ends the process with `code` and one line when a signal arrives: for the phases
    with nothing to save (building the Trainer: reading the inputs, compiling), where
    the main thread may wait inside TensorFlow for as long as a read takes, or for
    ever (an input that never yields). The exit is immediate (`os._exit`, as a
    kill would be: every file tputrain writes is written atomically)."""

    def __init__(self, message: str, code: int = PREEMPTED_EXIT_CODE,
                 signals: Sequence[int] = (signal.SIGTERM,)):
        super().__init__(signals)
        self.message, self.code = message, code
        self._once = threading.Lock()

    def request(self, signum: int | None = None) -> None:
        """Prints the message (`{signum}` filled in) and exits; the first caller wins."""
        if not self._once.acquire(blocking=False):
            return
        _exit_now(self.message.format(signum=signum), self.code)


def _exit_now(message: str, code: int) -> None:
    """Flushes the streams, writes `message` to stderr and ends the process (`os._exit`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        os.write(2, (message + "\n").encode())
    finally:
        os._exit(code)
