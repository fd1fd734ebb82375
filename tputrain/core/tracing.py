"""Tracing less: the Python work a run's first loop does before its first step.

TensorFlow keeps no traced graph across processes (XLA's persistent cache,
`compile_cache.py`, holds compiled XLA programs only), so every restart traces its
loops again; for a model without XLA (digits' dropout on CPU) that tracing, with
AutoGraph's conversion of the Python it traces, is most of the time from process
start to the first trained step. This module makes it cheaper, without changing
the graph's ops:

- `once`: a training loop's step is traced for its logs' structure (the loop's
  sums start at zeros of it, `HostLoop.log_zeros`) and called in the loop; the
  step as its own `tf.function` is traced once for both.
- `graph_helper`: tputrain's own graph-building helpers that have no Python
  control flow on tensors and call no user code are left unconverted by AutoGraph
  (a user's Task, loss and metrics are converted as before).
- `loop_function`: the host loop's `tf.function` is traced without AutoGraph (its
  loops are explicit `tf.while_loop`s); the step it calls is its own `once`
  function, which converts the user's code.
- `step_code` and `user_call`: the train and eval steps' own code (`loop/step.py`,
  `loop/evaluation.py`) is left unconverted too, and calls each Task method (which
  a user may override, and which calls the user's model, loss and metrics) through
  `user_call`, which AutoGraph converts as before. AutoGraph's conversions are not kept
  across processes: every restart pays for each one again.

`TPUTRAIN_LEAN_TRACING=off` (or `0`, `false`) turns them off, read at import;
`benchmarks/restart_compile.py` measures reruns both ways.
"""

from __future__ import annotations

import os
import re
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


# What AutoGraph passes to the calls a converted function makes (a `tf.function`'s
# `ConversionOptions(recursive=True)`'s `call_options()`): one cache of conversions.
_CALL_OPTIONS = None


def step_code(fn: F) -> F:
    """Marks tputrain's step code, which has no `if`/`for`/`while` on tensors and calls
    user code only through `user_call`: unconverted under lean tracing."""
    return graph_helper(fn)


def user_call(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)`, `fn` converted by AutoGraph as a call from converted code
    is (a user's `if` on a tensor becomes a `tf.cond`), also from `step_code`."""
    if not ENABLED:  # the caller is converted: AutoGraph converts this call itself
        return fn(*args, **kwargs)
    from tensorflow.python.autograph.core import ag_ctx, converter  # no public API
    from tensorflow.python.autograph.impl import api

    global _CALL_OPTIONS
    if _CALL_OPTIONS is None:
        _CALL_OPTIONS = converter.ConversionOptions(recursive=True,
                                                    optional_features=None).call_options()
    with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED):
        return api.converted_call(fn, args, kwargs, options=_CALL_OPTIONS)


def loop_function(fn: F) -> F:
    """`tf.function(fn)` for a loop with explicit control flow that calls user code
    only through `once` functions: unconverted by AutoGraph (converted when off, where
    the user's step is traced inline)."""
    return tf.function(fn, autograph=not ENABLED)


def error_line(error: Exception) -> str:
    """The line of an error that names it: an error raised while tracing starts with
    "in user code:" and a traceback, and names itself ("RuntimeError: ...") later."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[A-Za-z.]*(Error|Exception): ", line)]
    line = (named or lines or [""])[0]
    return line.removeprefix(f"{type(error).__name__}: ")[:300]
