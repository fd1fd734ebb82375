"""`tputrain diagnose --gin_file=F`: is this training job waiting on its input?

Builds the configured Trainer (in a temporary model_dir: nothing is restored or
written) and measures, on this host, three throughputs in steps per second:

(a) input only: the train dataset drained by a compiled loop, no step;
(b) compute only: the Trainer's own compiled train loop fed one cached batch
    again and again from memory (`Dataset.from_tensors(batch).repeat()`), so
    the step never waits on real input;
(c) end to end: the same loop on the real input pipeline.

The stall fraction is `1 - end_to_end / compute_only` (the median over
pairs of loops run back to back, cached and real input in turn): the share of
step time lost to input, whether the step waits on batches that are not ready
or the pipeline slows the step by competing for the host's cores. The in-loop
figure that training logs each loop (`input/stall_fraction`, time blocked in
`get_next`) is reported beside it. Below 5% the step (compute) is the
bottleneck; above, the input is, and the advice names the knobs to turn.
`python -m tputrain.diagnose` runs the same.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

from absl import app, flags, logging

FLAGS = flags.FLAGS
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


def _drain_function():
    """A compiled loop that pulls `n` elements from an iterator and does nothing else."""
    import tensorflow as tf

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


def _cached_iterator(trainer):
    """An iterator that yields one real element of the train input forever, from memory."""
    import tensorflow as tf

    if trainer.input_mode == "host":
        element = trainer._train_iterator.get_next()  # pylint: disable=protected-access
        return iter(tf.data.Dataset.from_tensors(element).repeat())
    batch = next(iter(trainer._train_dataset))  # pylint: disable=protected-access
    return iter(trainer.strategy.distribute_datasets_from_function(
        lambda _: tf.data.Dataset.from_tensors(batch).repeat()))


def diagnose(trainer, seconds: float = 3.0, steps: int | None = None) -> Diagnosis:
    """Measures input-only, compute-only and end-to-end throughput of `trainer`.

    Each measurement runs compiled loops of `steps` steps for about `seconds`
    after one warm-up loop, and takes the median. `steps` defaults to what fits
    a quarter of `seconds`, at most the Trainer's steps_per_loop. The trainer's
    weights change (it trains); nothing is saved.
    """
    import tensorflow as tf

    # pylint: disable=protected-access
    timings: dict[str, float] = {}
    if trainer.input_mode == "distributed":
        trainer._train_iterator = trainer._distributed_iterator("train")
    real_iterator = trainer._train_iterator
    unit = int(getattr(trainer, "steps_per_fetch", 1))  # loops are multiples of this

    # Warm-up: traces the compiled loop and fills the pipeline's buffers.
    _, timings["trace"] = _timed(lambda: trainer._train_loop(unit))
    if steps is None:
        # Loops of about a quarter of the budget, at most steps_per_loop: slow steps
        # (a big model on a busy host) must not stretch the run to minutes.
        (_, done, _), elapsed = _timed(lambda: trainer._train_loop(unit))
        per_step = elapsed / max(done, 1)
        steps = min(trainer.steps_per_loop, max(1, int(seconds / 4 / max(per_step, 1e-9))))
    num_steps = max(unit, int(steps) // unit * unit)

    def one_loop(iterator) -> tuple[float, float, float]:
        """(steps, seconds, seconds waiting on input) of one loop on `iterator`."""
        trainer._train_iterator = iterator
        try:
            (_, done, wait), elapsed = _timed(lambda: trainer._train_loop(num_steps))
        finally:
            trainer._train_iterator = real_iterator
        return done, elapsed, wait

    # (a) input only, from the same iterator (one iterator per pipeline: a file cache
    # allows no second one, and freeing tf.data iterators can block for seconds).
    # Host mode: one element holds the batches of `steps_per_fetch` steps.
    elements_per_step = 1 / unit if trainer.input_mode == "host" else 1
    drain = _drain_function()
    count = tf.constant(max(1, int(num_steps * elements_per_step)))
    _, warm = _timed(lambda: drain(real_iterator, count))
    input_rates, begin = [], time.perf_counter()
    while len(input_rates) < 3 or time.perf_counter() - begin < seconds:
        pulled, elapsed = _timed(lambda: int(drain(real_iterator, count)))
        input_rates.append(pulled / elements_per_step / elapsed)
        if len(input_rates) >= 100:
            break
    timings["input_only"] = warm + time.perf_counter() - begin

    # (b) and (c), interleaved loop by loop so that both see the same load on a
    # shared host: the same compiled loop on one cached batch, then on the real input.
    cached_iterator = _cached_iterator(trainer)
    one_loop(cached_iterator)  # warm-up
    one_loop(real_iterator)
    compute_rates, e2e_rates, ratios, e2e_wait, e2e_time = [], [], [], 0.0, 0.0
    begin = time.perf_counter()
    while len(ratios) < 4 or time.perf_counter() - begin < 2 * seconds:
        # Alternate which goes first, so neither always follows the other.
        order = (cached_iterator, real_iterator)[::1 if len(ratios) % 2 else -1]
        rates = {}
        for iterator in order:
            done, elapsed, wait = one_loop(iterator)
            rates[iterator is real_iterator] = done / elapsed
            if iterator is real_iterator:
                e2e_wait += wait
                e2e_time += elapsed
        compute_rates.append(rates[False])
        e2e_rates.append(rates[True])
        ratios.append(rates[True] / rates[False])
        if len(ratios) >= 200:
            break
    timings["compute_and_end_to_end"] = time.perf_counter() - begin
    wait_fraction = e2e_wait / max(e2e_time, 1e-9)

    input_only = statistics.median(input_rates)
    compute_only = statistics.median(compute_rates)
    end_to_end = statistics.median(e2e_rates)
    # The median of the pairs' ratios follows a shared host's changing load better
    # than the ratio of the medians.
    stall = min(1.0, max(0.0, 1.0 - statistics.median(ratios)))
    bottleneck = "input" if stall >= STALL_GOAL else "compute"
    reason, advice = _advice(bottleneck, input_only, compute_only, stall, trainer.input_mode)
    return Diagnosis(
        input_only_steps_per_second=input_only, compute_only_steps_per_second=compute_only,
        end_to_end_steps_per_second=end_to_end, stall_fraction=stall,
        measured_input_wait_fraction=wait_fraction, bottleneck=bottleneck, reason=reason,
        advice=advice, loop_steps=num_steps, global_batch_size=trainer.global_batch_size,
        seconds={k: round(v, 3) for k, v in timings.items()})


def define_flags() -> None:
    from tputrain.run import define_gin_flags

    define_gin_flags()
    flags.DEFINE_bool("json", False, "Print the measurements as one JSON object.")
    flags.DEFINE_float("seconds", 3.0, "Seconds per measurement (after a warm-up loop).")
    flags.DEFINE_integer("steps", None, "Steps per measured loop; default Trainer.steps_per_loop.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from tputrain import run

    started = time.perf_counter()
    run.parse_gin_flags()
    # Never touch the configured model_dir: no restore, no checkpoints, no summaries.
    work_dir = tempfile.mkdtemp(prefix="tputrain-diagnose-")
    FLAGS.model_dir = work_dir
    try:
        (trainer, build_seconds) = _timed(run.build_trainer)
        result = diagnose(trainer, seconds=FLAGS.seconds, steps=FLAGS.steps)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    result.seconds["build"] = round(build_seconds, 3)
    result.seconds["total"] = round(time.perf_counter() - started, 3)
    if FLAGS.json:
        print(json.dumps({"gin_file": list(FLAGS.gin_file), "gin_param": list(FLAGS.gin_param),
                          **result.to_json()}, indent=1))
    else:
        print(result.report())
    sys.stdout.flush()


def console_main() -> None:
    """Entry point of `tputrain diagnose`."""
    from tputrain.run import list_in_help

    define_flags()
    # Not model_dir: diagnose always works in a temporary directory.
    list_in_help(("gin_file", "gin_param", "gin_search_path", "gin_import", "json", "seconds",
                  "steps"))
    logging.set_verbosity(logging.WARNING)
    app.run(main)


if __name__ == "__main__":
    console_main()
