"""Progress on the console from Python, as the CLI shows it.

tputrain logs through absl. The CLI (absl `app.run`) prints INFO lines; a plain
Python script would print nothing, because Python's logging drops INFO by
default. `show_progress()` (called by `resolve_strategy`, `set_precision_policy`
and every `Trainer`, whichever comes first) then prints tputrain's own lines,
without absl's prefixes, and every warning, on stderr. It stays out of the way
when absl's CLI logging is on or when the program configured Python logging
itself (`user_configured_logging`).

TensorFlow's start-up noise is filtered by an import hook that tputrain installs
when imported (`filter_tensorflow_startup`), so whoever imports TensorFlow first
afterwards gets the quiet start-up."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging as pylogging
import os
import re
import sys
import tempfile
from types import ModuleType
from typing import Iterator

from absl import flags
from absl import logging as absl_logging

# TensorFlow's start-up lines that say nothing to a tputrain user (each printed once
# per TF import, some twice). The cuInit error is dropped only when TF also said it
# found no CUDA driver at all: on a GPU machine with a broken driver it is kept.
_STARTUP_NOISE = ("All log messages before absl::InitializeLog()", "cpu_feature_guard.cc",
                  "To enable the following instructions", "Could not find cuda drivers")
_NO_DRIVER = "Could not find cuda drivers"
_CUINIT = "failed call to cuInit"

_handler: pylogging.Handler | None = None
_quiet = False
# TensorFlow was imported before tputrain: its start-up lines were out of reach. The first
# tputrain line says so, once, with the fix.
_tensorflow_first = False
_TENSORFLOW_FIRST = ("tputrain: TensorFlow was imported before tputrain, so its start-up lines "
                     "above were not filtered: import tputrain before TensorFlow and Keras to "
                     "silence them")


def _message(record: pylogging.LogRecord) -> str:
    try:
        return record.getMessage()
    except (TypeError, ValueError):  # a malformed call: logging reports it itself
        return str(record.msg)


class _ProgressFilter(pylogging.Filter):
    """tputrain's own INFO lines (by their text, `logging.info("%s", line)` too)
    and every warning."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        if record.levelno >= pylogging.WARNING:
            return True
        return record.levelno >= pylogging.INFO and _message(record).startswith("tputrain:")


class _Formatter(pylogging.Formatter):
    def format(self, record: pylogging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= pylogging.WARNING and not message.startswith("tputrain:"):
            return f"{record.levelname}: {message}"
        return message


def _is_default_stderr_handler(handler: pylogging.Handler) -> bool:
    """What a bare `logging.basicConfig()` adds, as absl's first log call does by itself."""
    fmt = getattr(handler.formatter, "_fmt", None)  # the format string it was given
    return (type(handler) is pylogging.StreamHandler  # pylint: disable=unidiomatic-typecheck
            and handler.stream is sys.stderr and fmt == pylogging.BASIC_FORMAT)


def user_configured_logging() -> bool:
    """True when the program set up Python logging itself: a root handler other than
    absl's own and a bare `basicConfig()`'s, or a root level other than WARNING.
    absl (and TensorFlow through it) adds the latter on its first log call, so it
    says nothing about what the user wants."""
    root = pylogging.getLogger()
    own = [handler for handler in root.handlers if handler is not absl_logging.get_absl_handler()
           and not _is_default_stderr_handler(handler)]
    return bool(own) or (bool(root.handlers) and root.level != pylogging.WARNING)


def show_progress(enabled: bool = True) -> None:
    """Prints tputrain's progress lines on stderr in a plain Python program.

    `show_progress(False)` silences them (warnings still show); Trainers created
    afterwards do not turn them back on. An absl app (flags parsed) and a program
    that configured logging itself (`user_configured_logging`) keep their own
    output.
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
    if _handler is not None or flags.FLAGS.is_parsed() or user_configured_logging():
        return
    _handler = pylogging.StreamHandler(sys.stderr)
    _handler.addFilter(_ProgressFilter())
    _handler.setFormatter(_Formatter())
    absl_logger.addHandler(_handler)
    # Ours alone: the root handler absl adds on its first call would print each line twice.
    absl_logger.propagate = False
    if absl_logger.getEffectiveLevel() > pylogging.INFO:
        absl_logger.setLevel(pylogging.INFO)
    _tell_tensorflow_first()


def _tell_tensorflow_first() -> None:
    """Once, when TensorFlow was imported first (`filter_tensorflow_startup`)."""
    global _tensorflow_first
    if _tensorflow_first:
        _tensorflow_first = False
        absl_logging.info("%s", _TENSORFLOW_FIRST)


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


_TF_LINE = re.compile(r"^([IWE])\d{4} ")


def _at_log_level(text: str) -> str:
    """The captured lines minus TF's own below TF_CPP_MIN_LOG_LEVEL (1 drops INFO, 2
    WARNING too, 3 ERROR too), which TF's C++ code ignores for lines written before
    absl's log is initialised (the oneDNN notice on a CPU with AVX-512 bf16, say)."""
    try:
        level = int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        level = 0
    dropped = "IWE"[:max(0, level)]
    return "".join(line for line in text.splitlines(keepends=True)
                   if not ((match := _TF_LINE.match(line)) and match.group(1) in dropped))


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
            text = _at_log_level(_filter_startup(capture.read().decode("utf-8", "replace")))
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()


# TensorFlow's Python INFO lines that say nothing to a tputrain user: one per checkpoint
# save (absl), one per exported SavedModel, one per cross-device reduction or gather on
# 2+ replicas, one per all-reduce built and the set-up of each worker of a multi-worker
# job (tputrain's own line names the strategy, its devices and workers).
_LOG_NOISE = ("Sharding callback duration", "Writing fingerprint to", "Reduce to ", "Gather to ",
              "Collective all_reduce", "Collective batch_all_gather", "batch_all_reduce: ",
              "Check health not enabled", "Enabled multi-worker collective ops",
              "MultiWorkerMirroredStrategy with cluster_spec",
              "Single-worker MultiWorkerMirroredStrategy")


class _DropTensorFlowChatter(pylogging.Filter):
    def filter(self, record: pylogging.LogRecord) -> bool:
        return not (record.levelno < pylogging.WARNING
                    and _message(record).startswith(_LOG_NOISE))


def _quiet_tensorflow_logs(tf_logger: pylogging.Logger) -> None:
    """Drops the chatter above, and TensorFlow's own handler: it prints each of its lines
    a second time once the root has a handler (absl adds one on its first log call)."""
    for logger in (pylogging.getLogger("absl"), tf_logger):
        if not any(isinstance(f, _DropTensorFlowChatter) for f in logger.filters):
            logger.addFilter(_DropTensorFlowChatter())
    for handler in list(tf_logger.handlers):
        if type(handler) is pylogging.StreamHandler:  # pylint: disable=unidiomatic-typecheck
            tf_logger.removeHandler(handler)


class _FilteredLoader(importlib.abc.Loader):
    """TensorFlow's own loader, run with the start-up noise filtered (see below)."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        with native_noise_filtered():
            self.loader.exec_module(module)
            module.config.list_physical_devices()  # the device search prints, too
        _quiet_tensorflow_logs(module.get_logger())


class _FilteredImport(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` the usual way, once, and hands it `_FilteredLoader`."""

    def find_spec(self, fullname: str, path, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "tensorflow":
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _FilteredImport)]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _FilteredLoader(spec.loader)
        return spec


def filter_tensorflow_startup() -> None:
    """Whoever imports TensorFlow first (tputrain, Keras, the user), it imports and finds
    its devices with the start-up noise filtered. Called when tputrain is imported;
    when TensorFlow already was, the lines its import printed are out of reach: only
    its device search (cuInit) and Python log lines are filtered."""
    global _tensorflow_first
    tf = sys.modules.get("tensorflow")
    if tf is not None and hasattr(tf, "get_logger"):
        _tensorflow_first = True
        with native_noise_filtered():  # the device search prints, if it has not run yet
            tf.config.list_physical_devices()
        _quiet_tensorflow_logs(tf.get_logger())
    elif not any(isinstance(f, _FilteredImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _FilteredImport())


# The filter process of `native_lines_dropped`: copies its stdin to its stdout as it
# comes, less the whole lines that match the pattern in argv[1]; a partial line goes
# through at once unless it may be a TF log line (a live bar's `\r` updates have none).
# It ignores the terminal's and a launcher's signals: it ends when the pipe closes.
_FILTER = r"""
import os, re, signal, sys
for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGPIPE"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
drop, held = re.compile(sys.argv[1].encode()), re.compile(rb"[IWEF](\d{0,4}( |$))?$|[IWEF]\d{4} ")
pending = b""
while True:
    chunk = os.read(0, 1 << 16)
    if not chunk:
        break
    *lines, pending = (pending + chunk).split(b"\n")
    out = b"".join(line + b"\n" for line in lines if not drop.search(line))
    if pending and not held.match(pending):
        out, pending = out + pending, b""
    try:
        if out:
            os.write(1, out)
    except OSError:
        pass
if pending and not drop.search(pending):
    os.write(1, pending)
"""


@contextlib.contextmanager
def native_lines_dropped(pattern: str) -> Iterator[None]:
    """While inside, the lines written to fd 2 (TF's C++ logging, Python's too) that
    match `pattern` (a regular expression) are dropped; every other byte reaches the
    real stderr as it is written, through a small filter process that outlives this
    one, so a crash inside still shows its last lines."""
    import subprocess  # pylint: disable=import-outside-toplevel

    try:
        saved = os.dup(2)
    except OSError:  # no fd 2
        yield
        return
    read, write = os.pipe()
    try:
        child = subprocess.Popen([sys.executable, "-I", "-S", "-c", _FILTER, pattern],
                                 stdin=read, stdout=saved, start_new_session=True)
    except OSError:
        os.close(read), os.close(write), os.close(saved)
        yield
        return
    os.close(read)
    sys.stderr.flush()
    os.dup2(write, 2)
    os.close(write)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes this process's end of the pipe: the filter drains, ends
        os.close(saved)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10)  # not longer: a subprocess may hold the pipe open
