"""The non-finite guard: NaN/Inf losses or gradients never reach the weights.

Checked inside the compiled step, where it is nearly free: the gradients' global
norm (inside XLA the same computation as global-norm clipping's), taken after
they are summed over replicas (so every replica makes the same decision without
another all-reduce). A step with a non-finite loss or
gradient does not update the weights or the optimizer's state (the optimizer's
apply is skipped, as Keras's loss-scale optimizer does for overflow; inside an
XLA program, on one replica or on each device of several (`tputrain.loop.update`),
each of its writes keeps the old value instead, see `select_updates`); the weights
its forward pass wrote (batch norm's moving statistics) keep their values from
before it (`keep_if_bad`), and then,
by `policy`:

* "raise" (default): the loop stops and `NonFiniteError` names the step;
  the weights are those before that step, and no checkpoint is written.
* "skip": training goes on; skipped steps are counted (`nonfinite_steps` in
  the logs and TensorBoard). The step counter still advances, because the
  batch was consumed.
* "rollback": the model, optimizer and dropout RNG are restored from the last
  checkpoint, the data position is *not* (the batches since are skipped, as
  large-model practice does for loss spikes), and training continues; more than
  `max_rollbacks` rollbacks raise `NonFiniteError`.
* None: no checks at all (to measure what they cost: `benchmarks/resume.py`).

Under mixed_float16 the Keras `LossScaleOptimizer` already skips overflowing
steps and lowers its scale; the guard then watches only the loss, since
non-finite scaled gradients are expected there.

The scaled check (`scaled_check`, on by default): where the update is inside an
XLA program (on one replica, or on each device of several with gradients crossing
in float32 or bfloat16) and `Task.compute_gradients` is not overridden, the
guard scales the loss by a power of two through `optimizer.scale_loss` (as Keras's
loss scaling does; 2^75 for 1M weights, `check_scale`) and unscales the gradients
before the update. A gradient large enough that the squared global norm could
overflow float32 then overflows itself, so one plain sum of the gradients, a pass
XLA's CPU backend runs on the gradients as they are, tells every non-finite case
apart. Powers of two scale exactly: the update is the one the exact check gives.
Turn it off for a model with a custom gradient that is not linear in its upstream
gradient (one that clips it, say), which would see the scaled values. Not used for
float16 weights or layers.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Mapping

import keras
import tensorflow as tf

from tputrain.core import tracing

POLICIES = ("raise", "skip", "rollback", None)


class NonFiniteError(FloatingPointError):
    """Training produced a NaN/Inf loss or gradient (policy 'raise' or too many rollbacks)."""


@tracing.graph_helper
def _all_finite(values: list[Any]) -> tf.Tensor:
    """Whether every element of these values is finite: NaN and Inf propagate through
    a sum, so one sum of sums tells (a sum past float32's range counts as not
    finite). The square root of the magnitude keeps XLA from copying the sum into
    every op that reads the verdict (see `_gradients_finite`)."""
    sums = [tf.reduce_sum(tf.cast(v, tf.float32)) for v in values]
    if not sums:
        return tf.constant(True)
    return tf.math.is_finite(tf.sqrt(tf.abs(tf.add_n(sums))))


def check_scale(weights: int) -> float:
    """The loss scale of the scaled check for this many weights: 2^(65 + ceil(log2(n)/2)).

    An element overflows once scaled iff |g| >= 2^(63 - ceil(log2(n)/2)), so below
    that every element's square is finite and so is the squared global norm (at most
    n * 2^(126 - log2(n)) = 2^126), which Adafactor's and LAMB's norms, and clipping,
    need: the bound `_gradients_finite` uses too. 2^75 for 1M weights (|g| < 2^53).
    """
    return 2.0 ** (65 + math.ceil(math.log2(max(weights, 1)) / 2))


@tracing.graph_helper
def _float_gradients(gradients: list[Any]) -> list[Any]:
    """The floating-point gradients as float32 dense values (a sparse one: its values)."""
    floating = [g for g in gradients if g is not None and tf.as_dtype(g.dtype).is_floating]
    return [tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g, tf.float32)
            for g in floating]


def _scaled_gradients_finite(gradients: list[Any]) -> tf.Tensor:
    """The check on gradients of a loss scaled by `check_scale`: whether their sum is
    finite. NaN and Inf propagate through a sum (Inf - Inf is NaN), and an element
    large enough to overflow the squared global norm is itself Inf here. XLA runs
    each sum on the gradient as it is (no elementwise pass before it). A step whose
    gradients sum past the same bound is also counted non-finite."""
    return _all_finite(_float_gradients(gradients))


def _unscaled(gradient: Any, scale: float, bad: tf.Tensor) -> Any:
    """`gradient / scale`, exact (a power of two); in XLA it fuses into the update.

    A 0-d or 1-element gradient is unscaled by a factor known only at run time (a
    select on the step's verdict: 0 on a `bad` step, whose writes are masked anyway),
    to work around an XLA rewrite: its algebraic simplifier turns (a * c1) * (b * c2),
    for scalar constants c1 and c2, into (a * b) * (c1 * c2). Adam's square of such a
    gradient became (g * g) * (c * c): g * g overflows to Inf, c * c = 1 / scale^2 is
    below float32's normal range and XLA's CPU flushes it to zero, and Inf * 0 put a
    NaN in the weight and its slot. Larger gradients keep the constant (a broadcast,
    which the rule does not match), so their programs stay those of the exact check.
    """
    if gradient is None or not tf.as_dtype(gradient.dtype).is_floating:
        return gradient
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    elements = values.shape.num_elements()
    if elements is not None and elements > 1:
        factor = tf.constant(1 / scale, gradient.dtype)
    else:
        factor = tf.cast(tf.where(bad, 0.0, 1 / scale), gradient.dtype)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor


@tracing.graph_helper
def _gradients_finite(gradients: list[Any], in_xla: bool = False,
                      clipping: bool = False) -> tf.Tensor:
    """Whether the gradients' squared global norm is finite.

    Stricter than "every element is finite", as it must be: a gradient of 1e20 is
    finite, but its square is not, and global-norm clipping then scales every
    gradient by NaN, and Adam's second moment becomes inf for good.

    How (the cheapest measured on the MLP's 1.6M weights: docs/performance.md, Design measurements):
    * without XLA, `l2_loss`: one kernel per gradient (a square and a sum is two);
    * in an XLA program whose optimizer clips by global norm (`clipping`), the ops
      of Keras's `clip_by_global_norm` (`_clipping_norm_finite`): XLA computes the
      two as one, so nothing (sparse gradients included);
    * in an XLA update with the loss scaled (`NonFiniteGuard.scaled_check`):
      `_scaled_gradients_finite`, one plain sum a gradient;
    * in other XLA programs, the largest magnitude (NaN counted as inf) against
      sqrt(float32 max / number of weights), which bounds the squared norm: cheaper
      than XLA's CPU sums of squares. Either way the op before the
      reduction is a pass of its own: XLA's CPU reductions (YNNPACK) fuse no
      producer (docs/performance.md). A step with one element of 1e16 among 3.5M
      weights is then skipped too.
    The square root keeps XLA from copying the sum (one add per variable) into
    every variable's update. Sparse (embedding) gradients: their values (under
    clipping, as clipping sums them).
    """
    if in_xla and clipping:
        return _clipping_norm_finite(gradients)
    values = _float_gradients(gradients)
    if not values:
        return tf.constant(True)
    sizes = [v.shape.num_elements() for v in values]  # None if not static: no bound
    if in_xla and not clipping and None not in sizes:
        largest = tf.reduce_max(tf.stack([tf.reduce_max(tf.where(
            tf.math.is_nan(v), math.inf, tf.abs(v))) for v in values]))
        return largest < math.sqrt(tf.float32.max / max(sum(sizes), 1))
    return tf.math.is_finite(tf.sqrt(_square_sum(values, in_xla)))


def _clipping_norm_finite(gradients: list[Any]) -> tf.Tensor:
    """Whether Keras's global-norm clipping's norm is finite, computed by the very ops of
    its `global_norm`, so that XLA computes the two as one. A sparse gradient's squares
    go through Keras's own densifying sum, where the sum of its values' squares would
    be a pass of its own over them."""
    floating = [g for g in gradients if g is not None and tf.as_dtype(g.dtype).is_floating]
    if not floating:
        return tf.constant(True)
    squares = [keras.ops.sum(keras.ops.square(g)) for g in floating]
    return tf.math.is_finite(keras.ops.sqrt(keras.ops.sum(keras.ops.stack(squares))))


@tracing.graph_helper
def _square_sum(values: list[Any], in_xla: bool = False) -> tf.Tensor:
    """Half the squared global norm (`l2_loss`, one kernel a value) or, in XLA, all of
    it: finite exactly when the norm's square is. Sparse gradients: their values."""
    values = _float_gradients(values)
    square_sum = (lambda v: tf.reduce_sum(tf.square(v))) if in_xla else tf.nn.l2_loss
    return tf.reduce_sum(tf.stack([square_sum(v) for v in values]))


def _size(gradient: Any) -> int:
    """Elements of a gradient (a sparse one: its values), 1 if not static."""
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    return int(values.shape.num_elements() or 1)


class NonFiniteGuard:
    """Detects non-finite losses/gradients in the compiled step and applies `policy`.

    Args:
      policy: "raise", "skip", "rollback" or None (see the module docstring).
      max_rollbacks: with "rollback", how many rollbacks before giving up.
      check_gradients: also check gradients (skips the update in-step); False
        checks only the step's logged loss, after the update.
      scaled_check: where the update is inside an XLA program (one replica, or each
        device of several), check
        gradients of a loss scaled by a power of two with one plain sum
        (docs/fault_tolerance.md);
        False for a model whose custom gradients are not linear in their input.
    """

    def __init__(self, policy: str | None = "raise", max_rollbacks: int = 3,
                 check_gradients: bool = True, scaled_check: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"NonFiniteGuard.policy must be one of {POLICIES}, got {policy!r}")
        if max_rollbacks < 0:
            raise ValueError(f"NonFiniteGuard.max_rollbacks must be >= 0, got {max_rollbacks}")
        self.policy = policy
        self.max_rollbacks = int(max_rollbacks)
        self.check_gradients = check_gradients
        self.scaled_check = bool(scaled_check)
        self.rollbacks = 0
        self._built = False
        self._select = False
        self._scale = 0.0  # the loss scale while a scaled step traces (scaling_loss)
        self._verdict: tf.Tensor | None = None  # while per-device updates trace

    def build(self) -> None:
        """Creates the guard's variables; call inside `strategy.scope()`."""
        def counter(name):
            return tf.Variable(0, dtype=tf.int64, trainable=False, name=name,
                               aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

        self.nonfinite_steps = counter("nonfinite_steps")  # cumulative, checkpointed
        self.tripped_at = counter("nonfinite_tripped_at")  # first bad step this loop, or 0
        self._gradients_bad = counter("nonfinite_gradients")  # set by the update pipeline (record)
        self._built = True

    # ------------------------------------------------------- inside the step

    @tracing.graph_helper
    def guards(self, optimizer: keras.optimizers.Optimizer) -> bool:
        """Whether this optimizer's updates are checked in-step (`tputrain.loop.pipeline`).

        Not with no policy or `check_gradients=False`, nor for a loss-scale optimizer,
        which skips overflowing steps itself (see the module docstring).
        """
        return (self.policy is not None and self.check_gradients
                and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer))

    @property
    def selecting(self) -> bool:
        """Whether a bad step's writes are masked by selects (`select_updates`)."""
        return self._select

    @tracing.graph_helper
    def gradients_bad(self, grads: list[Any]) -> tf.Tensor:
        """The exact check outside XLA: whether the gradients' squared norm is not finite."""
        return tf.logical_not(_gradients_finite(grads))

    @tracing.graph_helper
    def record(self, bad: tf.Tensor) -> None:
        """Notes this step's gradient verdict for `observe`."""
        self._gradients_bad.assign(tf.cast(bad, tf.int64))

    @tracing.graph_helper
    def scaled_loss(self, optimizer: keras.optimizers.Optimizer, loss: tf.Tensor) -> tf.Tensor:
        """`loss` (already the optimizer's `scale_loss`) times the scaled check's power of
        two while a scaled step traces (`scaling_loss`); unchanged otherwise."""
        if not self._scaling(optimizer):
            return loss
        if loss.dtype == tf.float16:  # the scale is not a float16
            loss = tf.cast(loss, tf.float32)
        return loss * tf.constant(self._scale, loss.dtype)

    @tracing.graph_helper
    def state_before(self, variables: list[Any]) -> list[tuple[Any, tf.Tensor]]:
        """Before a step's forward pass: `variables` (the weights it writes, batch
        norm's moving statistics: not the optimizer's, so its skip leaves them) with
        their values, for `keep_if_bad`."""
        if self.policy is None or not self.check_gradients:
            return []
        return [(v, tf.identity(tf.convert_to_tensor(v))) for v in variables]

    @tracing.graph_helper
    def keep_if_bad(self, kept: list[tuple[Any, tf.Tensor]]) -> None:
        """After the update: on a step whose gradients were bad (`record`), the weights
        `state_before` took keep their values from before its forward pass."""
        if not kept:
            return
        bad = self._gradients_bad.read_value() > 0
        for variable, old in kept:
            variable.assign(tf.where(bad, old, tf.convert_to_tensor(variable)))

    def scales(self, optimizer: keras.optimizers.Optimizer) -> bool:
        """Whether the step tracing now checks scaled gradients (`scaling_loss`): each
        update then checks and unscales its own, and needs no check made for it."""
        return self._scaling(optimizer)

    @tracing.graph_helper
    def _scaling(self, optimizer: keras.optimizers.Optimizer) -> bool:
        """Whether the loss is scaled (and the gradients unscaled in the update). With
        global-norm clipping the exact check is free (XLA shares clipping's norm); with
        the optimizer's own `loss_scale_factor`, its threshold would shift. Never for
        an optimizer the guard does not check (`guards`): nothing would unscale."""
        return (self._scale > 0 and self.guards(optimizer)
                and not getattr(optimizer, "global_clipnorm", None)
                and getattr(optimizer, "loss_scale_factor", None) is None)

    def select_updates(self, on: bool) -> None:
        """With `on`, a bad step's writes are masked by selects instead of skipped by a
        conditional (`select_apply`); for an update inside an XLA program, on one
        replica or on each device (`StepBuilder` sets it from its plan). On several
        devices each program makes the scaled check on its own copy of the summed
        gradients (the same on every device, so is the verdict); the exact check is
        made once for all of them (`checking_once`).

        Each write of the optimizer (`assign`, `assign_add`, `assign_sub`, the weight
        decay) keeps the old value on a bad step; in XLA the select fuses into the
        elementwise update, which stays in place. A conditional cost 8% of an MLP step
        in one program (copies of every variable), and 3-10% as two programs with the
        decision in TensorFlow between them.
        """
        self._select = bool(on)

    @contextlib.contextmanager
    def scaling_loss(self, variables: list[Any] | None) -> Iterator[None]:
        """Around a train step's trace: given the `variables` its gradients are for
        (gradients of `optimizer.scale_loss(loss)`; None if not), with `scaled_check`
        and an update in XLA (`select_updates`), the loss is scaled and the update
        unscales the gradients (the scaled check, module docstring). Both are decided
        in one trace, so they always go together; outside it (FLOP counting, a user's
        own action) `scale_loss` is Keras's own. The caller passes None for a model
        computing in float16, whose range a scaled backward pass would overflow."""
        saved = self._scale
        on = variables is not None and self._select and self.scaled_check
        weights = sum(int(v.shape.num_elements() or 0) for v in variables or [])
        self._scale = check_scale(weights) if on else 0.0
        try:
            yield
        finally:
            self._scale = saved

    @contextlib.contextmanager
    def checking_once(self, strategy: tf.distribute.Strategy, grads: list[Any]
                      ) -> Iterator[None]:
        """Cross-replica context, gradients summed over replicas (the same on every
        device): the check made once, its passes spread over the local devices, for
        every device's update (`tputrain.loop.update`) to read instead of its own."""
        devices = strategy.extended.worker_devices
        loads = [0] * len(devices)
        partial: list[list[Any]] = [[] for _ in devices]
        copies = [strategy.experimental_local_results(g) for g in grads if g is not None]
        sized = [(_size(c[0]), c) for c in copies if tf.as_dtype(c[0].dtype).is_floating]
        for size, copy in sorted(sized, key=lambda s: -s[0]):  # the biggest first
            i = loads.index(min(loads))
            loads[i] += size
            partial[i].append(copy[i])
        sums = []
        for device, values in zip(devices, partial):
            if values:
                with tf.device(device):
                    sums.append(_square_sum(values))
        saved = self._verdict
        self._verdict = (tf.logical_not(tf.math.is_finite(tf.sqrt(tf.add_n(sums))))
                         if sums else tf.constant(False))
        try:
            yield
        finally:
            self._verdict = saved

    def select_apply(self, optimizer: keras.optimizers.Optimizer, apply: Callable,
                     grads: list[Any], trainable_variables: Any) -> None:
        """`apply(grads, trainable_variables)`, the optimizer's own, with every write
        masked by the gradients' verdict.

        Variables it writes some other way (the step counter, an EMA, a custom
        optimizer's direct `variable.assign`) are put back by a select at the end.
        """
        if self._verdict is not None:  # made once for every device (checking_once)
            bad = self._verdict
        elif self._scaling(optimizer):
            bad = tf.logical_not(_scaled_gradients_finite(grads))
            grads = [_unscaled(g, self._scale, bad) for g in grads]
        else:
            bad = tf.logical_not(_gradients_finite(
                grads, in_xla=True, clipping=bool(getattr(optimizer, "global_clipnorm", None))))
        if trainable_variables is None:
            trainable_variables = getattr(optimizer, "_trainable_variables", [])
        watched = {_key(v): v for v in [*trainable_variables, *optimizer.variables]}
        old = {key: tf.convert_to_tensor(v) for key, v in watched.items()}
        masked: set[int] = set()
        with _masked_writes(optimizer, bad, masked), tf.control_dependencies(list(old.values())):
            apply(grads, trainable_variables)
        for key, variable in watched.items():  # ordered after the update's writes
            if key not in masked:
                variable.assign(tf.where(bad, old[key], tf.convert_to_tensor(variable)))
        self._gradients_bad.assign(tf.cast(bad, tf.int64))

    @tracing.graph_helper
    def observe(self, logs: Mapping[str, tf.Tensor], step: tf.Variable) -> None:
        """After each train step, records a non-finite step: in cross-replica context
        on the replica-summed logs, or inside the step's XLA program on one replica
        (`tputrain.loop.step.StepBuilder.build`)."""
        if self.policy is None:
            return
        values = [v for v in logs.values() if tf.as_dtype(v.dtype).is_floating]
        bad = tf.logical_not(_all_finite(values))
        if self.check_gradients:
            bad = tf.logical_or(bad, self._gradients_bad.read_value() > 0)
            self._gradients_bad.assign(0)

        # Arithmetic, not a tf.cond: a conditional here cost a few % of a small step.
        self.nonfinite_steps.assign_add(tf.cast(bad, tf.int64))
        if self.policy != "skip":
            first = tf.logical_and(bad, tf.equal(self.tripped_at, 0))
            self.tripped_at.assign(tf.where(first, tf.cast(step, tf.int64), self.tripped_at))

    @tracing.graph_helper
    def should_stop(self) -> tf.Tensor:
        """Whether the loop must stop before its next step (not under "skip")."""
        if self.policy in (None, "skip"):
            return tf.constant(False)
        return self.tripped_at.read_value() > 0

    # ---------------------------------------------------- between host loops

    def take_trip(self) -> int:
        """Returns the step that tripped the guard in the last loop (0: none); resets it."""
        step = int(self.tripped_at.numpy())
        if step:
            self.tripped_at.assign(0)
        return step

    def message(self, step: int, gave_up: bool = False, no_checkpoint: bool = False) -> str:
        """The one-line error for a non-finite step, naming what to do."""
        text = (f"non-finite loss or gradients at step {step}; the update was not applied and "
                "nothing was checkpointed")
        if gave_up:
            return (f"{text}, after {self.max_rollbacks} rollbacks: lower the learning rate or "
                    "check the data, or raise NonFiniteGuard.max_rollbacks")
        if no_checkpoint:
            return (f"{text}, and there is no checkpoint to roll back to yet: lower "
                    "Trainer.checkpoint_every or the learning rate, or set "
                    "NonFiniteGuard.policy = 'skip'")
        return (f"{text}. Lower the learning rate, check the inputs of that step, or set "
                "NonFiniteGuard.policy = 'skip' or 'rollback'")


def _key(variable: Any) -> int:
    """One identity for a Keras variable and the tf.Variable it wraps."""
    return id(variable.value) if isinstance(variable, keras.Variable) else id(variable)


def _masked(bad: tf.Tensor, variable: Any, value: Any, keep: str) -> Any:
    """`value` on a good step; on a bad one the variable's own value (`keep="old"`)
    or zeros (`keep="zero"`, for an increment). Sparse values stay sparse."""
    if isinstance(value, tf.IndexedSlices):
        old = (tf.gather(tf.convert_to_tensor(variable), value.indices) if keep == "old"
               else tf.zeros_like(value.values))
        return tf.IndexedSlices(tf.where(bad, old, value.values), value.indices,
                                value.dense_shape)
    value = tf.convert_to_tensor(value)
    old = tf.convert_to_tensor(variable) if keep == "old" else tf.constant(0, value.dtype)
    return tf.where(bad, tf.cast(old, value.dtype), value)  # a scalar 0 broadcasts


@contextlib.contextmanager
def _masked_writes(optimizer: keras.optimizers.Optimizer, bad: tf.Tensor,
                   masked: set[int]) -> Iterator[None]:
    """While the optimizer's apply traces: its `assign`, `assign_add` and `assign_sub`
    write the old value (or add zero) on a bad step, and its weight decay is 0 then.
    The keys of the variables so written are added to `masked`.

    Why instance attributes, for a while: every write of a Keras optimizer's update
    goes through these methods, and Keras offers no hook to mask them; they are set
    on entering this block and put back (or removed) on leaving it by any exit, an
    error in the user's optimizer included, so the optimizer is as built outside the
    trace (`tests/loop/test_pipeline.py`). Entered from one thread at a time: the masked
    update runs in cross-replica context or on one replica (`select_updates`)."""
    def writer(name: str, keep: str):
        write = getattr(optimizer, name)

        def masked_write(variable, value):
            masked.add(_key(variable))
            return write(variable, _masked(bad, variable, value, keep))
        return masked_write

    overrides = {"assign": writer("assign", "old"), "assign_add": writer("assign_add", "zero"),
                 "assign_sub": writer("assign_sub", "zero")}
    decay = getattr(optimizer, "weight_decay", None)
    if decay is not None:
        overrides["weight_decay"] = tf.where(bad, tf.constant(0.0, tf.float32),
                                             tf.cast(decay, tf.float32))
    saved = {name: vars(optimizer)[name] for name in overrides if name in vars(optimizer)}
    try:
        for name, value in overrides.items():
            setattr(optimizer, name, value)  # instance attributes: only this optimizer
        yield
    finally:
        for name in overrides:
            if name in saved:
                setattr(optimizer, name, saved[name])
            else:
                delattr(optimizer, name)
