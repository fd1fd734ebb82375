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
Not measured on TPUs, whose programs the TPU runtime compiles.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
from importlib import metadata

FLAG = "--tf_xla_persistent_cache_directory"
ENV = "TPUTRAIN_COMPILE_CACHE"

_state = {"directory": None, "too_late": False, "reported": False}


def current() -> str | None:
    """The directory `TF_XLA_FLAGS` names, if any."""
    found = re.search(re.escape(FLAG) + r"=(\S+)", os.environ.get("TF_XLA_FLAGS", ""))
    return found.group(1) if found else None


def _cpu_features() -> str:
    """The host CPU's instruction-set flags (Linux's /proc/cpuinfo), else its name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith(("flags", "Features")):  # x86, Arm
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_key() -> str:
    """A short name for the host CPU's instruction set: the cache's subfolder, because
    XLA compiles CPU programs for the host (AVX-512, say) and a cache shared with a
    machine without it (a home folder on a network file system) must not hand them over."""
    digest = hashlib.sha256(" ".join(sorted(_cpu_features().split())).encode()).hexdigest()
    return f"{platform.machine() or 'cpu'}-{digest[:10]}"


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
        os.makedirs(directory, exist_ok=True)
    flags = os.environ.get("TF_XLA_FLAGS", "")
    os.environ["TF_XLA_FLAGS"] = f"{flags} {FLAG}={directory}".strip()
    _state["directory"] = directory
    _state["too_late"] = _devices_found()
    return directory


def _devices_found() -> bool:
    """Whether TensorFlow has found its devices (and so read TF_XLA_FLAGS) already."""
    context = sys.modules.get("tensorflow.python.eager.context")
    if context is None:
        return False
    found = context.context_safe()
    return found is not None and getattr(found, "_physical_devices", None) is not None


def report() -> str | None:
    """Logs the start-up line about the cache, once a process (the Trainer calls it);
    returns it (None after the first, or with no cache)."""
    if _state["reported"] or _state["directory"] is None:
        return None
    _state["reported"] = True
    line = _line()
    from absl import logging  # light; not at import: tputrain's import stays minimal

    (logging.warning if _state["too_late"] else logging.info)(line)
    return line


def _line() -> str:
    if _state["too_late"]:
        return (f"tputrain: XLA compilation cache {_state['directory']} may be unused: "
                "TensorFlow had started before tputrain was imported (import tputrain first, or set "
                f"TF_XLA_FLAGS={FLAG}=DIR before TensorFlow starts)")
    return f"tputrain: XLA compilation cache {_state['directory']}"
