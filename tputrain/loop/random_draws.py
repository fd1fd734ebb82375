"""Whether a model's random draws make XLA a loss on a CPU: `draws_are_costly`.

Keras's draws under XLA on a CPU take far longer than TensorFlow's kernels
(docs/performance.md), so a step whose forward pass draws as many numbers as it
has activations (an MLP with GaussianNoise on its hidden layers) runs faster without
XLA. Dropout and SpatialDropout draw their masks with ThreeFry in a compiled step
(`tputrain.loop.xla_dropout`), faster than TensorFlow's kernels: their draws are
not counted against XLA. A model whose draws are few beside its matmuls and convolutions (a conv
net with Dropout on its pooled features) loses almost nothing to them and gains
what XLA fuses. The count is taken on the traced forward pass (training mode),
not run: random numbers drawn per FLOP of its matmuls and convolutions.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tputrain.core import tracing
from tputrain.checkpointing.seeds import seed_generator_states
from tputrain.observe.flops import count_graph_flops, live_graph_ops
from tputrain.loop.source_counts import without_source
from tputrain.loop.xla_dropout import SCOPE as THREEFRY_SCOPE, ThreeFryDropout

# Above this many random numbers a forward FLOP the step runs without XLA on a CPU.
# XLA drew a float32 uniform number in ~700 ns of CPU time against ~8 ns for
# TensorFlow's kernel, and a conv net's step ran at ~0.05 ns of CPU time a FLOP: at
# this ratio the draws cost about 2.5% of a step (forward and backward ~3x the
# forward's FLOPs), less than XLA's fusion saved on the conv net.
COSTLY_DRAWS_PER_FLOP = 5e-6

# Op types that draw (not those that only derive a key or pick an algorithm).
_NOT_DRAWS = ("StatelessRandomGetKeyCounter", "StatelessRandomGetAlg",
              "StatelessRandomGetKeyCounterAlg", "RandomShuffle", "RandomShuffleQueueV2",
              "AnonymousSeedGenerator", "DummySeedGenerator")


def _draws(op: tf.Operation) -> int | None:
    """Random numbers one op draws (0 for other ops); None for a dynamic shape."""
    if not ("Random" in op.type or "TruncatedNormal" in op.type) or op.type in _NOT_DRAWS:
        return 0
    if f"{THREEFRY_SCOPE}/" in op.name:  # a ThreeFry dropout mask: cheap in XLA
        return 0
    if not op.outputs:
        return 0
    shape = op.outputs[0].shape
    if shape.rank is None or None in shape.as_list():
        return None
    return int(np.prod(shape.as_list(), dtype=np.int64))


def features_spec(batch_spec: Any, accumulation_steps: int = 1,
                  source_key: str | None = None) -> Any:
    """The features' spec of one (micro-)batch from the train dataset's element spec."""
    spec = without_source(batch_spec, source_key) if source_key else batch_spec
    if accumulation_steps > 1:  # [micro-batches, batch, ...]
        spec = tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape[1:], s.dtype), spec)
    return spec[0]


def draws_per_flop(model: keras.Model, spec: Any, compiled: bool = False) -> float | None:
    """Random numbers the training-mode forward pass draws per matmul/conv FLOP; None
    if it cannot be counted (a shape not static, a model that does not trace).
    `compiled`: those a compiled step draws with Keras's generators (Dropout's
    ThreeFry masks left out)."""
    swap = ThreeFryDropout(model) if compiled else None
    try:
        forward = tracing.graph_helper(lambda f: model(f, training=True))  # Keras: unconverted
        with swap.active() if swap else contextlib.nullcontext():
            graph = tf.function(forward).get_concrete_function(spec).graph
        flops = count_graph_flops(graph)
        counts = [_draws(op) for op in live_graph_ops(graph)]
    except (ValueError, TypeError, tf.errors.OpError):
        return None
    if None in counts:
        return None
    return sum(counts) / max(flops, 1)


def draws_are_costly(model: keras.Model, spec: Any) -> bool:
    """Whether XLA's CPU random numbers would cost this model's step more than XLA
    saves: it has random layers and its compiled step draws more than
    `COSTLY_DRAWS_PER_FLOP` with Keras's generators, or its draws cannot be counted."""
    if not seed_generator_states(model):
        return False
    ratio = draws_per_flop(model, spec, compiled=True)
    return ratio is None or ratio > COSTLY_DRAWS_PER_FLOP
