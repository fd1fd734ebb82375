"""Rematerialization on TensorFlow: Keras's `RematScope`, made to work in a graph.

`keras.RematScope` marks the layers built in it (`Operation._remat_mode`) and
Keras wraps their calls in `tf.recompute_grad` on the TensorFlow backend. In a
`tf.function` (every tputrain step) that fails for any layer called with keyword
arguments ("The custom_gradient decorator currently supports keywords arguments
only when eager execution is enabled"), and Keras passes `training=` to every
layer. `build_with_remat` keeps Keras's choice of layers and recomputes them with
`recompute`, which passes only tensors positionally. The model itself is not
recomputed as a whole: that would repeat its whole forward for no memory saved.

Random layers (Dropout, GaussianNoise, random augmentation) draw their seeds from a
Keras `SeedGenerator`, whose `next()` returns its state and advances it. Recomputed
as it is, a layer would draw the next seed (a new mask: a gradient that belongs to
no forward pass) and advance the state a second time each step (other masks at
every later step, another stream than without remat). So each recomputed call
records the seeds its forward pass drew, and its recomputations replay them
(`_Draws`): the masks are the forward pass's, the state advances once a step.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from keras.src.backend.common.variables import AutocastScope, get_autocast_scope

from tputrain.loop.replica_seeds import seed_generators
from tputrain.options import RematOptions

# The `_Draws` frames entered by this thread (MirroredStrategy traces each replica in
# a thread of its own), innermost last.
_frames = threading.local()


class _Draws:
    """The seeds one recomputed call drew: recorded by its forward pass (the first
    entry), replayed in the same order per generator by its recomputations (every
    later one: the backward pass, again for each nested recomputation)."""

    def __init__(self) -> None:
        self.recorded: dict[int, list[Any]] = {}
        self.entered = False
        self.replay: dict[int, Iterator[Any]] | None = None

    @contextlib.contextmanager
    def entered_once_more(self) -> Iterator[None]:
        frame = _Draws()
        if self.entered:
            frame.replay = {key: iter(seeds) for key, seeds in self.recorded.items()}
        else:
            frame.recorded, self.entered = self.recorded, True
        stack = _frames.__dict__.setdefault("stack", [])
        stack.append(frame)
        try:
            yield
        finally:
            stack.pop()


def _replayed(generator: Any, draw: Callable[..., Any]) -> Callable[..., Any]:
    """`generator.next` that, in a recomputation, returns the forward pass's seed
    instead of drawing (the state is left alone), and records what it returns for
    every recomputed call being run forward."""
    def next_seed(ordered: bool = True) -> Any:
        stack = getattr(_frames, "stack", [])
        replay = next((f.replay for f in reversed(stack) if f.replay is not None), None)
        if replay is None:
            seed = draw(ordered=ordered)
        else:
            seed = next(replay.get(id(generator), iter(())), None)
            if seed is None:
                raise RuntimeError(
                    "tputrain: a rematerialized layer drew more random numbers in its "
                    "recomputation than in its forward pass (a random layer called under a "
                    "condition that changed?): set Trainer.remat=None for this model")
        for frame in stack:
            if frame.replay is None:
                frame.recorded.setdefault(id(generator), []).append(seed)
        return seed
    next_seed.replays_remat = True
    return next_seed


def replay_draws_in_recomputation(model: keras.Model) -> None:
    """Makes every `SeedGenerator` of `model` replay its forward pass's seeds when a
    rematerialized layer is recomputed (an instance attribute over the class's
    `next`, as `replica_seeds` does; idempotent)."""
    for generator in seed_generators(model):
        if not getattr(generator.next, "replays_remat", False):
            generator.next = _replayed(generator, generator.next)


def recompute(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` under `tf.recompute_grad`, its floating tensors passed positionally and
    everything else (flags, masks, integer ids: no gradient) closed over. The
    backward pass recomputes outside the layer's call: under the call's autocast
    dtype again (mixed precision reads float32 variables as bfloat16), with the random
    seeds its forward pass drew (`_Draws`)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        autocast = get_autocast_scope()
        flat = tf.nest.flatten((args, kwargs))
        where = [i for i, x in enumerate(flat)
                 if tf.is_tensor(x) and x.dtype.is_floating]
        draws = _Draws()

        def inner(*tensors: tf.Tensor) -> Any:
            values = list(flat)
            for i, tensor in zip(where, tensors):
                values[i] = tensor
            inner_args, inner_kwargs = tf.nest.pack_sequence_as((args, kwargs), values)
            with AutocastScope(autocast.dtype if autocast is not None else None), \
                    draws.entered_once_more():
                return fn(*inner_args, **inner_kwargs)

        if not where:
            return fn(*args, **kwargs)
        return tf.recompute_grad(inner)(*[flat[i] for i in where])
    return call


def _marked(model: keras.Model) -> Iterator[Any]:
    """The model's layers and ops that Keras marked for rematerialization."""
    seen: set[int] = set()
    for layer in model._flatten_layers(include_self=True, recursive=True):  # pylint: disable=protected-access
        for item in [layer, *getattr(layer, "operations", [])]:
            if getattr(item, "_remat_mode", None) and id(item) not in seen:
                seen.add(id(item))
                yield item


def _graph_safe(item: Any) -> None:
    """Keras's choice for `item` (per call: "larger_than" looks at output sizes), with
    `recompute` in place of Keras's keyword-breaking `tf.recompute_grad`."""
    choose = item.rematerialized_call
    if item._remat_mode.mode == "activations":  # pylint: disable=protected-access
        return  # Keras recomputes the activation alone: called with one tensor

    def rematerialized_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn if choose(fn, *args, **kwargs) is fn else recompute(fn)
    object.__setattr__(item, "rematerialized_call", rematerialized_call)


def build_with_remat(build: Callable[[], keras.Model],
                     options: RematOptions | None) -> keras.Model:
    """`build()` in `keras.RematScope(options)`, its marked layers made graph-safe."""
    if options is None:
        return build()
    with keras.RematScope(options.mode, options.output_size_threshold,
                          list(options.layer_names)):
        model = build()
    model._remat_mode = None  # pylint: disable=protected-access
    for item in _marked(model):
        _graph_safe(item)
    replay_draws_in_recomputation(model)
    return model


@contextlib.contextmanager
def remat_disabled(model: keras.Model) -> Iterator[None]:
    """Traces in it compute each activation once: what MFU counts (model FLOPs)."""
    items = list(_marked(model))
    modes = [item._remat_mode for item in items]  # pylint: disable=protected-access
    try:
        for item in items:
            object.__setattr__(item, "_remat_mode", None)
        yield
    finally:
        for item, mode in zip(items, modes):
            object.__setattr__(item, "_remat_mode", mode)
