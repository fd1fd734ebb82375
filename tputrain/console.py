"""Progress on the console from Python, as the CLI shows it.

tputrain logs through absl. The CLI (absl `app.run`) prints INFO lines; a plain
Python script would print nothing, because Python's logging drops INFO by
default. `show_progress()` (called by every `Trainer`) then prints tputrain's
own lines, without absl's prefixes, and every warning, on stderr. It stays out
of the way when absl's CLI logging is on or when the program configured Python
logging itself (a root handler exists).
"""

from __future__ import annotations

import contextlib
import logging as pylogging
import os
import sys
import tempfile
from typing import Iterator

from absl import flags

# TensorFlow's start-up lines that say nothing to a tputrain user (each printed once
# per TF import, some twice). The cuInit error is dropped only when TF also said it
# found no CUDA driver at all: on a GPU machine with a broken driver it is kept.
_STARTUP_NOISE = ("All log messages before absl::InitializeLog()", "cpu_feature_guard.cc",
                  "To enable the following instructions", "Could not find cuda drivers")
_NO_DRIVER = "Could not find cuda drivers"
_CUINIT = "failed call to cuInit"

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


def _filter_startup(text: str) -> str:
    """The captured start-up output minus the noise; a repeated line is kept once."""
    no_driver = _NO_DRIVER in text
    kept, seen = [], set()
    for line in text.splitlines(keepends=True):
        body = line.split("] ", 1)[-1]  # without the timestamp/thread prefix
        if any(noise in line for noise in _STARTUP_NOISE) or (no_driver and _CUINIT in line):
            continue
        if body in seen:
            continue
        seen.add(body)
        kept.append(line)
    return "".join(kept)


@contextlib.contextmanager
def native_noise_filtered() -> Iterator[None]:
    """Captures the process's stderr (fd 2, where TF's C++ code writes) while TF
    imports and finds its devices, then writes back everything but the noise."""
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 to capture
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as capture:
        sys.stderr.flush()
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = _filter_startup(capture.read().decode("utf-8", "replace"))
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()


class _DropSavingChatter(pylogging.Filter):
    """TF logs 'Sharding callback duration: N microseconds' at INFO after each save."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        return not str(record.msg).startswith("Sharding callback duration")


def quiet_tensorflow_startup() -> None:
    """Imports TensorFlow and finds its devices with the start-up noise filtered, and
    drops TF's per-save chatter. Called once when tputrain is imported."""
    with native_noise_filtered():
        import tensorflow as tf  # noqa: F401  (the import is what prints)

        tf.config.list_physical_devices()
    pylogging.getLogger("tensorflow").addFilter(_DropSavingChatter())

