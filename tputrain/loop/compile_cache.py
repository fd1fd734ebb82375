"""XLA's persistent compilation cache: a rerun reads its compiled programs back.

Every restart of a run (a rerun after a kill, a preempted job, a continued run)
traces and compiles its step again; on a large model compiling is minutes of
each restart (goodput's `compile` bucket). TensorFlow can keep XLA's compiled
programs on disk (`--tf_xla_persistent_cache_directory` in `TF_XLA_FLAGS`) and
looks them up by a fingerprint of the program, so a changed model, loss or
config compiles anew and never runs a stale program; one directory can serve
every run of a machine.

TensorFlow reads `TF_XLA_FLAGS` once, when it first finds its devices, which
importing tputrain does (its start-up filter). So the directory is set when
tputrain is imported: `$TPUTRAIN_COMPILE_CACHE` (a path; `off` turns the cache
off), else `~/.cache/tputrain/xla/tf-<version>/<cpu>` (`cpu_key`: programs compiled
for one CPU's instruction set never reach another); a `TF_XLA_FLAGS` that names a
directory already wins. If TensorFlow found its devices before tputrain was
imported (an op ran), the flag comes too late: the Trainer says so once.

Only XLA programs are cached: the whole step on one replica, the per-device
update on several (`jit_compile`); TensorFlow's own tracing is not. Entries are
written to a temporary file and renamed, so processes can share the directory.
Not measured on TPUs, whose programs the TPU runtime compiles. TensorFlow's
harmless error-level lines for a program read back are kept off the console
(`reading`, `READ_BACK_LINES`).

The cache is an optimisation and never fatal. TensorFlow fails the step that
reads a damaged entry (garbage: a DataLossError that reads like damaged input;
truncated: an OutOfRangeError; another program's entry under this one's name:
"Serialized cache key does not match"), so before the first step the Trainer
checks each entry it has not seen sound (`check_entries`) and removes those
TensorFlow could not load, with one warning each: their programs compile again
and are rewritten. A path that is no writable directory turns the cache off with
one warning (`enable` runs at import, where raising would break even `--help`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import sys
import weakref
from importlib import metadata
from typing import Any

from tputrain.core import cpu_info

FLAG = "--tf_xla_persistent_cache_directory"
ENV = "TPUTRAIN_COMPILE_CACHE"
# The entries found sound, by name: {name: [size, mtime_ns]}; each is read once.
CHECKED = ".tputrain-checked.json"
# What TensorFlow logs for every entry it reads back (it tries text before binary).
PARSE_LINE = "Error parsing text-format tensorflow.XlaSerializedCacheEntry"
# XLA:CPU's error-level line for each tuning flag it compiled with (prefer-no-scatter,
# prefer-no-gather) when it loads the program back: flags, not instructions, that the
# host's feature list never names. A missing instruction set is still shown.
TUNING_LINE = (r"Loading XLA:CPU AOT result\. Target machine feature "
               r"\+prefer-no-(?:scatter|gather) is not\s+supported on the host machine")
# Those lines, dropped from the console while programs are read back (`reading`).
READ_BACK_LINES = rf"^E\d{{4}} .*\] (?:{re.escape(PARSE_LINE)}:|{TUNING_LINE})"

_state: dict[str, Any] = {"directory": None, "too_late": False, "reported": False,
                          "off": None}


def current() -> str | None:
    """The directory `TF_XLA_FLAGS` names, if any."""
    found = re.search(re.escape(FLAG) + r"=(\S+)", os.environ.get("TF_XLA_FLAGS", ""))
    return found.group(1) if found else None


def _isa_cap() -> list[str]:
    """XLA_FLAGS's cap on the instruction set XLA compiles for (`--xla_cpu_max_isa=AVX2`):
    TensorFlow's cache key leaves XLA_FLAGS out, so a capped run needs a folder of its own."""
    return re.findall(r"--xla_cpu_max_isa=\S+", os.environ.get("XLA_FLAGS", ""))


def cpu_key() -> str:
    """A short name for the host CPU's instruction set: the cache's subfolder, because
    XLA compiles CPU programs for the host (AVX-512, say) and a cache shared with a
    machine without it (a home folder on a network file system) must not hand them over."""
    digest = hashlib.sha256(" ".join(sorted(cpu_info.cpu_flags().split()) + _isa_cap()).encode())
    return f"{platform.machine() or 'cpu'}-{digest.hexdigest()[:10]}"


def default_directory() -> str | None:
    """`$TPUTRAIN_COMPILE_CACHE`, or a folder per TensorFlow version and CPU instruction
    set under the user's cache; None when the variable says `off` (or `0`, `false`,
    empty)."""
    setting = os.environ.get(ENV)
    if setting is not None:
        return None if setting.strip().lower() in ("", "0", "off", "false") else setting
    try:
        version = metadata.version("tensorflow")
    except metadata.PackageNotFoundError:  # tensorflow-tpu, tensorflow-cpu, ...
        version = "unknown"
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "tputrain", "xla", f"tf-{version}", cpu_key())


def enable(directory: str | None = None) -> str | None:
    """Points XLA's persistent cache at `directory` (None: `default_directory()`)
    unless `TF_XLA_FLAGS` names one already; returns the directory in use."""
    existing = current()
    if existing:
        _state["directory"] = existing
        return existing
    directory = directory or default_directory()
    if directory is None:
        return None
    if "://" not in directory:
        problem = _not_a_writable_directory(directory)
        if problem:
            _state["off"] = (f"tputrain: XLA compilation cache off: {directory} is not a "
                             f"writable directory ({problem}); set {ENV} to one, or to off")
            return None
    flags = os.environ.get("TF_XLA_FLAGS", "")
    os.environ["TF_XLA_FLAGS"] = f"{flags} {FLAG}={directory}".strip()
    _state["directory"] = directory
    _state["too_late"] = _devices_found()
    return directory


def _not_a_writable_directory(directory: str) -> str | None:
    """Why `directory` cannot hold the cache (a file, no permission), or None."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        return error.strerror or type(error).__name__
    if not os.access(directory, os.W_OK | os.X_OK):
        return "not writable"
    return None


def _devices_found() -> bool:
    """Whether TensorFlow has found its devices (and so read TF_XLA_FLAGS) already."""
    context = sys.modules.get("tensorflow.python.eager.context")
    if context is None:
        return False
    found = context.context_safe()
    return found is not None and getattr(found, "_physical_devices", None) is not None


def report() -> str | None:
    """Logs the start-up line about the cache, once a process (the Trainer calls it,
    before its first step), after removing the damaged entries (`check_entries`: a
    warning each); returns the line (None after the first, or with no cache)."""
    if _state["reported"] or (_state["directory"] is None and _state["off"] is None):
        return None
    _state["reported"] = True
    from absl import logging  # light; not at import: tputrain's import stays minimal

    if _state["off"] is not None:
        logging.warning(_state["off"])
        return _state["off"]
    directory = _state["directory"]
    programs = None
    if "://" not in directory and os.path.isdir(directory):
        for warning in check_entries(directory):
            logging.warning(warning)
        programs = len(_entry_names(directory))
    line = _line(programs)
    (logging.warning if _state["too_late"] else logging.info)(line)
    return line


def _line(programs: int | None) -> str:
    if _state["too_late"]:
        return (f"tputrain: XLA compilation cache {_state['directory']} may be unused: "
                "TensorFlow had started before tputrain was imported (import tputrain first, or set "
                f"TF_XLA_FLAGS={FLAG}=DIR before TensorFlow starts)")
    line = f"tputrain: XLA compilation cache {_state['directory']}"
    return line if not programs else f"{line} ({programs} program(s))"


_read: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()


def reading(owner: Any, program: str) -> contextlib.AbstractContextManager:
    """Wraps the first call of `owner`'s `program` (the one that compiles it, or reads
    it back): with the cache on, TensorFlow's error-level lines for a program read back
    soundly (`READ_BACK_LINES`) are dropped from the console, every other line kept
    (`tputrain.observe.console.native_lines_dropped`)."""
    done = _read.setdefault(owner, set())
    if program in done or _state["directory"] is None:
        return contextlib.nullcontext()
    done.add(program)
    from tputrain.observe.console import native_lines_dropped  # pylint: disable=import-outside-toplevel

    return native_lines_dropped(READ_BACK_LINES)


# TensorFlow's errors for an entry it read but could not use (DeviceExecutablePersistor);
# one it could not parse names its path ("Can't parse PATH as binary proto").
_ENTRY_ERRORS = ("Serialized cache key does not match", "Serialized HLO does not match",
                 "No binary found in serialized entry")


class CompileCacheError(RuntimeError):
    """A step failed reading a program back from XLA's compilation cache (an entry
    damaged after the Trainer checked the cache): the cache, not the data."""


def read_error(error: Exception) -> CompileCacheError | None:
    """For a step's error that comes from reading the cache: removes the entries
    TensorFlow could not load and returns the one-line error that says so; else None
    (the caller reports `error` as before: a data error, say)."""
    directory, text = _state["directory"], str(error)
    if directory is None or not (directory in text or any(m in text for m in _ENTRY_ERRORS)):
        return None
    cause = next(line.strip() for line in text.splitlines()
                 if directory in line or any(m in line for m in _ENTRY_ERRORS))
    local = "://" not in directory and os.path.isdir(directory)
    removed = _sweep(directory) if local and _checker_problem() is None else []
    if removed:
        where = ", ".join(path for path, _ in removed)
        advice = "removed: rerun the same command, its program compiles again"
    else:
        where, advice = directory, f"remove the damaged entry, or set {ENV}=off, and rerun"
    return CompileCacheError(
        f"tputrain: XLA compilation cache entry {where} could not be read back ({cause}; "
        f"damaged while this run used the cache): the cache, not the data; {advice}")


def _entry_names(directory: str) -> list[str]:
    """The entries' file names (TensorFlow's temporary files end in .tmp)."""
    try:
        return sorted(name for name in os.listdir(directory) if name.endswith(".pb"))
    except OSError:
        return []


def check_entries(directory: str) -> list[str]:
    """Removes the entries of `directory` that TensorFlow could not load (unreadable,
    not an entry, another program's key, no program); returns one warning each.
    An entry found sound is remembered by size and time (`CHECKED`), not read again.
    If the check itself cannot run (the entry's message cannot be built), every entry
    is left as it is, with one warning: the cache is never fatal."""
    problem = _checker_problem()
    if problem is not None:
        return [f"tputrain: XLA compilation cache {directory}: its entries could not be "
                f"checked ({problem}); left as they are; set {ENV}=off if a step fails "
                "reading one"]
    return [warning for _, warning in _sweep(directory)]


def _checker_problem() -> str | None:
    """Why the entries' message cannot be built (protobuf raises a TypeError for a
    name that does not resolve, or a file of the same name already in its pool)."""
    try:
        _entry_class()
    except Exception as error:  # noqa: BLE001  (whatever protobuf raises: the check, not the cache)
        return f"{type(error).__name__}: {error}"
    return None


def _sweep(directory: str) -> list[tuple[str, str]]:
    """`check_entries`' work: (path, warning) for each entry removed."""
    checked = _read_checked(directory)
    sound, warnings = {}, []
    for name in _entry_names(directory):
        path = os.path.join(directory, name)
        try:
            stat = os.stat(path)
        except OSError:  # removed meanwhile (another process)
            continue
        seen = [stat.st_size, stat.st_mtime_ns]
        problem = None if checked.get(name) == seen else entry_problem(path)
        if problem is None:
            sound[name] = seen
        else:
            warnings.append((path, _removed(path, problem)))
    if sound != checked:
        _write_checked(directory, sound)
    return warnings


def _removed(path: str, problem: str) -> str:
    """Removes the damaged entry at `path`; the warning that says so."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        return (f"tputrain: XLA compilation cache entry {path} is damaged or another "
                f"program's ({problem}) and cannot be removed ({error.strerror}): remove "
                f"it, or set {ENV}=off; a step that reads it fails")
    return (f"tputrain: XLA compilation cache entry {path} is damaged or another program's "
            f"({problem}): removed; its program compiles again and is rewritten")


def entry_problem(path: str) -> str | None:
    """Why TensorFlow could not load the entry at `path` (as its DeviceExecutablePersistor
    reads one: text or binary proto, the key its file name says, a program), or None."""
    try:
        with open(path, "rb") as file:
            content = file.read()
    except OSError as error:
        return f"unreadable: {error.strerror or type(error).__name__}"
    entry = _entry_class()()
    try:
        entry.ParseFromString(content)
    except Exception:  # noqa: BLE001  (protobuf's DecodeError, or a nested message's)
        try:
            from google.protobuf import text_format

            text_format.Parse(content.decode("utf-8"), entry)
        except Exception:  # noqa: BLE001
            return "not an entry"
    if not entry.HasField("key"):
        return "not an entry"
    if _file_name(entry.key) != os.path.basename(path):
        return "another key"
    if not entry.HasField("hlo_module") or not entry.executable:
        return "no program"
    return None


def _file_name(key: Any) -> str:
    """TensorFlow's file name for a key (XlaSerializedCacheKeyToFileName)."""
    parts = [key.prefix] if key.prefix else []
    parts += [str(key.signature_fingerprint), str(key.cluster_fingerprint), key.device_type]
    if key.compiled_using_pjrt:
        parts.append("pjrt")
    return "__".join(parts) + ".pb"


@functools.lru_cache(maxsize=None)
def _entry_class() -> type:
    """tensorflow.XlaSerializedCacheEntry's message (TensorFlow ships no Python module
    for it; its fields as in xla_compilation_cache.proto), its HLO as XLA's own."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from tensorflow.compiler.xla.service import hlo_pb2

    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name="tputrain/xla_compilation_cache_entry.proto", package="tputrain.loop.compile_cache",
        syntax="proto3", dependency=[hlo_pb2.DESCRIPTOR.name])
    key = proto.message_type.add(name="Key")
    for name, number, kind in (("signature_fingerprint", 1, field.TYPE_UINT64),
                               ("cluster_fingerprint", 2, field.TYPE_UINT64),
                               ("device_type", 3, field.TYPE_STRING),
                               ("prefix", 4, field.TYPE_STRING),
                               ("compiled_using_pjrt", 5, field.TYPE_BOOL)):
        key.field.add(name=name, number=number, type=kind, label=field.LABEL_OPTIONAL)
    entry = proto.message_type.add(name="Entry")
    entry.field.add(name="key", number=1, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
                    type_name=".tputrain.loop.compile_cache.Key")
    entry.field.add(name="hlo_module", number=2, type=field.TYPE_MESSAGE,
                    label=field.LABEL_OPTIONAL, type_name=".xla.HloModuleProto")
    entry.field.add(name="executable", number=3, type=field.TYPE_BYTES,
                    label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.Default()
    try:
        descriptor = pool.FindMessageTypeByName("tputrain.loop.compile_cache.Entry")
    except KeyError:
        pool.Add(proto)
        descriptor = pool.FindMessageTypeByName("tputrain.loop.compile_cache.Entry")
    return message_factory.GetMessageClass(descriptor)


def _read_checked(directory: str) -> dict[str, list[int]]:
    try:
        with open(os.path.join(directory, CHECKED), encoding="utf-8") as file:
            checked = json.load(file)
        return checked if isinstance(checked, dict) else {}
    except (OSError, ValueError):  # none yet, or damaged too: every entry is read
        return {}


def _write_checked(directory: str, checked: dict[str, list[int]]) -> None:
    """Written aside and renamed: processes sharing the cache may write it at once."""
    from tputrain.checkpointing.atomic import write_atomically  # imports no TensorFlow

    try:
        write_atomically(os.path.join(directory, CHECKED), json.dumps(checked), durable=False)
    except OSError:  # a read-only cache: checked again next time
        pass
