"""A SIGTERM in the first seconds of a command: held from its first line, acted on later.

The CLI's answer to a preemption (`ExitOnSignal`: one line and exit 42; the
launcher's forwarding to its workers) is installed once the command's module and
TensorFlow are imported, seconds after the process started. A SIGTERM before that
killed the process (-15, 143 in a shell), which a scheduler reads as a crash, not
as a preemption to rerun. So the CLI's entry calls `hold_early_signals()` before any
heavy import: a handler that only records the signal. The handler that takes over
calls `take_early_signal()` and acts on the held signal as if it had just come
(`SignalWatcher.install` does). Imports no TensorFlow.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable, Sequence

Handler = Callable[[int, Any], Any] | int | None

# The exit code of a preempted run (TF's own for a preemption): here, without
# TensorFlow, so the launcher that only forwards signals imports none.
PREEMPTED_EXIT_CODE = 42

_held: list[int] = []  # the signals received while holding, in order
_replaced: dict[int, Handler] = {}  # signal -> the handler the holder replaced
_taken = [False]


def hold_early_signals(signals: Sequence[int] = (signal.SIGTERM,)) -> None:
    """Records `signals` instead of acting on them, until `take_early_signal()`.
    Main thread only (Python's rule for signal handlers)."""
    _held.clear()
    _taken[0] = False
    for signum in signals:
        _replaced[signum] = signal.signal(signum, _hold)


def _hold(signum: int, frame: Any) -> None:
    if not _taken[0]:
        _held.append(signum)
        return
    # Taken, and yet this handler is back (someone restored it): act as the handler
    # it replaced would have, rather than swallow the signal.
    original = _replaced.get(signum, signal.SIG_DFL)
    signal.signal(signum, original)
    if callable(original):
        original(signum, frame)
    elif original != signal.SIG_IGN:
        os.kill(os.getpid(), signum)


def take_early_signal(replaced: dict[int, Handler] | None = None) -> int | None:
    """The first signal held (None if none came or nothing was held); holding ends.

    `replaced`: what the caller's new handlers replaced (signal -> handler, as
    `signal.signal` returned them); an entry that is the holder becomes the handler
    the holder had replaced, so that restoring it later does not bring back a holder.
    """
    if replaced:
        for signum, handler in replaced.items():
            if handler is _hold:
                replaced[signum] = _replaced.get(signum, signal.SIG_DFL)
    if _taken[0]:
        return None
    _taken[0] = True
    return _held[0] if _held else None
