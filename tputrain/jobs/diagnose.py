"""Where does a training step's time go? Measure it, name the bottleneck and the fix.

`diagnose(trainer)` measures, on this host, a built Trainer's input pipeline
alone, its compiled train loop on one cached batch (compute only), the same
loop on the real input (end to end), and the all-reduce of its gradients alone
in a compiled loop (communication). Together they split the end-to-end step
into input, compute and communication shares. Communication is the bottleneck
when it is the largest share and at least 30%; else input, when the stall
misses its 5% goal; else compute. `Diagnosis.advice` names the knobs that fit
the measured case and that the run does not already turn (`tputrain.jobs.advice`);
`Diagnosis.in_place` lists those it does.
`tputrain diagnose` (tputrain/cli/diagnose.py) runs it on a gin config, also on
several workers (`tputrain launch --workers N diagnose ...`): the hosts agree
on every collective they run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Iterator

import tensorflow as tf

from tputrain.jobs.advice import STALL_GOAL, RunSetup, run_setup, step_advice
from tputrain.data.options import without_autotune
from tputrain.distribution.communication import CommunicationOptions, gradient_bytes, measure_allreduce
from tputrain.loop import compile_cache
from tputrain.runtime.run_view import RunView, view_of

# Communication is the bottleneck when it is the largest share of the step and at
# least this large: below, shrinking it buys less than the other two could.
COMMUNICATION_SHARE = 0.30
MB = 1e6


@dataclasses.dataclass
class Diagnosis:
    """What `diagnose` measured (steps per second; fractions in [0, 1]).

    `step_split` is the end-to-end step as shares of input, compute and
    communication (summing to 1); `allreduce_seconds` one all-reduce of the
    gradients in a compiled loop (`tputrain.distribution.communication.measure_allreduce`, the
    measurement behind every run's `comm/allreduce_fraction`). `loop_steps` is
    the length of the measured loops; `seconds` the time per phase; `in_place`
    the knobs the run already turns (named instead of advised).
    """

    input_only_steps_per_second: float
    compute_only_steps_per_second: float
    end_to_end_steps_per_second: float
    stall_fraction: float
    measured_input_wait_fraction: float
    step_split: dict[str, float]
    allreduce_seconds: float
    gradient_bytes: int
    allreduce_dtype: str
    replicas: int
    bottleneck: str
    reason: str
    advice: list[str]
    loop_steps: int
    global_batch_size: int
    seconds: dict[str, float]
    in_place: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def report(self) -> str:
        """Human-readable summary, one fact a line."""
        batch, split = self.global_batch_size, self.step_split
        lines = [
            f"input only:   {self.input_only_steps_per_second:10.1f} steps/s "
            f"({self.input_only_steps_per_second * batch:,.0f} examples/s)",
            f"compute only: {self.compute_only_steps_per_second:10.1f} steps/s "
            f"({self.compute_only_steps_per_second * batch:,.0f} examples/s)",
            f"end to end:   {self.end_to_end_steps_per_second:10.1f} steps/s "
            f"({self.end_to_end_steps_per_second * batch:,.0f} examples/s)",
            f"stall fraction: {100 * self.stall_fraction:.1f}% "
            f"(1 - end_to_end / compute_only; goal < {100 * STALL_GOAL:.0f}%); "
            f"time blocked on get_next in the loop: "
            f"{100 * self.measured_input_wait_fraction:.1f}%",
            f"all-reduce: {self.gradient_bytes / MB:.2f} MB of gradients in "
            f"{self.allreduce_dtype} over {self.replicas} replica(s), "
            f"{1e3 * self.allreduce_seconds:.2f} ms per step in a compiled loop",
            f"step split: input {100 * split['input']:.0f}% | compute "
            f"{100 * split['compute']:.0f}% | communication {100 * split['communication']:.0f}%",
            f"bottleneck: {self.bottleneck} ({self.reason})",
        ]
        lines += [f"advice: {line}" for line in self.advice]
        lines += [f"already: {line}" for line in self.in_place]
        return "\n".join(lines)


def step_split(stall: float, compute_only: float, allreduce_seconds: float) -> dict[str, float]:
    """The end-to-end step as shares: input is the stall; the rest is the compute-only
    step, of which the all-reduce is communication."""
    communication = min(1.0, allreduce_seconds * compute_only)
    return {"input": stall, "compute": (1.0 - stall) * (1.0 - communication),
            "communication": (1.0 - stall) * communication}


def name_bottleneck(split: dict[str, float]) -> str:
    """Communication if it is the largest share and at least COMMUNICATION_SHARE;
    else input if the stall misses its goal; else compute."""
    communication = split["communication"]
    if communication >= COMMUNICATION_SHARE and communication >= max(split["input"],
                                                                   split["compute"]):
        return "communication"
    return "input" if split["input"] >= STALL_GOAL else "compute"


def _advice(bottleneck: str, input_only: float, compute_only: float, stall: float,
            input_mode: str, setup: RunSetup | None = None) -> tuple[str, list[str]]:
    """The reason and the knobs for an input- or compute-bound step (`setup`: what the
    run already does; None knows nothing of it, so every knob is named)."""
    result = step_advice(bottleneck, input_only, compute_only, stall,
                         setup or RunSetup(input_mode=input_mode))
    return result.reason, result.advice


@dataclasses.dataclass(frozen=True)
class CommunicationCase:
    """What the communication advice depends on: the measured split and the run's setup."""

    split: dict[str, float]
    allreduce_seconds: float
    step_seconds: float  # compute only, all-reduce included
    gradient_bytes: int
    options: CommunicationOptions
    global_batch_size: int
    replicas: int
    accumulation_steps: int
    multi_worker: bool
    gpus: bool


def communication_advice(case: CommunicationCase) -> tuple[str, list[str]]:
    """The reason and the knobs for a communication-bound step, each with what it trades
    and, where the measurements allow, what it would buy."""
    mb, dtype, split = case.gradient_bytes / MB, case.options.allreduce_dtype, case.split
    reason = (f"one all-reduce of {mb:.1f} MB of gradients ({dtype}) takes "
              f"{1e3 * case.allreduce_seconds:.1f} ms alone, the whole step "
              f"{1e3 * case.step_seconds:.1f} ms: communication {100 * split['communication']:.0f}%"
              f" of the step, compute {100 * split['compute']:.0f}%, input "
              f"{100 * split['input']:.0f}%")
    compute = max(case.step_seconds - case.allreduce_seconds, 0.0)
    k = 4  # the all-reduce is paid once per step, however many examples the step holds
    speedup = k * case.step_seconds / (k * compute + min(case.allreduce_seconds,
                                                         case.step_seconds))
    micro = case.global_batch_size // (case.replicas * case.accumulation_steps)
    advice = []
    if dtype == "float32":
        advice.append(
            f"CommunicationOptions.allreduce_dtype='bfloat16': {mb / 2:.1f} MB per step instead "
            f"of {mb:.1f}; gradients are summed to bf16 precision (8 mantissa bits), the "
            "update stays float32 (compare the loss curve). It halves the time on the wire; "
            "where the all-reduce is memory traffic (replicas on one host's CPUs) the casts "
            "can cost more than they save")
    advice += [
        f"Trainer.accumulation_steps={k * case.accumulation_steps} with a {k}x "
        f"Trainer.global_batch_size ({k * case.global_batch_size}): one all-reduce per {k} "
        f"micro-batches of today's {micro} examples per replica, the same memory: about "
        f"{speedup:.1f}x the examples/s by this split. A larger batch changes the "
        "optimisation: rescale the learning rate (warmup_schedule)",
        f"a larger per-replica batch (now {micro}; Trainer.global_batch_size) if memory "
        "allows: the all-reduce costs the same per step, so each example pays less of it",
    ]
    if case.multi_worker:
        packs = (f"{case.options.bytes_per_pack / MB:g} MB" if case.options.bytes_per_pack
                 else "0: one pack")
        advice.append(
            f"CommunicationOptions.bytes_per_pack (now {packs}): packs of a few MB let the "
            "all-reduce start while the backward pass still runs, at more per-message "
            "overhead; measure before keeping it (benchmarks/communication.py)")
        if case.gpus and case.options.implementation != "nccl":
            advice.append("CommunicationOptions.implementation='nccl': NCCL's all-reduce "
                          "between the GPUs instead of gRPC")
    return reason, advice


Clock = Callable[[], float]  # seconds, as time.perf_counter


def _timed(fn: Callable[[], Any], clock: Clock = time.perf_counter) -> tuple[Any, float]:
    start = clock()
    result = fn()
    return result, clock() - start


def _drain_function() -> Callable[[Iterator[Any], tf.Tensor], tf.Tensor]:
    """A compiled loop that pulls `n` elements from an iterator and does nothing else."""

    @tf.function
    def drain(iterator, n):
        count = tf.constant(0)
        for _ in tf.range(n):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            count += 1
        return count

    return drain


def _cached_iterator(view: RunView, real_iterator: Iterator[Any]) -> Iterator[Any]:
    """An iterator that yields one real element of the train input forever, from memory."""
    if view.plan.input_mode == "host":
        element = real_iterator.get_next()
        return iter(tf.data.Dataset.from_tensors(element).repeat())
    batch = next(iter(without_autotune(view.inputs.train_dataset.take(1))))
    return iter(view.strategy.distribute_datasets_from_function(
        lambda _: tf.data.Dataset.from_tensors(batch).repeat()))


class _Loops:
    """Runs the Trainer's own compiled train loop (`run_loop`) on a chosen iterator:
    what is measured is the very program training runs, only fed differently."""

    def __init__(self, view: RunView, clock: Clock = time.perf_counter):
        self.view = view
        self.clock = clock
        # Several hosts run every collective loop together: they agree on each count
        # (the largest any host asks for) and on whether to run another round.
        self.agree: Callable[[int], int] = view.agree
        # The Trainer's own iterator, not a second one (see `_input_only_rates`).
        self.real_iterator = view.train_iterator
        if view.plan.input_mode == "distributed":
            self.real_iterator = view.inputs.distributed_iterator("train")
            view.set_train_iterator(self.real_iterator)
        self.unit = view.plan.steps_per_fetch  # loops are multiples of this
        self.num_steps = self.unit

    def warm_up(self, seconds: float, steps: int | None) -> float:
        """Traces the loop and fills the pipeline's buffers; sets the loop length:
        `steps`, or what fits a quarter of `seconds`, at most steps_per_loop (slow
        steps, a big model on a busy host, must not stretch the run to minutes)."""
        with compile_cache.reading(self, "train"):  # its first call compiles or reads back
            _, trace = _timed(lambda: self.view.run_loop(self.unit), self.clock)
        if steps is None:
            (_, done, _), elapsed = _timed(lambda: self.view.run_loop(self.unit), self.clock)
            per_step = elapsed / max(done, 1)
            steps = min(self.view.plan.options.steps_per_loop,
                        max(1, int(seconds / 4 / max(per_step, 1e-9))))
        self.num_steps = max(self.unit, self.agree(int(steps)) // self.unit * self.unit)
        return trace

    def more(self, rounds: int, begin: float, seconds: float, least: int, cap: int) -> bool:
        """Another round? At least `least`, until `seconds` have passed, at most `cap`;
        on several hosts, while any host wants one."""
        wanted = rounds < cap and (rounds < least or self.clock() - begin < seconds)
        return bool(self.agree(int(wanted)))

    def run(self, iterator: Iterator[Any]) -> tuple[float, float, float]:
        """(steps, seconds, seconds waiting on input) of one loop on `iterator`."""
        self.view.set_train_iterator(iterator)
        try:
            (_, done, wait), elapsed = _timed(lambda: self.view.run_loop(self.num_steps),
                                              self.clock)
        finally:
            self.view.set_train_iterator(self.real_iterator)
        return done, elapsed, wait


def _input_only_rates(loops: _Loops, seconds: float) -> tuple[list[float], float]:
    """Steps per second of the input alone, and the time taken.

    Drains the real iterator itself: one iterator per pipeline (a file cache
    allows no second one, and freeing tf.data iterators can block for seconds).
    In host mode one element holds the batches of `steps_per_fetch` steps.
    """
    elements_per_step = 1 / loops.unit if loops.view.plan.input_mode == "host" else 1
    drain = _drain_function()
    count = tf.constant(max(1, int(loops.num_steps * elements_per_step)))
    _, warm = _timed(lambda: drain(loops.real_iterator, count), loops.clock)
    rates, begin = [], loops.clock()
    while loops.more(len(rates), begin, seconds, least=3, cap=100):
        pulled, elapsed = _timed(lambda: int(drain(loops.real_iterator, count)), loops.clock)
        rates.append(pulled / elements_per_step / max(elapsed, 1e-9))
    return rates, warm + loops.clock() - begin


@dataclasses.dataclass
class _Pairs:
    """Compute-only and end-to-end loops run back to back (see `_paired_rates`)."""

    compute_rates: list[float]
    end_to_end_rates: list[float]
    ratios: list[float]  # end to end / compute only, per pair
    wait_fraction: float  # of end-to-end time blocked on get_next
    seconds: float


def _paired_rates(loops: _Loops, seconds: float) -> _Pairs:
    """The same compiled loop on one cached batch and on the real input, in turn, so
    that both see the same load on a shared host; the order alternates so that
    neither always follows the other."""
    cached, real = _cached_iterator(loops.view, loops.real_iterator), loops.real_iterator
    loops.run(cached)  # warm-up
    loops.run(real)
    pairs = _Pairs([], [], [], 0.0, 0.0)
    wait = e2e_time = 0.0
    begin = loops.clock()
    while loops.more(len(pairs.ratios), begin, 2 * seconds, least=4, cap=200):
        rates = {}
        for iterator in (cached, real)[::1 if len(pairs.ratios) % 2 else -1]:
            done, elapsed, waited = loops.run(iterator)
            rates[iterator is real] = done / max(elapsed, 1e-9)
            if iterator is real:
                wait += waited
                e2e_time += elapsed
        pairs.compute_rates.append(rates[False])
        pairs.end_to_end_rates.append(rates[True])
        pairs.ratios.append(rates[True] / rates[False])
    pairs.seconds = loops.clock() - begin
    pairs.wait_fraction = wait / max(e2e_time, 1e-9)
    return pairs


def _allreduce_seconds(loops: _Loops, seconds: float) -> float:
    """One all-reduce of the gradients in a compiled loop, in seconds; 0 on one replica
    (the measurement behind every run's comm/allreduce_fraction, given more time)."""
    view = loops.view
    if view.strategy.num_replicas_in_sync <= 1:
        return 0.0
    dtype, variables = view.communication.allreduce_dtype, view.model.trainable_variables
    return measure_allreduce(view.strategy, variables, dtype, seconds, loops.agree,
                             clock=loops.clock)


def _explain(view: RunView, bottleneck: str, split: dict[str, float], input_only: float,
             compute_only: float, allreduce: float) -> tuple[str, list[str], list[str]]:
    """The reason, the advice for the named bottleneck, and the knobs already turned."""
    strategy = view.strategy
    if bottleneck != "communication":
        result = step_advice(bottleneck, input_only, compute_only, split["input"],
                             run_setup(view))
        if strategy.num_replicas_in_sync > 1:
            result.reason += (f"; the all-reduce is {100 * split['communication']:.0f}% of the "
                              f"step (communication is the bottleneck from "
                              f"{100 * COMMUNICATION_SHARE:.0f}% if no other share is larger)")
        return result.reason, result.advice, result.in_place
    reason, advice = communication_advice(CommunicationCase(
        split=split, allreduce_seconds=allreduce, step_seconds=1.0 / compute_only,
        gradient_bytes=gradient_bytes(view.model.trainable_variables,
                                      view.communication.allreduce_dtype,
                                      strategy.num_replicas_in_sync),
        options=view.communication, global_batch_size=view.plan.batch.global_batch_size,
        replicas=strategy.num_replicas_in_sync,
        accumulation_steps=view.plan.batch.accumulation_steps,
        multi_worker=view.num_hosts > 1 or isinstance(
            strategy, tf.distribute.MultiWorkerMirroredStrategy),
        gpus=bool(tf.config.list_logical_devices("GPU"))))
    return reason, advice, []


def diagnose(view: RunView, seconds: float = 3.0, steps: int | None = None,
             clock: Clock = time.perf_counter) -> Diagnosis:
    """Splits a step of `trainer` into input, compute and communication; names the
    bottleneck and the knobs.

    Each throughput runs compiled loops of `steps` steps for about `seconds`
    after one warm-up loop, and takes the median. `steps` defaults to what fits
    a quarter of `seconds`, at most the Trainer's steps_per_loop. The trainer's
    weights change (it trains); nothing is saved. On several hosts every host
    must call it (the loops are collectives); each measures its own input.
    `clock` is the time source: a test's own clock, advanced by its input and
    step by known amounts, makes every figure exact on a busy host.
    """
    view = view_of(view)  # a Trainer, an action's context or a view
    loops = _Loops(view, clock)
    timings = {"trace": loops.warm_up(seconds, steps)}
    input_rates, timings["input_only"] = _input_only_rates(loops, seconds)
    pairs = _paired_rates(loops, seconds)
    timings["compute_and_end_to_end"] = pairs.seconds
    allreduce, timings["communication"] = _timed(
        lambda: _allreduce_seconds(loops, seconds), clock)
    input_only = statistics.median(input_rates)
    compute_only = statistics.median(pairs.compute_rates)
    # The median of the pairs' ratios follows a shared host's changing load better
    # than the ratio of the medians.
    stall = min(1.0, max(0.0, 1.0 - statistics.median(pairs.ratios)))
    split = step_split(stall, compute_only, allreduce)
    bottleneck = name_bottleneck(split)
    reason, advice, in_place = _explain(view, bottleneck, split, input_only, compute_only,
                                        allreduce)
    replicas, dtype = view.strategy.num_replicas_in_sync, view.communication.allreduce_dtype
    return Diagnosis(
        input_only_steps_per_second=input_only, compute_only_steps_per_second=compute_only,
        end_to_end_steps_per_second=statistics.median(pairs.end_to_end_rates),
        stall_fraction=stall, measured_input_wait_fraction=pairs.wait_fraction,
        step_split=split, allreduce_seconds=allreduce,
        gradient_bytes=gradient_bytes(view.model.trainable_variables, dtype, replicas),
        allreduce_dtype=dtype, replicas=replicas, bottleneck=bottleneck, reason=reason,
        advice=advice, in_place=in_place, loop_steps=loops.num_steps,
        global_batch_size=view.plan.batch.global_batch_size,
        seconds={k: round(v, 3) for k, v in timings.items()})


if __name__ == "__main__":  # `python -m tputrain.jobs.diagnose` (documented) is the command
    from tputrain.cli.diagnose import console_main

    console_main()
