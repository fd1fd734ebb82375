"""Is a training job waiting on its input? Measure it, name the bottleneck and the fix.

`diagnose(trainer)` measures three throughputs of a built Trainer on this host:
its input pipeline alone, its compiled train loop on one cached batch (compute
only), and the same loop on the real input (end to end). The share of step time
lost to input (the stall fraction) decides the bottleneck; `Diagnosis.advice`
names the knobs to turn. `tputrain diagnose` (tputrain/cli/diagnose.py) runs it
on a gin config.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Iterator

import tensorflow as tf

from tputrain.trainer import Trainer

STALL_GOAL = 0.05  # the seeds' rule: input wait under 5% of the step


@dataclasses.dataclass
class Diagnosis:
    """What `diagnose` measured (steps per second; fractions in [0, 1]).

    `loop_steps` is the length of the measured loops; `seconds` the time per phase.
    """

    input_only_steps_per_second: float
    compute_only_steps_per_second: float
    end_to_end_steps_per_second: float
    stall_fraction: float
    measured_input_wait_fraction: float
    bottleneck: str
    reason: str
    advice: list[str]
    loop_steps: int
    global_batch_size: int
    seconds: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def report(self) -> str:
        """Human-readable summary, one fact a line."""
        batch = self.global_batch_size
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
            f"bottleneck: {self.bottleneck} ({self.reason})",
        ]
        lines += [f"advice: {line}" for line in self.advice]
        return "\n".join(lines)


def _advice(bottleneck: str, input_only: float, compute_only: float, stall: float,
            input_mode: str) -> tuple[str, list[str]]:
    """The reason and the knobs to turn, from the three measurements."""
    if bottleneck == "compute":
        return (f"input wait {100 * stall:.1f}% < {100 * STALL_GOAL:.0f}% of the step: the "
                "input pipeline keeps up"), [
            "speed up the step itself: Trainer.precision='mixed_bfloat16', a larger "
            "Trainer.global_batch_size, more Trainer.steps_per_loop"]
    if input_only < 1.1 * compute_only:
        reason = (f"the input pipeline alone delivers {input_only:.1f} steps/s but the step "
                  f"could run {compute_only:.1f} steps/s")
        advice = [
            "parse in parallel and vectorized: batch before parsing (TFRecordInput does), give "
            "per-example maps num_parallel_calls=tf.data.AUTOTUNE, or rewrite them per batch",
            "precompute expensive preprocessing once and store the result "
            "(tputrain.data.write_tfrecords, `tputrain write-tfrecords`)",
            "read more files at once: at least 16 shards per host (write_tfrecords(num_hosts=...,"
            " target_shard_mb=...)) and TFRecordInput.cycle_length",
            "cache what fits: TFRecordInput.cache='memory' (parsed, in RAM) or "
            "TFRecordInput.cache='/local/disk/prefix' for remote data",
            "deeper prefetch for bursty input: InputOptions.prefetch=8 "
            "(TFRecordInput.options=@InputOptions())",
            "offload preprocessing to other machines with the tf.data service: "
            "InputOptions.service_address='grpc://dispatcher:5050'",
        ]
    else:
        reason = (f"the input pipeline alone keeps up ({input_only:.1f} >= {compute_only:.1f} "
                  "steps/s) but slows the step when both run: they compete for the host's cores")
        advice = [
            "cache the parsed data in RAM if it fits: TFRecordInput.cache='memory' (one gather "
            "per batch instead of per-example work)",
            "give tf.data fewer threads: InputOptions.threadpool_size=1 or 2 "
            "(TFRecordInput.options=@InputOptions())",
            "move preprocessing off this host: precompute it (write_tfrecords) or use the "
            "tf.data service (InputOptions.service_address)",
        ]
    if input_mode == "host":
        advice.append("fetch several steps' batches at once: Trainer.steps_per_fetch (a divisor "
                      "of steps_per_loop); on TPU pods use Trainer.input_mode='distributed' "
                      "(device prefetch)")
    return reason, advice


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


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


def _cached_iterator(trainer: Trainer, real_iterator: Iterator[Any]) -> Iterator[Any]:
    """An iterator that yields one real element of the train input forever, from memory."""
    if trainer.input_mode == "host":
        element = real_iterator.get_next()
        return iter(tf.data.Dataset.from_tensors(element).repeat())
    batch = next(iter(trainer.train_dataset))
    return iter(trainer.strategy.distribute_datasets_from_function(
        lambda _: tf.data.Dataset.from_tensors(batch).repeat()))


class _Loops:
    """Runs the Trainer's own compiled train loop (`run_loop`) on a chosen iterator:
    what is measured is the very program training runs, only fed differently."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        if trainer.input_mode == "distributed":
            trainer.set_train_iterator(trainer.inputs.distributed_iterator("train"))
        # The Trainer's own iterator, not a second one (see `_input_only_rates`).
        self.real_iterator = trainer._train_iterator  # pylint: disable=protected-access
        self.unit = int(getattr(trainer, "steps_per_fetch", 1))  # loops are multiples of this
        self.num_steps = self.unit

    def warm_up(self, seconds: float, steps: int | None) -> float:
        """Traces the loop and fills the pipeline's buffers; sets the loop length:
        `steps`, or what fits a quarter of `seconds`, at most steps_per_loop (slow
        steps, a big model on a busy host, must not stretch the run to minutes)."""
        _, trace = _timed(lambda: self.trainer.run_loop(self.unit))
        if steps is None:
            (_, done, _), elapsed = _timed(lambda: self.trainer.run_loop(self.unit))
            per_step = elapsed / max(done, 1)
            steps = min(self.trainer.steps_per_loop,
                        max(1, int(seconds / 4 / max(per_step, 1e-9))))
        self.num_steps = max(self.unit, int(steps) // self.unit * self.unit)
        return trace

    def run(self, iterator: Iterator[Any]) -> tuple[float, float, float]:
        """(steps, seconds, seconds waiting on input) of one loop on `iterator`."""
        self.trainer.set_train_iterator(iterator)
        try:
            (_, done, wait), elapsed = _timed(lambda: self.trainer.run_loop(self.num_steps))
        finally:
            self.trainer.set_train_iterator(self.real_iterator)
        return done, elapsed, wait


def _input_only_rates(loops: _Loops, seconds: float) -> tuple[list[float], float]:
    """Steps per second of the input alone, and the time taken.

    Drains the real iterator itself: one iterator per pipeline (a file cache
    allows no second one, and freeing tf.data iterators can block for seconds).
    In host mode one element holds the batches of `steps_per_fetch` steps.
    """
    elements_per_step = 1 / loops.unit if loops.trainer.input_mode == "host" else 1
    drain = _drain_function()
    count = tf.constant(max(1, int(loops.num_steps * elements_per_step)))
    _, warm = _timed(lambda: drain(loops.real_iterator, count))
    rates, begin = [], time.perf_counter()
    while len(rates) < 3 or time.perf_counter() - begin < seconds:
        pulled, elapsed = _timed(lambda: int(drain(loops.real_iterator, count)))
        rates.append(pulled / elements_per_step / elapsed)
        if len(rates) >= 100:
            break
    return rates, warm + time.perf_counter() - begin


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
    cached, real = _cached_iterator(loops.trainer, loops.real_iterator), loops.real_iterator
    loops.run(cached)  # warm-up
    loops.run(real)
    pairs = _Pairs([], [], [], 0.0, 0.0)
    wait = e2e_time = 0.0
    begin = time.perf_counter()
    while len(pairs.ratios) < 4 or time.perf_counter() - begin < 2 * seconds:
        rates = {}
        for iterator in (cached, real)[::1 if len(pairs.ratios) % 2 else -1]:
            done, elapsed, waited = loops.run(iterator)
            rates[iterator is real] = done / elapsed
            if iterator is real:
                wait += waited
                e2e_time += elapsed
        pairs.compute_rates.append(rates[False])
        pairs.end_to_end_rates.append(rates[True])
        pairs.ratios.append(rates[True] / rates[False])
        if len(pairs.ratios) >= 200:
            break
    pairs.seconds = time.perf_counter() - begin
    pairs.wait_fraction = wait / max(e2e_time, 1e-9)
    return pairs


def diagnose(trainer: Trainer, seconds: float = 3.0, steps: int | None = None) -> Diagnosis:
    """Measures input-only, compute-only and end-to-end throughput of `trainer`.

    Each measurement runs compiled loops of `steps` steps for about `seconds`
    after one warm-up loop, and takes the median. `steps` defaults to what fits
    a quarter of `seconds`, at most the Trainer's steps_per_loop. The trainer's
    weights change (it trains); nothing is saved.
    """
    loops = _Loops(trainer)
    timings = {"trace": loops.warm_up(seconds, steps)}
    input_rates, timings["input_only"] = _input_only_rates(loops, seconds)
    pairs = _paired_rates(loops, seconds)
    timings["compute_and_end_to_end"] = pairs.seconds
    input_only = statistics.median(input_rates)
    compute_only = statistics.median(pairs.compute_rates)
    # The median of the pairs' ratios follows a shared host's changing load better
    # than the ratio of the medians.
    stall = min(1.0, max(0.0, 1.0 - statistics.median(pairs.ratios)))
    bottleneck = "input" if stall >= STALL_GOAL else "compute"
    reason, advice = _advice(bottleneck, input_only, compute_only, stall, trainer.input_mode)
    return Diagnosis(
        input_only_steps_per_second=input_only, compute_only_steps_per_second=compute_only,
        end_to_end_steps_per_second=statistics.median(pairs.end_to_end_rates),
        stall_fraction=stall, measured_input_wait_fraction=pairs.wait_fraction,
        bottleneck=bottleneck, reason=reason, advice=advice, loop_steps=loops.num_steps,
        global_batch_size=trainer.global_batch_size,
        seconds={k: round(v, 3) for k, v in timings.items()})


if __name__ == "__main__":  # `python -m tputrain.diagnose` (documented) is the command
    from tputrain.cli.diagnose import console_main

    console_main()
