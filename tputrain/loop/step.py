"""One optimizer step on one replica: gradients (accumulated), then the update.

Without an overridden `Task.train_step` the step is composed from
`Task.compute_gradients` (once per micro-batch), the summed gradients'
`apply_gradients` and `Task.update_metrics`: the same maths as
`Task.train_step`, but the forward/backward can be compiled on its own. The
gradients reach the optimizer unsummed; `tputrain.distribution.allreduce` sums them over
replicas before clipping.

What XLA compiles is the run plan's decision (`tputrain.loop.xla_plan`). Under a
mixed policy on a CPU, `jit_compile="auto"` compiles the optimizer's update and
each exact GELU (`ElementwiseFusion`, `exact_gelu`), which TensorFlow otherwise
runs as many small kernels; layer normalizations get a closed-form gradient,
forward and backward each a small XLA program (`layer_norm`), for the same reason.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from absl import logging

from tputrain.core import tracing
from tputrain.fault_tolerance.guard import NonFiniteGuard
from tputrain.loop.batch_norm import fused_call as fused_batch_norm_call
from tputrain.loop.inputs import zeros_of
from tputrain.loop.pipeline import UpdatePipeline
from tputrain.loop.replica_stats import forward_state
from tputrain.loop.source_counts import SourceCounter
from tputrain.loop.xla_dropout import ThreeFryDraws
from tputrain.loop.xla_plan import XlaPlan
from tputrain.distribution.strategy import without_gpus
from tputrain.runtime.model_state import ModelState
from tputrain.runtime.plan import RunPlan
from tputrain.task import Task, overrides, unpack_batch


_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@tf.function(jit_compile=True, autograph=False)
def _gelu_forward(x: tf.Tensor) -> tf.Tensor:
    xf = tf.cast(x, tf.float32)
    return tf.cast(0.5 * xf * tf.math.erfc(-xf * _SQRT_HALF), x.dtype)


@tf.function(jit_compile=True, autograph=False)
def _gelu_backward(dy: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
    xf = tf.cast(x, tf.float32)
    cdf = 0.5 * tf.math.erfc(-xf * _SQRT_HALF)  # erfc: no cancellation in the tail
    pdf = tf.exp(-0.5 * xf * xf) * _INV_SQRT_2PI
    return tf.cast(tf.cast(dy, tf.float32) * (cdf + xf * pdf), x.dtype)


@tf.custom_gradient
def exact_gelu(x: tf.Tensor) -> tuple[tf.Tensor, Callable]:
    """Keras's exact GELU, x * Phi(x), as two small XLA programs computed in float32.

    The backward recomputes Phi and phi from `x` instead of keeping float32
    intermediates: on the Transformer's bf16 activations that took less CPU time
    than Keras's GELU, compiled by XLA or not (docs/performance.md, Design
    measurements).
    """
    return _gelu_forward(x), lambda dy: _gelu_backward(dy, x)


# Measured on the Transformer (configs/synthetic_transformer.gin) in mixed_bfloat16 on a
# CPU, each forward and backward alone (docs/performance.md, Design measurements):
# `exact_gelu` and `layer_norm` beat Keras's, compiled or not; the masked Softmax is
# faster uncompiled, so it is left alone. A plain ReLU or tanh is one kernel either way.
FUSED_ACTIVATIONS: dict[Callable, Callable] = {keras.activations.gelu: exact_gelu}


def _fused_activation(activation: Any) -> Callable | None:
    """The replacement for this activation, matched by identity (an activation may be
    any callable, unhashable ones included)."""
    return next((fused for original, fused in FUSED_ACTIVATIONS.items()
                 if activation is original), None)


@tf.function(jit_compile=True, autograph=False)
def _layer_norm_forward(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor,
                        epsilon: float) -> tf.Tensor:
    return _normalized(x, epsilon)[0] * gamma + beta


@tf.function(jit_compile=True, autograph=False)
def _layer_norm_backward(dy: tf.Tensor, x: tf.Tensor, gamma: tf.Tensor,
                         epsilon: float) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    normalized, inverse = _normalized(x, epsilon)  # recomputed: nothing float32 is kept
    dyf = tf.cast(dy, tf.float32)
    leading = list(range(len(dyf.shape) - 1))
    scaled = dyf * gamma
    dx = inverse * (scaled - tf.reduce_mean(scaled, -1, keepdims=True)
                    - normalized * tf.reduce_mean(scaled * normalized, -1, keepdims=True))
    return (tf.cast(dx, x.dtype), tf.reduce_sum(dyf * normalized, leading),
            tf.reduce_sum(dyf, leading))


def _normalized(x: tf.Tensor, epsilon: float) -> tuple[tf.Tensor, tf.Tensor]:
    """(x - mean) / sigma over the last axis in float32, and 1 / sigma."""
    xf = tf.cast(x, tf.float32)
    mean, variance = tf.nn.moments(xf, axes=[-1], keepdims=True)
    inverse = tf.math.rsqrt(variance + epsilon)
    return (xf - mean) * inverse, inverse


def layer_norm(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor, epsilon: float) -> tf.Tensor:
    """Keras's layer normalization over the last axis, computed in float32, with its
    own gradient, forward and backward each one small XLA program.

    TensorFlow's automatic gradient of Keras's version runs ~25 small kernels, each a
    pass over the activations; this backward is the closed form (dx = (g - mean(g)
    - xhat * mean(g * xhat)) / sigma, g = dy * gamma), recomputing xhat and sigma from
    `x`. On the Transformer's bf16 shapes it took less CPU time, forward and
    backward, than the same closed form as TensorFlow kernels or Keras's
    (docs/performance.md, Design measurements).
    """
    @tf.custom_gradient
    def normalize(x, gamma, beta):
        return (_layer_norm_forward(x, gamma, beta, epsilon),
                lambda dy: _layer_norm_backward(dy, x, gamma, epsilon))

    return normalize(x, tf.cast(gamma, tf.float32), tf.cast(beta, tf.float32))


def _layer_norm_call(layer: keras.layers.Layer) -> Callable | None:
    """A `call` for a Keras LayerNormalization that `layer_norm` covers (last axis,
    scale and center, no RMS scaling); None for other layers."""
    if (type(layer) is not keras.layers.LayerNormalization or layer.rms_scaling
            or getattr(layer, "gamma", None) is None or getattr(layer, "beta", None) is None):
        return None

    def call(inputs, *args, **kwargs):
        rank = tf.TensorShape(inputs.shape).rank
        if args or kwargs or not rank or sorted(a % rank for a in layer.axis) != [rank - 1]:
            return type(layer).call(layer, inputs, *args, **kwargs)
        outputs = layer_norm(inputs, layer.gamma.value, layer.beta.value, layer.epsilon)
        return tf.cast(outputs, layer.compute_dtype)
    return call


def _merges_in_forward(model: Any) -> bool:
    """On several replicas, whether the forward pass may write a weight whose write
    merges the replicas' values (aggregation "sum", "mean", "only_first_replica"): a
    merge cannot run inside a `tf.while_loop`, so the micro-batches are unrolled."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return False
    return any(getattr(v, "aggregation", "none") in ("sum", "mean", "only_first_replica")
               for v in model.non_trainable_variables)

class ElementwiseFusion:
    """Small XLA programs for a model's GELUs (`FUSED_ACTIVATIONS`) and `layer_norm`
    for its layer normalizations (`elementwise`), and TensorFlow's fused kernel for
    its batch norms (`batch_norm`, `tputrain.loop.batch_norm`), used while a step traces.

    The layers are swapped back on exit, so evaluation, export and FLOP counting
    see the model unchanged. Each replacement (and its gradient) fuses what
    TensorFlow would run as ~10 kernels, each a full pass over the activations.
    """

    def __init__(self, model: keras.Model, elementwise: bool = True, batch_norm: bool = False):
        self.swaps: list[tuple[keras.layers.Layer, str, Callable]] = []
        for layer in model._flatten_layers(include_self=False, recursive=True):  # pylint: disable=protected-access
            fused = _fused_activation(getattr(layer, "activation", None))
            if elementwise and fused is not None:
                self.swaps.append((layer, "activation", fused))
            call = (_layer_norm_call(layer) if elementwise else None) or (
                fused_batch_norm_call(layer) if batch_norm else None)
            if call is not None:
                self.swaps.append((layer, "call", call))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: the swapped layers call their replacements (instance attributes)."""
        saved = [(layer, name, vars(layer).get(name)) for layer, name, _ in self.swaps]
        try:
            for layer, name, compiled in self.swaps:
                vars(layer)[name] = compiled  # no Keras tracking: a plain function
            yield
        finally:
            for layer, name, original in saved:
                if original is None:
                    vars(layer).pop(name, None)  # back to the class's method
                else:
                    vars(layer)[name] = original


def _counted(step: Callable, count: Callable[[dict[str, tf.Tensor]], None]) -> Callable:
    def counted(batch):
        logs = step(batch)
        count(logs)
        return logs
    return counted


def _drawing_threefry(step: Callable, draws: ThreeFryDraws | None) -> Callable:
    """`step`, tracing with `draws` active (Keras's random draws by ThreeFry in XLA)."""
    if draws is None or not draws.layers:
        return step

    def drawing(batch):
        with draws.active():
            return step(batch)
    return drawing


def _keeping_state(step: Callable, guard: NonFiniteGuard, variables: list[Any]) -> Callable:
    """`step`, after which a step the guard skipped leaves the weights its forward pass
    wrote (`variables`) as they were (`NonFiniteGuard.keep_if_bad`)."""
    if not variables:
        return step

    def keeping(batch):
        kept = guard.state_before(variables)
        logs = step(batch)
        guard.keep_if_bad(kept)
        return logs
    return keeping


def _traced_step(step: Callable, batch_spec: Any) -> tf.types.experimental.ConcreteFunction:
    """`step` traced once for `batch_spec`: the program's loop calls this trace, and
    sums its logs from zeros shaped like them (a while loop needs the sums' structure
    before its first step), so the step is not traced a second time inline."""
    traced = step if hasattr(step, "get_concrete_function") else tf.function(step)
    return traced.get_concrete_function(batch_spec)


def steps_program(step: Callable, steps: int, counter: tf.Variable,
                  stop: Callable[[], tf.Tensor]) -> Callable:
    """`steps` train steps in one XLA program: `run(batches, n)` -> (summed logs, steps run).

    `step` is the counted whole step (`StepBuilder.build`, one replica); `batches` are
    `steps` batches, of which the first `n` are real (fewer when the input ended). Each
    XLA program launch costs a few hundred microseconds of host work (a cache lookup,
    the variables' buffers, an executor hand-off); K steps pay it once
    (docs/performance.md). Once `stop()` says so (the guard tripped) no further step
    trains; the counter still moves past the batches taken, where the data is.
    """
    @tf.function(jit_compile=True)
    def run(batches: tuple, n: tf.Tensor) -> tuple[Any, tf.Tensor]:
        group = tf.nest.map_structure(lambda *parts: tf.stack(parts), *batches)
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), group)
        one_step = _traced_step(step, spec)

        def body(j, totals, stopped):
            del stopped
            logs = one_step(tf.nest.map_structure(lambda t: t[j], group))
            return j + 1, tf.nest.map_structure(tf.add, totals, logs), stop()

        ran, totals, _ = tf.while_loop(
            lambda j, totals, stopped: tf.logical_and(j < n, tf.logical_not(stopped)), body,
            (tf.constant(0), zeros_of(one_step.structured_outputs), tf.constant(False)),
            maximum_iterations=steps)
        counter.assign_add(tf.cast(n - ran, counter.dtype))
        return totals, ran
    return run


def _update_metrics(task: Task, metrics: list[keras.metrics.Metric], batch: Any,
                    outputs: Any) -> None:
    """The train metrics on a (micro-)batch, weighted by its sample weights if any
    (as Keras `fit` updates them)."""
    _, labels, weight = unpack_batch(batch)
    extra = {} if weight is None else {"sample_weight": weight}  # a Task's without it works
    tracing.user_call(task.update_metrics, metrics, labels, outputs, **extra)


def _computes_in_float16(model: keras.Model) -> bool:
    """Whether any layer computes, or any weight is stored, in float16."""
    layers = model._flatten_layers(include_self=True, recursive=True)  # pylint: disable=protected-access
    return (any(getattr(getattr(layer, "dtype_policy", None), "compute_dtype", None)
                == "float16" for layer in layers)
            or any(v.dtype == "float16" for v in model.variables))


class StepBuilder:
    """Builds the per-replica train step for `Trainer.jit_compile` and accumulation."""

    def __init__(self, plan: RunPlan, task: Task, state: ModelState,
                 strategy: tf.distribute.Strategy, train_element_spec: Any,
                 allreduce_dtype: str = "float32", source_counter: SourceCounter | None = None):
        """`plan`: the run's, with its XLA decision (`RunPlan.with_xla`); `state`: the
        model, optimizer, train metrics and guard the step updates."""
        self.run_plan = plan  # `without_xla` if XLA refuses the step
        self.task = task
        self.source_counter = source_counter  # a mixture: strips and counts the source ids
        self.model = state.model
        self.optimizer = state.optimizer  # the Task's own, never patched
        # What the step and the Task's own steps update through (reduce, check, apply).
        self.update = UpdatePipeline(state.optimizer, state.guard, allreduce_dtype)
        self.train_metrics = list(state.train_metrics)
        self.guard = state.guard
        self.strategy = strategy
        self.train_element_spec = train_element_spec
        # Task.compute_gradients as tputrain defines it: gradients of optimizer.scale_loss.
        self._own_gradients = not (plan.custom_train_step
                                   or overrides(task, "compute_gradients"))
        self.counted_in_step = False  # set by build()
        self._unchecked: Callable | None = None  # built with check=False, not yet lowered

    @property
    def jit_compile(self) -> bool | str:
        """The plan's: "auto" becomes False if the step does not compile."""
        return self.run_plan.jit_compile

    @property
    def global_batch_size(self) -> int:
        return self.run_plan.batch.global_batch_size

    @property
    def accumulation_steps(self) -> int:
        return self.run_plan.batch.accumulation_steps

    def xla_plan(self) -> tuple[bool, bool, str]:
        """(compile the whole step, compile forward/backward only, why): `plan`'s summary;
        the start-up line logs `why`."""
        return tuple(self.plan()[:3])

    def plan(self) -> XlaPlan:
        """What the step compiles, and why: the run plan's decision (`RunPlan.with_xla`)."""
        return self.run_plan.xla_plan

    def build(self, count: Callable[[dict[str, tf.Tensor]], None] | None = None,
              check: bool = True) -> Callable[[Any], dict[str, tf.Tensor]]:
        """The per-replica step (replica context), with accumulation and XLA as configured.

        `count(logs)` (the step counter and the guard's observation) is called in the
        step when the whole step is one XLA program, on one replica, where the logs
        need no reduction; `counted_in_step` then says so, and the loop skips it.
        `check=False` leaves jit_compile="auto"'s lowering to `checked` (a program
        of several steps that lowers has lowered this step too).
        """
        plan = self.plan()
        self.counted_in_step = False
        self._set_update_plan(plan)
        if self.run_plan.custom_train_step:
            @tracing.step_code
            def step(batch):
                return tracing.user_call(self.task.train_step, batch, self.model, self.update,
                                         self.train_metrics, self.global_batch_size)
        else:
            compute = self._compute(jit_compile=plan.gradients_only)
            apply = self._apply(jit_compile=plan.apply_only)
            fusion = (ElementwiseFusion(self.model, plan.fuse_elementwise, plan.fuse_batch_norm)
                      if plan.fuse_elementwise or plan.fuse_batch_norm else None)
            # Without accumulation, AutoGraph converts only the short path (tracing.py).
            gradients_of = (self._accumulate_gradients if self.accumulation_steps > 1
                            else self._batch_gradients)

            @tracing.step_code
            def step(batch):
                denominator, logs = self._loss_denominator(batch)
                with self.guard.scaling_loss(self._scaled_variables()):
                    with fusion.active() if fusion else contextlib.nullcontext():
                        gradients, loss = gradients_of(batch, lambda b: compute(b, denominator))
                    apply(gradients)
                return {"loss": loss, **logs}
        step = _drawing_threefry(step, self._threefry_draws(plan))
        step = _keeping_state(step, self.guard, forward_state(self.model))
        if self.source_counter is not None:
            step = self.source_counter.counting(step)
        if not plan.whole_step:
            return step
        compiled = tf.function(step if count is None else _counted(step, count),
                               jit_compile=True)
        self._unchecked = compiled if self.jit_compile == "auto" and not check else None
        if self.jit_compile == "auto" and check and not self._compiles(compiled):
            return self.build(count)  # now without XLA
        self.counted_in_step = count is not None
        return compiled

    def _set_update_plan(self, plan: XlaPlan) -> None:
        # In XLA the guard masks writes by selects, which fuse (NonFiniteGuard.select_updates).
        self.update.set_plan(select=plan.whole_step or plan.apply_only or plan.apply_per_replica,
                             each_device=plan.apply_per_replica)

    def checked(self, step: Callable, count: Callable[[dict[str, tf.Tensor]], None] | None
                ) -> Callable[[Any], dict[str, tf.Tensor]]:
        """`step` from `build(check=False)`, lowered now unless `lowered_within` said a
        program holding it lowered; the step without XLA if XLA refuses it."""
        if step is not self._unchecked:
            return step
        self._unchecked = None
        return step if self._compiles(step) else self.build(count)

    def lowered_within(self) -> None:
        """A program holding the step lowered: the step needs no lowering of its own."""
        self._unchecked = None

    def _threefry_draws(self, plan: XlaPlan) -> ThreeFryDraws | None:
        """The random draws' swap when XLA compiles the forward pass on a CPU (`xla_dropout`)."""
        if (plan.whole_step or plan.gradients_only) and without_gpus(self.strategy):
            return ThreeFryDraws(self.model)
        return None

    def _loss_denominator(self, batch: Any) -> tuple[Any, dict[str, tf.Tensor]]:
        """Replica context: what the step's loss sums are divided by, and its logs.

        The global batch size (examples), or, when the Task counts its own units
        (`Task.loss_denominator`, e.g. real tokens), their sum over every replica and
        micro-batch of the step, so the loss is the mean over the global batch's
        real tokens on any replica count. Then the step also logs `real_tokens` and
        `padding` (the share of weight-0 positions), each replica its share of the
        global figure (the loop sums the replicas' logs).
        """
        local = tracing.user_call(self.task.loss_denominator, batch)
        if local is None:
            return self.global_batch_size, {}
        local = tf.cast(tf.round(tf.cast(local, tf.float32)), tf.int64)
        context = tf.distribute.get_replica_context()
        total = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
        logs = {"real_tokens": tf.cast(local, tf.float32)}
        weight = unpack_batch(batch)[2]
        if weight is not None:
            slots = tf.cast(tf.size(weight) * context.num_replicas_in_sync, tf.float32)
            logs["padding"] = (tf.cast(tf.size(weight), tf.float32) - logs["real_tokens"]) / slots
        return total, logs

    def _scaled_variables(self) -> list[Any] | None:
        """The variables whose gradients are those of `optimizer.scale_loss(loss)`, for
        the guard's scaled check; None for a Task's own gradients or a model that
        computes in float16 anywhere (a scaled backward pass would overflow it)."""
        once = self.strategy.num_replicas_in_sync > 1 and not self.update.scales_on_each_device()
        if not self._own_gradients or _computes_in_float16(self.model) or once:
            return None  # `once`: checked once for every device (NonFiniteGuard.checking_once)
        return self.model.trainable_variables

    def _compute(self, jit_compile: bool) -> Callable:
        """Task.compute_gradients on a (micro-)batch, as its own XLA program if asked."""
        # micro_batches is passed only when accumulating, so a Task that overrides
        # compute_gradients without it still works without accumulation.
        extra = {"micro_batches": self.accumulation_steps} if self.accumulation_steps > 1 else {}

        def compute(batch, denominator):
            return tracing.user_call(self.task.compute_gradients, batch, self.model,
                                     self.update, denominator, **extra)
        return tf.function(compute, jit_compile=True) if jit_compile else compute

    def _apply(self, jit_compile: bool) -> Callable[[list[Any]], None]:
        """The update pipeline; with `jit_compile`, the update alone is an XLA program
        (with the guard's check and select in it; on one replica the pipeline's
        all-reduce does nothing)."""
        variables = self.model.trainable_variables
        if jit_compile:
            compiled = tf.function(lambda grads: self.update.apply(grads, variables),
                                   jit_compile=True)
            return lambda gradients: compiled(list(gradients))

        def apply(gradients):
            self.update.apply_gradients(zip(gradients, variables))
        return apply

    def _compiles(self, compiled: Callable) -> bool:
        """jit_compile="auto": whether XLA can compile the step (lowered, not run).

        A step XLA refuses (an op without an XLA kernel, e.g. a py_function) then
        runs uncompiled, with a log line naming the reason, instead of failing.
        """
        why = self.refusal(compiled, self.zero_batch())
        if why is None:
            return True
        logging.warning("tputrain: jit_compile='auto': the step does not compile with XLA "
                        "(%s); it runs without XLA", why)
        self.run_plan = self.run_plan.without_xla()
        return False

    def zero_batch(self) -> Any:
        """A train batch of zeros, for lowering the step without running it."""
        return zeros_of(self.train_element_spec)

    def refusal(self, function: Callable, *args: Any) -> str | None:
        """Why XLA cannot lower `function(*args)` in a replica context ("Error: line"),
        or None if it can (lowered to HLO, not compiled or run).

        `function` holds the step. An error while tracing it with XLA is XLA's refusal
        only if the step traces without XLA (`user_error`): a user's own error (a wrong
        key, a shape mismatch in a Task's or model's code) is raised as that trace
        raises it, once, and the plan stays. An error while lowering a traced step is
        XLA's (an op without an XLA kernel, e.g. a py_function)."""
        try:
            self.strategy.run(lambda *a: function.get_concrete_function(*a), args=args)
            traced = None
        except Exception as error:  # pylint: disable=broad-except  # any, in the user's code
            # e.g. a merge_call inside the XLA function (MirroredStrategy on one device,
            # whose optimizer aggregates through one): a refusal, it traces without XLA.
            traced = error
        if traced is not None:
            user = self.user_error()
            if user is not None:
                raise user  # outside the except: one traceback, the user's
            return f"{type(traced).__name__}: {tracing.error_line(traced)}"
        try:  # traced above: lowering reuses that trace
            self.strategy.run(lambda *a: function.experimental_get_compiler_ir(*a)(
                stage="hlo"), args=args)
        except (tf.errors.OpError, ValueError, TypeError, RuntimeError) as error:
            return f"{type(error).__name__}: {tracing.error_line(error)}"
        return None

    def user_error(self) -> Exception | None:
        """The error the step raises traced as it would run once XLA refused it (the
        plan `without_xla`, `strategy.run` inside a `tf.function`, on a zero batch), or
        None if it traces. The builder's plan and state are left as they were. Asked
        only after a trace with XLA failed: a step that compiles pays nothing for it."""
        saved = (self.run_plan, self.counted_in_step, self._unchecked)
        self.run_plan = self.run_plan.without_xla()
        try:
            step = self.build()  # without XLA: the plain step, not traced yet
            tf.function(lambda batch: self.strategy.run(step, args=(batch,))
                        ).get_concrete_function(self.zero_batch())
        except Exception as error:  # pylint: disable=broad-except  # the user's, whatever it is
            return error
        finally:
            self.run_plan, self.counted_in_step, self._unchecked = saved
            self._set_update_plan(self.plan())
        return None

    def _batch_gradients(self, batch: Any, compute: Callable) -> tuple[list[Any], tf.Tensor]:
        """Replica context: the gradients and loss of one batch (no accumulation)."""
        gradients, loss, outputs = compute(batch)
        _update_metrics(self.task, self.train_metrics, batch, outputs)
        return list(gradients), loss

    def _accumulate_gradients(self, batch: Any, compute: Callable) -> tuple[list[Any], tf.Tensor]:
        """Replica context: gradients and loss summed over the step's micro-batches.

        Each micro-batch's loss is already divided by the *global* batch, so the sums
        equal the gradients and loss of the whole step's batch.
        """
        if self.accumulation_steps == 1:
            return self._batch_gradients(batch, compute)
        variables = self.model.trainable_variables
        unused = set()  # indices of variables without a gradient: they stay None, not zero

        def micro_step(i, sums, loss):
            micro = tf.nest.map_structure(lambda t: t[i], batch)
            gradients, micro_loss, outputs = compute(micro)
            _update_metrics(self.task, self.train_metrics, micro, outputs)
            new_sums = []
            for index, (total, gradient) in enumerate(zip(sums, gradients)):
                if gradient is None:
                    unused.add(index)
                    new_sums.append(total)
                else:  # IndexedSlices (embeddings) become dense sums
                    new_sums.append(total + tf.cast(tf.convert_to_tensor(gradient), total.dtype))
            return i + 1, new_sums, loss + tf.cast(micro_loss, tf.float32)

        state = (tf.constant(0), [tf.zeros(v.shape, v.dtype) for v in variables],
                 tf.constant(0.0, tf.float32))
        if _merges_in_forward(self.model):  # a merge cannot run inside a while loop
            for _ in range(self.accumulation_steps):
                state = micro_step(*state)
        else:
            state = tf.while_loop(lambda i, *_: i < self.accumulation_steps, micro_step, state)
        _, sums, loss = state
        return [None if i in unused else s for i, s in enumerate(sums)], loss
