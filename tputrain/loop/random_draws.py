"""Whether a model's random ops make XLA a loss, or impossible, on a CPU: `xla_refusal`.

Random numbers drawn under XLA on a CPU with TensorFlow's default algorithm take far
longer than TensorFlow's kernels (docs/performance.md), so a step whose forward pass
draws as many numbers as it has activations that way (an MLP adding `tf.random` noise
to its hidden layers) runs faster without XLA. Every draw made through Keras's backend
(Dropout, GaussianNoise, GaussianDropout, AlphaDropout, the augmentation layers'
factors, `keras.random`) is made with ThreeFry in a compiled step
(`tputrain.loop.xla_dropout`), as fast as TensorFlow's kernels: those draws are not
counted against XLA. A model whose draws are few beside its matmuls and convolutions (a conv
net with Dropout on its pooled features) loses almost nothing to them and gains
what XLA fuses. The count is taken on the traced forward pass (training mode),
not run: random numbers drawn per FLOP of its matmuls and convolutions. Some random
layers run ops XLA has no kernel for (`NO_XLA_KERNEL`): their step stays uncompiled,
and the plan's reason names the op and its layer.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tputrain.core import tracing
from tputrain.checkpointing.seeds import seed_generator_states
from tputrain.observe.flops import count_graph_flops, live_graph_ops
from tputrain.loop.source_counts import without_source
from tputrain.loop.xla_dropout import SCOPE as THREEFRY_SCOPE, ThreeFryDraws

# Above this many random numbers a forward FLOP the step runs without XLA on a CPU.
# XLA drew a float32 uniform number in ~700 ns of CPU time against ~8 ns for
# TensorFlow's kernel, and a conv net's step ran at ~0.05 ns of CPU time a FLOP: at
# this ratio the draws cost about 2.5% of a step (forward and backward ~3x the
# forward's FLOPs), less than XLA's fusion saved on the conv net.
COSTLY_DRAWS_PER_FLOP = 5e-6

# Ops of Keras's random layers XLA cannot compile on a CPU (measured on TensorFlow
# 2.21): the image transform of RandomRotation, RandomZoom, RandomTranslation,
# RandomShear, RandomPerspective and RandAugment, and the gamma draws of MixUp,
# CutMix and AugMix.
NO_XLA_KERNEL = ("ImageProjectiveTransformV2", "ImageProjectiveTransformV3",
                 "StatelessRandomGammaV2", "StatelessRandomGammaV3")

# Op types that draw (not those that only derive a key or pick an algorithm).
_NOT_DRAWS = ("StatelessRandomGetKeyCounter", "StatelessRandomGetAlg",
              "StatelessRandomGetKeyCounterAlg", "RandomShuffle", "RandomShuffleQueueV2",
              "AnonymousSeedGenerator", "DummySeedGenerator")


def _draws(op: tf.Operation) -> int | None:
    """Random numbers one op draws (0 for other ops); None for a dynamic shape."""
    if not ("Random" in op.type or "TruncatedNormal" in op.type) or op.type in _NOT_DRAWS:
        return 0
    if f"{THREEFRY_SCOPE}/" in op.name:  # Keras's draw by ThreeFry: cheap in XLA
        return 0
    if not op.outputs:
        return 0
    shape = op.outputs[0].shape
    if shape.rank is None or None in shape.as_list():
        return None
    return int(np.prod(shape.as_list(), dtype=np.int64))


def features_spec(batch_spec: Any, accumulation_steps: int = 1,
                  source_key: str | tuple[str, ...] | None = None) -> Any:
    """The features' spec of one (micro-)batch from the train dataset's element spec."""
    spec = without_source(batch_spec, source_key) if source_key else batch_spec
    if accumulation_steps > 1:  # [micro-batches, batch, ...]
        spec = tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape[1:], s.dtype), spec)
    return spec[0]


def _forward_graph(model: keras.Model, spec: Any, compiled: bool) -> tf.Graph | Exception:
    """The training-mode forward pass's graph (traced, not run), with Keras's draws made
    by ThreeFry if `compiled`; or the error it raised if it does not trace alone (a
    probe: the step, traced later, raises a user's error itself)."""
    swap = ThreeFryDraws(model) if compiled else None
    try:
        forward = tracing.graph_helper(lambda f: model(f, training=True))  # Keras: unconverted
        with swap.active() if swap else contextlib.nullcontext():
            return tf.function(forward).get_concrete_function(spec).graph
    except Exception as error:  # pylint: disable=broad-except  # whatever the user's code raises
        return error


def _per_flop(graph: tf.Graph | Exception) -> float | None:
    if isinstance(graph, Exception):
        return None
    try:
        flops = count_graph_flops(graph)
        counts = [_draws(op) for op in live_graph_ops(graph)]
    except (ValueError, TypeError, tf.errors.OpError):
        return None
    if None in counts:
        return None
    return sum(counts) / max(flops, 1)


def draws_per_flop(model: keras.Model, spec: Any, compiled: bool = False) -> float | None:
    """Random numbers the training-mode forward pass draws per matmul/conv FLOP; None
    if it cannot be counted (a shape not static, a model that does not trace).
    `compiled`: those a compiled step draws with TensorFlow's default algorithm (Keras's
    draws, made by ThreeFry there, left out)."""
    return _per_flop(_forward_graph(model, spec, compiled))


def _layer_of(op: tf.Operation, model: keras.Model) -> str:
    """The class of the layer whose name scope holds `op` (its scope, if none is found)."""
    scopes = op.name.split("/")[:-1]
    layers = model._flatten_layers(include_self=False, recursive=True)  # pylint: disable=protected-access
    by_name = {layer.name: type(layer).__name__ for layer in layers}
    for scope in reversed(scopes):  # the innermost first; TensorFlow may suffix "_1"
        for name in (scope, scope.rsplit("_", 1)[0]):
            if name in by_name:
                return by_name[name]
    return "/".join(scopes)


def xla_refusal(model: keras.Model, spec: Any) -> str | None:
    """Why "auto" keeps XLA off on a CPU for `model`'s random layers (one line), or None:
    an op XLA has no kernel for, or a compiled step that draws more than
    `COSTLY_DRAWS_PER_FLOP` outside Keras's backend, or draws that cannot be counted."""
    if not seed_generator_states(model):
        return None
    graph = _forward_graph(model, spec, compiled=True)
    if isinstance(graph, Exception):
        return ("auto: off on CPU: random draws not counted: the model's training forward "
                f"pass does not trace alone ({_named(graph)})")
    for op in live_graph_ops(graph):
        if op.type in NO_XLA_KERNEL:
            return f"auto: off on CPU: XLA has no kernel for {op.type} ({_layer_of(op, model)})"
    ratio = _per_flop(graph)
    if ratio is None or ratio > COSTLY_DRAWS_PER_FLOP:
        return "auto: off on CPU for random ops drawn outside keras.random (e.g. tf.random)"
    return None


def _named(error: Exception) -> str:
    """"KeyError: 'features'": the error's type and its own first line (a Keras layer's
    error wraps it in "Exception encountered when calling ...", a traced one in "in
    user code:" and a traceback)."""
    text = error.args[0] if len(error.args) == 1 and isinstance(error.args[0], str) else str(error)
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()]
    lines = [line for line in lines if line and not line.startswith(
        ("Exception encountered when calling", "in user code:", "File ", "Arguments received"))]
    line = tracing.error_line(type(error)(lines[0])) if lines else ""
    return line if re.match(r"^[A-Za-z.]*(Error|Exception): ", line) else (
        f"{type(error).__name__}: {line}")
