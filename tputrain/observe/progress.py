"""Progress: one log line per loop and TensorBoard scalars in model_dir (on Vertex AI,
in `$AIP_TENSORBOARD_LOG_DIR`, which its TensorBoard integration uploads)."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping

import tensorflow as tf
from absl import logging
from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.scalar import summary_v2 as scalar_summary

from tputrain.observe.eval_events import EvalEventWriter
from tputrain.observe.flops import model_flops_utilization
from tputrain.observe.summary_space import SummarySpace


VERTEX_TENSORBOARD_DIR = "AIP_TENSORBOARD_LOG_DIR"  # set by Vertex AI (docs/vertex.md)
# Before the first loop's rates: its wall time also holds tracing, XLA compilation and
# the input pipeline's first batch, so they are no steady rate (goodput splits them).
FIRST_LOOP = "with compiling: "
# Communication figures shown only where there is communication (several replicas);
# TensorBoard gets them always.
COMM_PREFIX = "comm/"
# An input stall above this share is explained once (the docs' goal is 5%; a shared
# host's noise reaches past that without any cause to fix).
STALL_ADVICE = 0.2
# A stall under this many seconds a step is the fetch's own hand-off, not the reading.
HANDOFF_SECONDS = 1e-3


def summary_root(model_dir: str) -> str:
    """Where the `train/` and `eval/` events go: Vertex AI's $AIP_TENSORBOARD_LOG_DIR
    when it is set (a job with a TensorBoard instance uploads that folder), else
    model_dir."""
    root = os.environ.get(VERTEX_TENSORBOARD_DIR)
    if root:
        logging.info("tputrain: TensorBoard events in %s (from $%s)", root,
                     VERTEX_TENSORBOARD_DIR)
    return root or model_dir


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{seconds:02d}s"
    return f"{seconds}s"


# Shorter names in the line than the TensorBoard tags (which are unchanged).
LINE_NAMES = {"learning_rate": "lr"}


def _format_logs(logs: Mapping[str, float]) -> str:
    return " | ".join(f"{LINE_NAMES.get(name, name)} {value:.4g}" for name, value in logs.items())


def _format_rate(rate: float) -> str:
    """Steps a second: whole above 100 (no noise digits), else two decimals."""
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.2f}"


def _line_logs(logs: Mapping[str, float]) -> dict[str, float]:
    """The logs the line shows: a mixture's counts and token logs have their own
    words; communication figures that are 0 (one replica) say nothing."""
    hidden = {*TOKEN_LOGS, *(n for n in logs if n.startswith(SOURCE_PREFIX)),
              *(n for n, v in logs.items() if n.startswith(COMM_PREFIX) and not float(v))}
    return {name: value for name, value in logs.items() if name not in hidden}


def stall_advice(stall_fraction: float, stall_per_step: float, steps_per_fetch: int = 1) -> str:
    """Why an input stall above STALL_ADVICE, and the knob: with a fetch a step, a stall
    of under HANDOFF_SECONDS a step is each fetch's cost (data in memory too), else
    the input is slower than the step."""
    if stall_per_step < HANDOFF_SECONDS and steps_per_fetch == 1:
        return (f"tputrain: input stall {100 * stall_fraction:.0f}% at "
                f"{1e6 * stall_per_step:.0f} us a step: each fetch's hand-off, which "
                "in-memory data (NumPy, from_tensor_slices) pays too. "
                "Trainer.steps_per_fetch = K fetches K steps' batches at once (digits.gin: "
                "100); `tputrain diagnose` separates input from step "
                "(docs/input_pipeline.md). Said once.")
    return (f"tputrain: input stall {100 * stall_fraction:.0f}%: the input is slower than "
            "the step. `tputrain diagnose` measures both and names the knobs (cache, "
            "parallel reads, prefetch; docs/input_pipeline.md). Said once.")


# Step logs of a run that counts tokens (`Task.loss_denominator`): shown as rates.
TOKEN_LOGS = ("real_tokens", "padding")


def _token_rates(logs: Mapping[str, float], steps_per_second: float,
                 rates: dict[str, float]) -> str:
    """Adds `real_tokens_per_second` to `rates`; returns the line's words for it."""
    if "real_tokens" not in logs:
        return ""
    rates["real_tokens_per_second"] = float(logs["real_tokens"]) * steps_per_second
    words = f" | {rates['real_tokens_per_second']:.0f} real tokens/s"
    if "padding" in logs:
        words += f" | padding {100 * float(logs['padding']):.1f}%"
    return words


# Cumulative per-source example counts of a mixture: their log and TensorBoard tags'
# prefix (examples/<name>; `loop/source_counts.py` counts them).
SOURCE_PREFIX = "examples/"


def _format_count(count: float) -> str:
    """6100 -> "6.1k": a count the line can hold at any size."""
    for size, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return f"{count:.0f}"


def _source_words(logs: Mapping[str, float]) -> str:
    """`| sources: wiki 61% (6.1k) | code 39% (3.9k)`: each source's share of the
    examples trained on so far and its count; "" without a mixture's counts."""
    counts = {name[len(SOURCE_PREFIX):]: float(value) for name, value in logs.items()
              if name.startswith(SOURCE_PREFIX)}
    if not counts:
        return ""
    total = max(sum(counts.values()), 1.0)
    return " | sources: " + " | ".join(f"{name} {100 * count / total:.0f}% "
                                       f"({_format_count(count)})"
                                       for name, count in counts.items())


class Progress:
    """Logs each loop (step, loss, metrics, examples/s, ETA) and writes summaries.

    Throughput is wall time per loop on the host, so it includes input waits and
    any host work between loops; the first loop also includes tracing, compiling
    and the input's start-up, and its line says so before its rates.
    `summary_dir=None` logs without writing (non-chief workers).
    """

    def __init__(self, summary_dir: str | None, train_steps: int, global_batch_size: int,
                 steps_per_fetch: int = 1):
        self.steps_per_fetch = steps_per_fetch  # the stall advice's knob (`stall_advice`)
        self.train_steps = train_steps  # the step this run ends at (`Controller.run` sets it)
        self.global_batch_size = global_batch_size
        self._writers: dict[str, tf.summary.SummaryWriter] = {}
        self._eval_writers: dict[str, EvalEventWriter] = {}  # keep every eval step visible
        self._summary_dir = summary_dir
        self._steps_per_second: float | None = None
        self._flops_per_step: float | None = None
        self._peak_flops: float | None = None
        self._raise_peak: Callable[[float], None] | None = None  # a measured peak
        self._first_loop: tuple[int, float] | None = None  # (steps, seconds) until priced
        self._pending_count: Callable[[], None] | None = None
        self._stall_explained = False  # `stall_advice`, once a run
        self._on_close: list[Callable[[], None]] = []  # e.g. the live bar's end
        self.summary_space = SummarySpace()  # a full disk: writes skipped, one warning a run

    @classmethod
    def for_run(cls, summary_dir: str | None, plan: Any) -> "Progress":
        """A run's progress: its train steps, global batch and steps per fetch as `plan`
        (the run's `tputrain.runtime.plan.RunPlan`) resolved them."""
        return cls(summary_dir, plan.options.train_steps, plan.batch.global_batch_size,
                   plan.steps_per_fetch)

    @property
    def summary_dir(self) -> str | None:
        """The TensorBoard root of the run (`train/`, `eval/`); None: not written here."""
        return self._summary_dir

    def set_flops(self, flops_per_step: float, peak_flops: float,
                  raise_peak: Callable[[float], None] | None = None) -> None:
        """Enables MFU each loop (`tputrain.observe.flops.model_flops_utilization`).

        `raise_peak`: the peak is a measurement (a CPU's matmul probe), so a loop that
        runs more FLOP/s than it raises it to that rate, and `raise_peak` keeps it."""
        self._flops_per_step = float(flops_per_step)
        self._peak_flops = float(peak_flops)
        self._raise_peak = raise_peak

    def _raise_measured_peak(self, achieved: float) -> None:
        if self._raise_peak is None or achieved <= self._peak_flops:
            return
        logging.info("tputrain: %.4g FLOP/s, above the measured peak %.4g FLOP/s (probed "
                     "while other work ran?): the peak is raised to it", achieved,
                     self._peak_flops)
        self._peak_flops = achieved
        self._raise_peak(achieved)

    def count_flops_later(self, count: Callable[[], None]) -> None:
        """Defers a FLOP count (`count` calls `set_flops`): it traces the step once more,
        which need not delay the first step. It runs when `ideal_step_seconds` is first
        read (a plan that depends on it) or at `count_pending_flops`."""
        self._pending_count = count

    def count_pending_flops(self) -> None:
        """Runs a deferred FLOP count, once."""
        count, self._pending_count = getattr(self, "_pending_count", None), None
        if count is not None:
            count()

    @property
    def ideal_step_seconds(self) -> float | None:
        """A step's FLOPs over the device's peak (the time at 100% MFU); None unknown."""
        self.count_pending_flops()
        flops, peak = getattr(self, "_flops_per_step", None), getattr(self, "_peak_flops", None)
        return flops / peak if flops and peak else None

    def _writer(self, split: str) -> tf.summary.SummaryWriter | None:
        if self._summary_dir is None:
            return None
        if split not in self._writers:
            self._writers[split] = tf.summary.create_file_writer(
                os.path.join(self._summary_dir, split))
        return self._writers[split]

    def write_scalars(self, split: str, step: int, scalars: Mapping[str, float]) -> None:
        """Writes `scalars` at `step` as TensorBoard scalars (the values
        `tf.summary.scalar` writes), built here as one Summary proto and written by one
        op: a summary op per tag cost several times the host time between loops
        (docs/performance.md, Design measurements)."""
        if not scalars or self._summary_dir is None:
            return
        summary = summary_pb2.Summary()
        for name, value in scalars.items():
            summary.value.extend(scalar_summary.scalar_pb(name, float(value)).value)
        directory = os.path.join(self._summary_dir, split)
        if not self.summary_space.write(directory,
                                        lambda: self._write(split, directory, step, summary)):
            self._drop_writer(split)

    def _write(self, split: str, directory: str, step: int,
               summary: summary_pb2.Summary) -> None:
        if split == "eval" or split.startswith("eval/"):  # eval/, or eval/<set>/: evaluations
            if split not in self._eval_writers:  # may come out of step order (eval_events)
                self._eval_writers[split] = EvalEventWriter(directory)
            self._eval_writers[split].write(step, summary)
            return
        writer = self._writer(split)
        with writer.as_default(step=step):
            tf.summary.experimental.write_raw_pb(summary.SerializeToString())
        writer.flush()

    def _drop_writer(self, split: str) -> None:
        """Closes (as far as a full disk lets it) and forgets the split's writer, so that
        the next write opens a new event file: once there is room, it is written."""
        for writers in (self._writers, self._eval_writers):
            writer = writers.pop(split, None)
            if writer is not None:
                self.summary_space.write(os.path.join(self._summary_dir, split), writer.close)

    def train_loop_done(self, step: int, steps: int, seconds: float,
                        logs: Mapping[str, float], input_wait: float = 0.0) -> dict[str, float]:
        """Records a finished loop of `steps` steps ending at `step`; returns rates.

        `input_wait` is the time the compiled loop spent blocked on the next batch
        (between timestamps around each `get_next`, the fetch's own cost included;
        see `tputrain.loop.host_loop`); `input/stall_fraction` is its share of the
        loop's wall time, which in the first loop also holds tracing and compiling,
        and its wait the pipeline's first batch (the line marks both). It does not
        count a pipeline that slows the step by competing for host cores:
        `tputrain diagnose` measures that (docs/input_pipeline.md).
        """
        steps_per_second = steps / max(seconds, 1e-9)
        rates = {"steps_per_second": steps_per_second,
                 "examples_per_second": steps_per_second * self.global_batch_size,
                 "input/stall_fraction": min(1.0, input_wait / max(seconds, 1e-9))}
        tokens, shown = _token_rates(logs, steps_per_second, rates), _line_logs(logs)
        tokens += _source_words(logs)
        mfu = ""
        if self._flops_per_step and self._peak_flops:
            self._raise_measured_peak(self._flops_per_step * steps_per_second)
            rates["mfu"] = model_flops_utilization(self._flops_per_step, steps_per_second,
                                                   self._peak_flops)
            rates["mfu"] *= 1.0 - float(logs.get("padding", 0.0))  # real tokens' FLOPs only
            mfu = f" | MFU {100 * rates['mfu']:.1f}%"
        first = self._steps_per_second is None and getattr(self, "_first_loop", None) is None
        logging.info("tputrain: step %d/%d | %s | %s%.0f examples/s%s | %s steps/s%s | "
                     "input stall %.1f%%%s", step, self.train_steps, _format_logs(shown),
                     FIRST_LOOP if first else "", rates["examples_per_second"], tokens,
                     _format_rate(steps_per_second), mfu, 100 * rates["input/stall_fraction"],
                     self._timing(step, steps, seconds))
        if not first:
            self._advise_on_stall(rates["input/stall_fraction"], input_wait / max(steps, 1))
        self.write_scalars("train", step, {**logs, **rates})
        return rates

    def _advise_on_stall(self, fraction: float, per_step: float) -> None:
        """Explains an input stall above STALL_ADVICE, once a run (the first loop's, which
        holds the pipeline's first batch, is none)."""
        if fraction > STALL_ADVICE and not getattr(self, "_stall_explained", False):
            self._stall_explained = True
            logging.info("%s", stall_advice(fraction, per_step, self.steps_per_fetch))

    def _timing(self, step: int, steps: int, seconds: float) -> str:
        """The line's tail. The first loop gives no ETA (its line says it compiles,
        `FIRST_LOOP`); the next one shows that loop's time beyond its steps at the
        steady rate as `compile` (as `tputrain.observe.goodput` splits it), and the ETA from
        the loops after the first."""
        remaining = max(0, self.train_steps - step)
        if self._steps_per_second is None and getattr(self, "_first_loop", None) is None:
            self._first_loop = (steps, seconds)
            return f" | ETA {'next loop' if remaining else '0s'}"
        steps_per_second = steps / max(seconds, 1e-9)
        compile_figure = ""
        if getattr(self, "_first_loop", None) is not None:
            first_steps, first_seconds = self._first_loop
            compile_seconds = max(0.0, first_seconds - first_steps / steps_per_second)
            compile_figure = f" | compile {_format_duration(compile_seconds)}"
            self._first_loop = None
        self._steps_per_second = (steps_per_second if self._steps_per_second is None else
                                  0.7 * self._steps_per_second + 0.3 * steps_per_second)
        return f"{compile_figure} | ETA {_format_duration(remaining / self._steps_per_second)}"

    def eval_done(self, step: int, logs: Mapping[str, float], seconds: float,
                  eval_steps: int | None = None, averaged: bool = False) -> None:
        steps = f" | {eval_steps} eval steps" if eval_steps is not None else ""
        weights = " (EMA weights)" if averaged else ""
        logging.info("tputrain: eval at step %d%s | %s%s | %.1fs", step, weights,
                     _format_logs(logs), steps, seconds)
        self.write_scalars("eval", step, logs)

    def eval_sets_done(self, step: int, per_set: Mapping[str, tuple[Mapping[str, float], int]],
                       seconds: float, averaged: bool = False) -> None:
        """Named eval sets (`TrainerOptions.eval_splits`): one line, a TensorBoard run
        per set (eval/<set>/, the single split's tags)."""
        weights = " (EMA weights)" if averaged else ""
        sets = " | ".join(f"{name}: {_format_logs(logs)} ({steps} eval steps)"
                          for name, (logs, steps) in per_set.items())
        logging.info("tputrain: eval at step %d%s | %s | %.1fs", step, weights, sets, seconds)
        for name, (logs, _) in per_set.items():
            self.write_scalars(f"eval/{name}", step, logs)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Calls `callback` at `close` (the end of `train()`, an error's too)."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Closes the event files; the eval run's first restates what its lower steps hid."""
        callbacks, self._on_close = getattr(self, "_on_close", []), []
        for callback in callbacks:
            callback()
        for split in [*self._writers, *self._eval_writers]:
            self._drop_writer(split)  # a full disk: the pending points are lost, said once


class Stopwatch:
    """Wall-clock timer: `with Stopwatch() as t: ...; t.seconds`."""

    def __enter__(self) -> "Stopwatch":
        self._start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start
