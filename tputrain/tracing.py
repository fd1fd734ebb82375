"""Tracing less: the Python work a run's first loop does before its first step.

TensorFlow keeps no traced graph across processes (XLA's persistent cache,
`compile_cache.py`, holds compiled XLA programs only), so every restart traces its
loops again; for a model without XLA (digits' dropout on CPU) that tracing, with
AutoGraph's conversion of the Python it traces, is most of the time from process
start to the first trained step. This module makes it cheaper, without changing
the graph's ops:

- `once`: a training loop calls its step in three places (the peeled first step,
  the rest of the first fetch, later fetches); the step as its own `tf.function`
  is traced once and called three times.
- `graph_helper`: tputrain's own graph-building helpers that have no Python
  control flow on tensors and call no user code are left unconverted by AutoGraph
  (a user's Task, loss and metrics are converted as before).
- `loop_function`: the host loop's `tf.function` is traced without AutoGraph (its
  loops are explicit `tf.while_loop`s); the step it calls is its own `once`
  function, which converts the user's code.

`TPUTRAIN_LEAN_TRACING=off` (or `0`, `false`) turns them off, read at import;
`benchmarks/restart_compile.py` measures reruns both ways.
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

import tensorflow as tf

ENV = "TPUTRAIN_LEAN_TRACING"
ENABLED = os.environ.get(ENV, "on").strip().lower() not in ("0", "off", "false", "no")

F = TypeVar("F", bound=Callable)


def once(fn: F) -> F:
    """`fn` as a `tf.function` its callers' graphs call (traced once a signature)."""
    return tf.function(fn) if ENABLED else fn


def graph_helper(fn: F) -> F:
    """Marks tputrain code AutoGraph need not convert: no `if`/`for`/`while` on tensors
    and no call into user code (whose conversion an unconverted caller would stop)."""
    return tf.autograph.experimental.do_not_convert(fn) if ENABLED else fn


def loop_function(fn: F) -> F:
    """`tf.function(fn)` for a loop with explicit control flow that calls user code
    only through `once` functions: unconverted by AutoGraph (converted when off, where
    the user's step is traced inline)."""
    return tf.function(fn, autograph=not ENABLED)
