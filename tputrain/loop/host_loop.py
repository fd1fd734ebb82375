"""Many steps in one `tf.function`: the host loop.

The host pays Python and dispatch overhead once per loop of `num_steps` steps
(a `tf.while_loop`) instead of once per step. Every step, the first too, runs
from the one call in the loop, its sums started at zeros of the step's logs
(`HostLoop.log_zeros`) or, where the step is inlined (several replicas), carried
from empty (`log_sums.CarriedSums`): the loop's graph holds the step once a
replica, traced once. Steps stop cleanly when the data ends
(`get_next_as_optional`), so a partial loop is never replayed; a loop whose
first fetch finds none fails ("input exhausted").

Input wait: one fetch (`get_next`) per step, or per `steps_per_fetch` steps when
training, bracketed by two timestamps. The loop body of the previous step has
finished when the first runs (a while-loop iteration starts once the last one's
stateful ops are done); the second runs once the batch is there, and the step's
ops wait for it, so the executor cannot slip the step's work in between. The
difference is the time the loop was blocked on input, including the fetch's own
hand-off cost.

Several steps per XLA program (`program_loop`, `Trainer.steps_per_program`): each
iteration reads `program_steps` batches and launches one program that runs them
all, so the launch's host work is paid once for them. A loop whose length it does
not divide ends with one launch of the same program on fewer batches.

Every loop length runs one traced program: the length is a tensor argument (the
while loop's trip count, and the last program's step count), so a last loop
shorter than `steps_per_loop`, or a resume at an odd step, compiles nothing new.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from absl import logging

from tputrain.core import tracing
from tputrain.distribution.strategy import without_gpus
from tputrain.optim.ema import ExponentialAverage
from tputrain.fault_tolerance.guard import NonFiniteGuard
from tputrain.loop.convolutions import has_convolutions
from tputrain.loop.inputs import Inputs, zeros_of
from tputrain.loop.log_sums import CarriedSums
from tputrain.loop.step import StepBuilder, steps_program
from tputrain.options import program_steps

EXHAUSTED = "tputrain: input exhausted"


def op_determinism() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` is on (no public getter)."""
    from tensorflow.python.framework import config as tf_config  # TF internals, not ours

    return bool(getattr(tf_config, "is_op_determinism_enabled", lambda: False)())


@tracing.graph_helper
def count_step(step: tf.Variable, guard: NonFiniteGuard, logs: dict[str, tf.Tensor],
               ema: ExponentialAverage | None = None) -> None:
    """After a train step: advance the counter and let the guard observe the step's
    logs (summed over replicas, or the one replica's inside an XLA step); then the
    EMA weights take the step in, unless the guard counted it non-finite."""
    skipped = guard.nonfinite_steps.read_value() if ema is not None else None
    step.assign_add(1)
    guard.observe(logs, step)
    if ema is not None:
        ema.update(applied=tf.equal(guard.nonfinite_steps.read_value(), skipped))


class HostLoop:
    """`loop(iterator, num_steps)` -> (summed logs, steps run, seconds waiting for input).

    Training loops (`count_steps`) advance the step counter, let the guard observe
    each step (`count_step`) and stop early when `stop_requested()` says so (guard
    trip, SIGTERM). `counted_in_step`: the step does the counting itself (a whole step
    in one XLA program on one replica, `StepBuilder.build`), where its dozen small
    ops fuse instead of each costing the executor a few microseconds a step.
    """

    def __init__(self, replica_step: Callable, inputs: Inputs, count_steps: bool,
                 step: tf.Variable | None = None, guard: NonFiniteGuard | None = None,
                 stop_requested: Callable[[], Any] = lambda: False,
                 counted_in_step: bool = False, program: Callable | None = None,
                 program_steps: int = 1, ema: ExponentialAverage | None = None):
        self.replica_step = replica_step
        self.ema = ema  # the EMA weights a counted step updates (count_step)
        self.inputs = inputs
        self.strategy = inputs.strategy
        self.count_steps = count_steps
        self.counted_in_step = counted_in_step
        self.step, self.guard = step, guard
        self.stop_requested = stop_requested
        # Host-mode training fetches groups (see `Inputs.fetch_groups`), even of one step.
        self.grouped = count_steps and inputs.plan.input_mode == "host"
        self.fetch = inputs.plan.steps_per_fetch if self.grouped else 1
        self.loop = tracing.loop_function(self._loop)  # the step converts user code
        # The step traced once (`log_zeros` and the loop); the counting stays in the loop's own
        # graph (in a nested function, a mirrored counter's update also ran for a fetch
        # that had no batch: tests/test_trainer.py::test_finite_train_data_stops_cleanly).
        # With several replicas (local devices or workers) it stays inline: a collective
        # all-reduce (CPU MirroredStrategy's default, MultiWorkerMirrored's) in a nested
        # function under the loop's `tf.cond` fails to run (tests/core/test_tracing.py).
        self._replica_call = (tracing.once(self.replica_logs)
                              if self.strategy.num_replicas_in_sync == 1 else self.replica_logs)
        # An inlined step's sums start empty: a trace for their structure would trace
        # the model again on every replica (`log_sums.py`).
        self._carried = (None if hasattr(self._replica_call, "get_concrete_function")
                         else CarriedSums())
        # `program` (step.steps_program) runs up to `program_steps` steps a launch: it
        # then serves every loop (`program_loop`), the last launch of a loop on fewer.
        self.program, self.program_steps = program, program_steps
        self.program_loop = tf.function(self._program_loop)

    def run(self, iterator, num_steps: int) -> tuple[Any, tf.Tensor, tf.Tensor]:
        """`program_loop` where there is a program of several steps, else `loop`, each
        given `num_steps` as a tensor (one trace serves every length); a training loop
        adds a mixture's per-source counts to their totals."""
        if self.program is not None:
            result = self.program_loop(iterator, tf.constant(num_steps, tf.int32))
        else:
            result = self.loop(iterator, tf.constant(num_steps, tf.int32))
        if self.count_steps and self.inputs.source_counter is not None:
            self.inputs.source_counter.record(result[0])  # a mixture's per-source counts
        return result

    def traced_programs(self) -> int:
        """How many train programs (graphs of `loop` or `program_loop`) were traced so far,
        each of which runs a new executor function and compiles its XLA programs: one
        serves every loop length (the length is a tensor)."""
        return sum(f.experimental_get_tracing_count() for f in (self.loop, self.program_loop))

    @tracing.step_code
    def replica_logs(self, batch: Any) -> dict[str, tf.Tensor]:
        """The step on every replica; its logs summed over them."""
        per_replica = self.strategy.run(self.replica_step, args=(batch,))
        return {name: self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                for name, value in per_replica.items()}

    def one_step(self, batch: Any) -> dict[str, tf.Tensor]:
        logs = self._replica_call(batch)
        # Outside strategy.run: a mirrored counter diverges inside it.
        if self.count_steps and not self.counted_in_step:
            count_step(self.step, self.guard, logs, self.ema)
        return logs

    @tracing.graph_helper
    def _next_value(self, iterator) -> tuple[tf.Tensor, Any]:
        if not self.grouped:
            return self.inputs.next(iterator)
        optional = iterator.get_next_as_optional()
        return optional.has_value(), optional

    @tracing.graph_helper
    def timed_next(self, iterator) -> tuple[tf.Tensor, Any, tf.Tensor, tf.Tensor]:
        """(has_value, value, seconds waited, tensor the batch must wait for)."""
        if op_determinism():  # tf.timestamp is refused under op determinism
            has_value, value = self._next_value(iterator)
            return has_value, value, tf.constant(0.0, tf.float64), has_value
        start = tf.timestamp()
        has_value, value = self._next_value(iterator)
        end = _after(has_value, tf.timestamp)
        return has_value, value, end - start, end

    @tracing.graph_helper
    def batches_of(self, value: Any, ready: tf.Tensor) -> Any:
        """The fetched group of batches (host training), else the step's batch."""
        with tf.control_dependencies([ready]):
            return value.get_value() if self.grouped else self.inputs.distribute(value)

    @tracing.graph_helper
    def step_batch(self, batches: Any, j: tf.Tensor) -> Any:
        """Step `j`'s batch of a fetched group (host training), else the step's batch."""
        return self.inputs.distribute_from_group(batches, j) if self.grouped else batches

    def log_zeros(self, iterator) -> Any:
        """Zeros shaped like the summed logs of a step, for the loop's sums to start from
        (0 + x is x: the sums are bitwise those started from the first step's logs).

        From a trace of a fetch and a step that never runs, which the loop's own call
        of the step reuses: the step is its own traced function (one replica, lean
        tracing). An inlined step's sums are carried instead (`CarriedSums`).
        """
        @tracing.graph_helper
        def fetch_and_step(iterator):
            has_value, value = self._next_value(iterator)
            return self._replica_call(self.step_batch(self.batches_of(value, has_value),
                                                      tf.constant(0)))
        # Converted by AutoGraph as the loop is (with lean tracing off, the step's code).
        traced = tracing.loop_function(fetch_and_step).get_concrete_function(iterator)
        return zeros_of(traced.structured_outputs)

    def add_logs(self, totals: Any, logs: dict[str, tf.Tensor]) -> Any:
        """The sums with a step's logs added."""
        if self._carried is not None:
            return self._carried.add(totals, logs)
        return tf.nest.map_structure(tf.add, totals, logs)

    def steps_on(self, batches: Any, totals: Any, steps: tf.Tensor):
        """Runs the steps of one fetch; returns the new sums."""
        if self.fetch == 1:
            totals = self.add_logs(totals, self.one_step(self.step_batch(batches, tf.constant(0))))
            return totals, steps + 1
        # An explicit while loop, not AutoGraph's `for j in tf.range`: the loop is
        # traced without AutoGraph (`tracing.loop_function`).
        def body(j, totals, steps):
            totals, steps = self.unless_tripped(
                j, lambda: (self.add_logs(totals, self.one_step(self.step_batch(batches, j))),
                            steps + 1),
                totals, steps)
            return j + 1, totals, steps
        _, totals, steps = tf.while_loop(lambda j, totals, steps: j < self.fetch, body,
                                         (tf.constant(0, tf.int32), totals, steps))
        return totals, steps

    @tracing.graph_helper
    def unless_tripped(self, j: tf.Tensor, run: Callable, totals: Any, steps: tf.Tensor):
        """`run()` for step `j` > 0 of a fetch, unless the guard tripped on an earlier one.

        The loop checks `stop_requested` between fetches only; a guard that stops
        (raise, rollback) must also stop inside one. The step's batch was taken, so
        the counter still advances (as for a skipped step) and stays where the data is.
        A fetch's first step runs: the loop checked before taking the fetch.
        """
        if self.guard is None or self.guard.policy in (None, "skip"):
            return run()

        def untrained():
            with tf.control_dependencies([self.step.assign_add(1)]):
                return tf.nest.map_structure(tf.identity, (totals, steps))
        return tf.cond(tf.logical_and(j > 0, self.guard.should_stop()), untrained, run)

    @tracing.graph_helper
    def exhausted_unless_later(self, i: tf.Tensor, totals: Any, steps: tf.Tensor):
        """The sums of a fetch that found no batch: an error on a loop's first fetch."""
        with tf.control_dependencies([tf.debugging.Assert(i > 0, [EXHAUSTED])]):
            return tf.nest.map_structure(tf.identity, (totals, steps))

    def _loop(self, iterator, num_steps: tf.Tensor):
        """Every fetch, the first too, in one while loop: the loop's graph holds the
        step once (inlined on several replicas, where it is traced per replica)."""
        fetches = tf.maximum(num_steps // self.fetch, 1)

        # A plain while loop, not autograph's `break`s: those nest a conditional per
        # break in every iteration, each a function call for the executor.
        def more(i, had_value, totals, steps, input_wait):
            go = tf.logical_and(i < fetches, had_value)
            if self.count_steps:  # checked before the next batch is taken, from the second
                go = tf.logical_and(go, tf.logical_or(tf.equal(i, 0),
                                                      tf.logical_not(self.stop_requested())))
            return go

        def fetch_and_run(i, had_value, totals, steps, input_wait):
            del had_value
            has_value, value, waited, ready = self.timed_next(iterator)
            totals, steps = tf.cond(
                has_value,
                lambda: self.steps_on(self.batches_of(value, ready), totals, steps),
                lambda: self.exhausted_unless_later(i, totals, steps))
            return i + 1, has_value, totals, steps, input_wait + waited

        _, _, totals, steps, input_wait = tf.while_loop(
            more, fetch_and_run, (tf.constant(0, tf.int32), tf.constant(True),
                                  self.log_zeros(iterator) if self._carried is None
                                  else self._carried.start(), tf.constant(0, tf.int32),
                                  tf.constant(0.0, tf.float64)))
        if self._carried is not None:
            totals = self._carried.result(totals)
        return totals, steps, input_wait

    def _fetch_program(self, iterator, want: tf.Tensor) -> tuple[tf.Tensor, tuple, tf.Tensor]:
        """One program's batches as read one by one: (how many are real, the batches,
        seconds waited). `want` (a tensor): read only that many (all `program_steps`, or
        fewer for a loop's last, shorter program), zeros in the other places; past the
        input's end zeros stand in too. A zero batch is never trained on (the program
        runs the real ones only)."""
        start = tf.timestamp() if not op_determinism() else None
        real, batches = tf.cond(want >= self.program_steps,
                                lambda: self._read_all(iterator),
                                lambda: self._read_some(iterator, want))
        waited = (tf.constant(0.0, tf.float64) if start is None else
                  _after(real, tf.timestamp) - start)
        return real, batches, waited

    def _read_all(self, iterator) -> tuple[tf.Tensor, tuple]:
        """`program_steps` batches (zeros past the input's end) and how many are real."""
        optionals = [iterator.get_next_as_optional() for _ in range(self.program_steps)]
        real = tf.add_n([tf.cast(o.has_value(), tf.int32) for o in optionals])

        def or_zeros(optional):
            zeros = zeros_of(optional.element_spec)
            return tf.cond(optional.has_value(), optional.get_value, lambda: zeros)
        batches = tf.cond(real == self.program_steps,
                          lambda: tuple(o.get_value() for o in optionals),
                          lambda: tuple(or_zeros(o) for o in optionals))
        return real, batches

    def _read_some(self, iterator, want: tf.Tensor) -> tuple[tf.Tensor, tuple]:
        """The first `want` of a program's places read from `iterator`, zeros in the
        rest (no batch is taken for them: the data position stays exact)."""
        zeros = zeros_of(iterator.element_spec)

        def take():
            optional = iterator.get_next_as_optional()
            return (tf.cast(optional.has_value(), tf.int32),
                    tf.cond(optional.has_value(), optional.get_value, lambda: zeros))
        places = [tf.cond(k < want, take, lambda: (tf.constant(0), zeros))
                  for k in range(self.program_steps)]
        return tf.add_n([real for real, _ in places]), tuple(batch for _, batch in places)

    def _run_program(self, iterator, want: tf.Tensor
                     ) -> tuple[Any, tf.Tensor, tf.Tensor, tf.Tensor]:
        """(summed logs, steps run, batches that were real, seconds waited) of one
        program launch on `want` batches (at most `program_steps`)."""
        real, batches, waited = self._fetch_program(iterator, want)
        totals, ran = self.strategy.run(self.program, args=(batches, real))
        totals = {name: self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                  for name, value in totals.items()}
        ran = self.strategy.reduce(tf.distribute.ReduceOp.SUM, ran, axis=None)
        return totals, ran, real, waited

    def _program_loop(self, iterator, num_steps: tf.Tensor):
        """`num_steps` steps in launches of `program`, each on `program_steps` batches
        read as built, the last on fewer if `program_steps` does not divide `num_steps`
        (the same program: its step count is a tensor); stops early as `_loop` does.
        One while loop holds the one launch (and its reads) for the first, middle and
        last programs alike: each copy is Python tracing and executor set-up that a
        Trainer pays at start-up. Its sums are carried from empty (`CarriedSums`)."""
        launches = (num_steps + self.program_steps - 1) // self.program_steps
        sums = CarriedSums()

        def more(i, real, totals, steps, input_wait):
            # After the first launch: only if the previous one was full (the input did
            # not end) and no stop was asked for.
            go_on = tf.logical_and(real == self.program_steps,
                                   tf.logical_not(self.stop_requested()))
            return tf.logical_and(i < launches, tf.logical_or(tf.equal(i, 0), go_on))

        def body(i, real, totals, steps, input_wait):
            want = tf.minimum(num_steps - i * self.program_steps, self.program_steps)
            more_totals, ran, real, waited = self._run_program(iterator, want)
            nothing = tf.logical_and(tf.equal(i, 0), tf.equal(real, 0))
            with tf.control_dependencies([tf.debugging.Assert(tf.logical_not(nothing),
                                                              [EXHAUSTED])]):
                ran = tf.identity(ran)
            return (i + 1, real, sums.add(totals, more_totals), steps + ran,
                    input_wait + waited)

        _, _, totals, steps, input_wait = tf.while_loop(
            more, body, (tf.constant(0, num_steps.dtype), tf.constant(0, tf.int32),
                         sums.start(), tf.constant(0, tf.int32),
                         tf.constant(0.0, tf.float64)))
        return sums.result(totals), steps, input_wait


def _after(value: tf.Tensor, op: Callable[[], tf.Tensor]) -> tf.Tensor:
    with tf.control_dependencies([value]):
        return op()


def plan_steps(builder: StepBuilder, count: Callable[[dict[str, tf.Tensor]], None] | None,
               inputs: Inputs, plan: Any, step: tf.Variable, guard: NonFiniteGuard,
               ideal_step_seconds: Callable[[], float | None]) -> tuple[Callable, dict[str, Any]]:
    """The step (`StepBuilder.build`) and HostLoop's program arguments (`plan_program`).

    XLA's lowering is most of a small model's start-up: where a program of several
    steps lowers, the step inside it is not lowered again on its own.
    """
    step_fn = builder.build(count, check=False)
    program = plan_program(step_fn, builder, inputs, plan, step, guard, ideal_step_seconds)
    return builder.checked(step_fn, count), program


def train_loop(builder: StepBuilder, inputs: Inputs, plan: Any, step: tf.Variable,
               guard: NonFiniteGuard, ema: ExponentialAverage | None,
               stop_requested: Callable[[], Any],
               ideal_step_seconds: Callable[[], float | None]) -> tuple[Callable, int]:
    """The Trainer's compiled train loop (`HostLoop.run`, built on its first call) and
    its steps per XLA program launch (`plan_steps`)."""
    # A mirrored counter (MirroredStrategy on one device) is written through a
    # merge_call, which a nested XLA function cannot hold: the loop counts it.
    mirrored = isinstance(step, tf.distribute.DistributedValues)
    count = None if mirrored else (lambda logs: count_step(step, guard, logs, ema))
    step_fn, program = plan_steps(builder, count, inputs, plan, step, guard, ideal_step_seconds)
    loop = HostLoop(step_fn, inputs, count_steps=True, step=step, guard=guard,
                    stop_requested=stop_requested, counted_in_step=builder.counted_in_step,
                    ema=ema, **program)
    return loop.run, program.get("program_steps", 1)


def convolutions_on_cpu(builder: StepBuilder) -> bool:
    """Whether the model has Keras convolution layers and trains on CPUs: XLA's CPU
    convolutions inside a multi-step program's loop ran several times slower than one
    step a launch, far more than a launch costs, so "auto" keeps one step a launch
    for them."""
    return without_gpus(builder.strategy) and has_convolutions(builder.model)


def plan_program(step_fn: Callable, builder: StepBuilder, inputs: Inputs, plan: Any,
                 step: tf.Variable, guard: NonFiniteGuard,
                 ideal_step_seconds: Callable[[], float | None]) -> dict[str, Any]:
    """HostLoop's `program` and `program_steps`: several steps a launch where the
    whole step is one XLA program on one replica reading one batch a step; {} (one
    step a launch) otherwise, or when that program does not compile.
    `ideal_step_seconds` is asked only where "auto" steps depend on it (it may count
    the step's FLOPs: `Progress.count_flops_later`)."""
    if not (builder.counted_in_step and inputs.direct_fetch and plan.input_mode == "host"):
        return {}
    ideal = ideal_step_seconds() if plan.options.steps_per_program == "auto" else None
    steps = program_steps(plan.options, sum(
        spec.shape.num_elements() * spec.dtype.size
        for spec in tf.nest.flatten(inputs.train_dataset.element_spec)), ideal)
    if steps <= 1:
        return {}
    if plan.options.steps_per_program == "auto" and convolutions_on_cpu(builder):
        logging.info("tputrain: one step an XLA program launch (convolutions on a CPU run "
                     "slower in a multi-step program; set Trainer.steps_per_program to try)")
        return {}
    # The guard's trip only: SIGTERM is noticed between programs, so that every
    # batch a program took is trained on (exact resume).
    program = steps_program(step_fn, steps, step, guard.should_stop)
    why = builder.refusal(program, (builder.zero_batch(),) * steps, tf.constant(steps))
    if why is not None:
        logging.warning("tputrain: %d steps per XLA program do not compile (%s): "
                        "one step a launch", steps, why)
        return {}
    builder.lowered_within()
    logging.info("tputrain: %d steps per XLA program launch (Trainer.steps_per_program)", steps)
    return {"program": program, "program_steps": steps}
