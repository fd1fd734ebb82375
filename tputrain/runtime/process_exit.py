"""A process that used tputrain ends within moments of its last line.

Freeing a tf.data iterator that has lived a while blocks until its autotuning
thread wakes from its current wait, which grows to a minute on a long run;
Python frees every iterator still alive when the interpreter shuts down, one
after the other, after the program's last line. At that point freeing them does
nothing useful (the operating system takes the memory back), so
`keep_iterators_at_exit`, an `atexit` hook installed when tputrain is imported,
keeps the tf.data iterators of every Trainer still alive (`track`) from being
freed (a Trainer that was closed holds none): what a script waited
for after its last line is then what Keras `fit` waits for. The `tputrain`
commands go further (`end_process`): once their own work and every `atexit` hook
are done and the output is flushed, the process ends without the interpreter's
teardown of TensorFlow's modules. Measured by `benchmarks/exit_time.py`.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import sys
import threading
import weakref
from typing import NoReturn

_installed = False
_owners: "weakref.WeakSet[object]" = weakref.WeakSet()
_kept: list[object] = []
_WALK_DEPTH = 8


def track(owner: object) -> None:
    """`owner` (a Trainer) holds tf.data iterators, directly or in its parts: at exit
    they are kept (`keep_iterators_at_exit`). Holds no reference to it; an owner that
    cannot be referenced weakly (a plain namespace standing in for a Trainer) holds
    no iterator of tputrain's and is passed over."""
    try:
        _owners.add(owner)
    except TypeError:
        pass


def _iterator_types() -> tuple[type, ...]:
    """tf.data's and tf.distribute's Python iterator types, when TensorFlow is loaded."""
    if "tensorflow.python.data.ops.iterator_ops" not in sys.modules:
        return ()
    from tensorflow.python.data.ops import iterator_ops, multi_device_iterator_ops
    from tensorflow.python.types import distribute

    return (iterator_ops.IteratorBase, multi_device_iterator_ops.OwnedMultiDeviceIterator,
            distribute.DistributedIteratorInterface)


def _iterators_of(owners: list[object], types: tuple[type, ...]) -> list[object]:
    """The iterators among the attributes of `owners` and of tputrain's objects under
    them (containers followed too; TensorFlow's and Keras' objects are not walked:
    a model's graph of objects is large and holds no iterator of tputrain's)."""
    found, seen, level = [], set(), list(owners)
    for _ in range(_WALK_DEPTH):
        following = []
        for obj in level:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, types):
                found.append(obj)
            elif isinstance(obj, (dict, list, tuple, set)) or (
                    type(obj).__module__.startswith("tputrain") and hasattr(obj, "__dict__")):
                following += gc.get_referents(obj)
        level = following
    return found


def keep_iterators_at_exit() -> int:
    """Gives every tf.data iterator of a tracked owner a reference that is never
    dropped, so the interpreter's shutdown does not free it (and wait on its
    autotuning thread). Returns how many it kept. Run at exit only: in a running
    program it would leak."""
    types = _iterator_types()
    if not types:
        return 0
    iterators = _iterators_of(list(_owners), types)
    for iterator in iterators:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(iterator))
    _kept.extend(iterators)  # what was kept, for a test to see; the count above holds them
    return len(iterators)


def install() -> None:
    """Registers `keep_iterators_at_exit` once (tputrain's import calls this)."""
    global _installed
    if not _installed:
        atexit.register(keep_iterators_at_exit)
        _installed = True


def _exit_code(code: object) -> int:
    """What `sys.exit(code)` would make the exit status (a message prints, then 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def end_process(code: object = 0) -> NoReturn:
    """Ends a `tputrain` command as `sys.exit(code)` would, less the interpreter's
    teardown: non-daemon threads are joined and every `atexit` hook runs (a checkpoint
    write in flight completes, goodput is recorded), logging and the standard streams
    are flushed, then the process exits. Only for a program that tputrain runs
    itself: a user's script may keep unflushed files that its teardown would close."""
    status = _exit_code(code)
    atexit.unregister(keep_iterators_at_exit)  # nothing is freed after this anyway
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to write
            pass
    os._exit(status)
