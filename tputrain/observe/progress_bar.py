"""A live progress bar where a person watches: a terminal or a Jupyter notebook.

Between two loop lines (`Trainer.steps_per_loop` steps, minutes on a large model)
the console would show nothing; on a terminal (stderr a TTY) and in a Jupyter
kernel the chief shows a bar (tqdm) with the step, the rate and the ETA, redrawn
in place while the compiled loop runs, and prints the loop lines above it. A
thread reads the step counter (`ActionContext.step_variable`) twice a
second: nothing is added to the compiled step. Where the step is one XLA program
of several steps, the counter moves once a program; on a TPU the read waits for
the running program.

Files, pipes, Cloud Logging and CI (`$CI` set, or `TERM=dumb`) get the plain lines
only. `Trainer.progress_bar`: "auto" (the default: as above), "on" (always, e.g. a
terminal the check cannot see) or "off"; the CLI's `--progress_bar` sets it.
"""

from __future__ import annotations

import io
import logging as pylogging
import os
import sys
import threading
from typing import Any, Mapping, TextIO

from tputrain.actions.base import Action
from tputrain.runtime.context import ActionContext

SETTINGS = ("auto", "on", "off")
POLL_SECONDS = 0.5  # how often the thread reads the step counter and may redraw
DEFAULT_SIZE = (100, 24)  # columns, lines where the terminal reports no size
BAR_FORMAT = ("step {n_fmt}/{total_fmt} |{bar}| {percentage:3.0f}% "
              "[{elapsed}<{remaining}, {rate_fmt}]{postfix}")


def check_setting(value: Any) -> str:
    """The setting, or a ValueError naming the choices."""
    if value not in SETTINGS:
        raise ValueError(f"Trainer.progress_bar must be 'auto', 'on' or 'off', got {value!r}")
    return value


def in_jupyter() -> bool:
    """Whether this process is a Jupyter kernel (IPython's kernel app is configured)."""
    if "IPython" not in sys.modules:
        return False
    try:
        shell = sys.modules["IPython"].get_ipython()
    except AttributeError:
        return False
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def wanted(setting: str, stream: TextIO) -> bool:
    """Whether `setting` shows a bar on `stream`: "auto" on a terminal (not under CI,
    not `TERM=dumb`) or in a Jupyter kernel."""
    if setting != "auto":
        return setting == "on"
    if in_jupyter():
        return True
    if os.environ.get("CI") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream
        return False


class _AboveBar(io.TextIOBase):
    """A stream while the bar shows (sys.stderr, sys.stdout and the logging handlers'):
    each complete line clears the bar, goes to the real stream, and the bar is drawn
    again under it."""

    def __init__(self, stream: TextIO, bar_stream: TextIO):
        super().__init__()
        self.stream, self._bar_stream, self._pending = stream, bar_stream, ""

    def write(self, text: str) -> int:
        from tqdm import tqdm

        lines, newline, self._pending = (self._pending + text).rpartition("\n")
        if newline:
            with tqdm.external_write_mode(file=self._bar_stream):
                self.stream.write(lines + newline)
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self.write("\n")
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


def _redirect(bar_stream: TextIO) -> list[tuple[Any, str, Any]]:
    """Points sys.stderr, sys.stdout (where it is a terminal or a notebook's) and the
    logging handlers printing to them at `_AboveBar` proxies; returns what to restore:
    (owner, attribute, original)."""
    from absl import logging as absl_logging

    swapped: list[tuple[Any, str, Any]] = []
    proxies = {}
    for name in ("stderr", "stdout"):
        original = getattr(sys, name)
        if original is bar_stream or wanted("auto", original):
            proxies[id(original)] = _AboveBar(original, bar_stream)
    handlers = [*pylogging.getLogger("absl").handlers, *pylogging.getLogger().handlers,
                getattr(absl_logging.get_absl_handler(), "python_handler", None)]
    for handler in dict.fromkeys(handlers):
        stream = getattr(handler, "stream", None)
        if isinstance(handler, pylogging.StreamHandler) and id(stream) in proxies:
            swapped.append((handler, "stream", stream))
            handler.setStream(proxies[id(stream)])
    for name in ("stderr", "stdout"):
        original = getattr(sys, name)
        if id(original) in proxies:
            swapped.append((sys, name, original))
            setattr(sys, name, proxies[id(original)])
    return swapped


def _restore(swapped: list[tuple[Any, str, Any]]) -> None:
    """Gives back what `_redirect` swapped (unless someone replaced it meanwhile)."""
    for owner, attribute, original in reversed(swapped):
        current = getattr(owner, attribute)
        if isinstance(current, _AboveBar):
            current.flush()
            if isinstance(owner, pylogging.StreamHandler):
                owner.setStream(original)
            else:
                setattr(owner, attribute, original)


def _size(stream: TextIO) -> tuple[int, int]:
    """The terminal's (columns, lines), $COLUMNS and $LINES first; a terminal that
    reports none (a pty without a size, a notebook; tqdm would draw nothing there)
    gets DEFAULT_SIZE."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        size = os.terminal_size((0, 0))
    return (int(os.environ.get("COLUMNS", 0) or 0) or size.columns or DEFAULT_SIZE[0],
            int(os.environ.get("LINES", 0) or 0) or size.lines or DEFAULT_SIZE[1])


class LiveBar:
    """The bar of one `train()`: started at `step` of `total`, moved by a thread that
    reads `read_step`, and set exactly at each loop's end; `close` ends both."""

    def __init__(self, step: int, total: int, read_step, stream: TextIO):
        from tqdm import tqdm

        self._read_step, self._stop = read_step, threading.Event()
        columns, lines = _size(stream)
        self.bar = tqdm(total=total, initial=step, file=stream, unit="step", ncols=columns,
                        nrows=lines, bar_format=BAR_FORMAT, leave=False,
                        mininterval=POLL_SECONDS, smoothing=0.1)
        self._swapped = _redirect(stream)
        self._thread = threading.Thread(target=self._poll, name="tputrain-progress-bar",
                                        daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self.move_to(int(self._read_step()))
            except Exception:  # pylint: disable=broad-except  (a display; training goes on)
                return

    def move_to(self, step: int, postfix: str | None = None) -> None:
        """Shows `step` (and the loop's `postfix`, e.g. its loss)."""
        if postfix is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        """Stops the thread, gives the handlers their streams back, removes the bar."""
        self._stop.set()
        self._thread.join(timeout=5)
        _restore(self._swapped)
        self.bar.close()


class ProgressBarAction(Action):
    """Built in (the chief's): a `LiveBar` for each `train()` where `wanted` says so."""

    def __init__(self) -> None:
        self.live: LiveBar | None = None

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        setting = getattr(context.options, "progress_bar", "auto")
        if context.is_chief and self.live is None and wanted(setting, sys.stderr):
            variable = context.step_variable
            self.live = LiveBar(step, context.progress.train_steps, variable.numpy, sys.stderr)
            context.progress.on_close(self.close)

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if self.live is not None:
            loss = logs.get("loss")
            self.live.move_to(step, None if loss is None else f" loss {float(loss):.4g}")

    def on_train_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        self.close()

    def close(self) -> None:
        """Ends the bar (at the end of training, or in `Progress.close` after an error)."""
        live, self.live = self.live, None
        if live is not None:
            live.close()
