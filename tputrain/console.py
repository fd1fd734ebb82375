"""Progress on the console from Python, as the CLI shows it.

tputrain logs through absl. The CLI (absl `app.run`) prints INFO lines; a plain
Python script would print nothing, because Python's logging drops INFO by
default. `show_progress()` (called by every `Trainer`) then prints tputrain's
own lines, without absl's prefixes, and every warning, on stderr. It stays out
of the way when absl's CLI logging is on or when the program configured Python
logging itself (a root handler exists).
"""

from __future__ import annotations

import logging as pylogging
import sys

from absl import flags

_handler: pylogging.Handler | None = None
_quiet = False


class _ProgressFilter(pylogging.Filter):
    def filter(self, record: pylogging.LogRecord) -> bool:
        if record.levelno >= pylogging.WARNING:
            return True
        return record.levelno >= pylogging.INFO and str(record.msg).startswith("tputrain:")


class _Formatter(pylogging.Formatter):
    def format(self, record: pylogging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= pylogging.WARNING and not message.startswith("tputrain:"):
            return f"{record.levelname}: {message}"
        return message


def show_progress(enabled: bool = True) -> None:
    """Prints tputrain's progress lines on stderr in a plain Python program.

    `show_progress(False)` silences them (warnings still show); Trainers created
    afterwards do not turn them back on.
    """
    global _handler, _quiet
    _quiet = not enabled
    absl_logger = pylogging.getLogger("absl")
    if not enabled:
        if _handler is not None:
            absl_logger.removeHandler(_handler)
            absl_logger.propagate = True
            _handler = None
        return
    if _handler is not None or flags.FLAGS.is_parsed() or pylogging.getLogger().handlers:
        return
    _handler = pylogging.StreamHandler(sys.stderr)
    _handler.addFilter(_ProgressFilter())
    _handler.setFormatter(_Formatter())
    absl_logger.addHandler(_handler)
    # Ours alone: a root handler that a library adds later would print each line twice.
    absl_logger.propagate = False
    if absl_logger.getEffectiveLevel() > pylogging.INFO:
        absl_logger.setLevel(pylogging.INFO)


def default_progress() -> None:
    """The Trainer's call: progress on unless the user silenced it."""
    if not _quiet:
        show_progress(True)
