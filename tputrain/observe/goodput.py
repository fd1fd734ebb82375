"""Goodput: where a run's wall-clock time went, and a job's across restarts.

Every `Trainer.train()` on the chief keeps a record in
`model_dir/goodput/run-<n>.json` (one per process; `n` counts the restarts of
that model_dir), rewritten atomically after each loop, save and evaluation, so
a run killed with SIGKILL leaves its account up to its last loop. `account()`
reads them all and `format_account()` prints them (`tputrain goodput`).

How each bucket is measured (docs/performance.md#goodput):

- start-up: `import` is tputrain's import to `Trainer()`: imports (TensorFlow's
  when tputrain is imported first) and config parsing. Only the first Trainer of
  a process counts it. The time before tputrain's import (the interpreter, the
  modules imported before it, a shell's work before it exec'd Python: an install
  in `sh -c 'pip install ... && exec tputrain ...'`) is not counted: the record
  keeps it as `before_start` (`tputrain.runtime.process_start`). `strategy`,
  `data` (input pipelines built and probed) and `model` (model, optimizer,
  metrics) are marked by the Trainer (`StartupClock.mark`); `restore` is the
  rest of `Trainer()` and `train()`'s restore; `actions` is the other actions'
  set-up (timing the all-reduce before the first loop; the FLOP count and the
  CPU's peak probe, deferred past the first loop, through `timed`).
- loops: each loop's seconds (the Controller's stopwatch) less its input stall
  (`input/stall_fraction`) and all-reduce time (`comm/allreduce_fraction`, 0
  when absent). What remains is step time, except in the first loop, which also
  traces and compiles: compilation is that loop's time beyond its steps at the
  steady rate of the later loops (or of the previous run, or all of it when no
  rate is known).
- eval and checkpoint: the time up to `on_eval_end` / `on_save` since the
  previous hook; export: the Export action's SavedModels (`timed`), which it
  writes after those hooks, at the end of training most of all.
- CPU: the record also keeps the process's CPU seconds (all threads, since the
  process started) when `train()` begins and when its first loop ends.
- across runs: `recomputed` is the step time the previous run spent on steps
  past the checkpoint this run restored (steps x that run's seconds per step),
  moved out of `steps`; `restart` is the start-up of every run after the first;
  `down` is the time between the last record of a run that did not end cleanly
  (killed, crashed, preempted) and the next run's start. After a run that
  finished, that gap is `between_runs` (a person's pause before continuing): it
  is reported, and is not part of the job's wall time.
- `other` is the wall time no bucket holds: progress lines, TensorBoard, other
  actions between loops. An action's own work timed inside a loop (the FLOP count
  where the plan of steps per XLA program asks for it) is taken out of that
  loop, so no time counts twice and no bucket is negative.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import re
import socket
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import tensorflow as tf
from absl import logging

from tputrain.actions.base import Action
from tputrain.checkpointing.atomic import write_atomically
from tputrain.checkpointing.files import step_of
from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.runtime.context import ActionContext

from tputrain.runtime import process_start
from tputrain.runtime.process_start import process_start_time  # noqa: F401  (public here too)

RECORD_DIR = RunDirectory.GOODPUT
VERSION = 1
# The record's loop buckets; the account adds startup, restart, recomputed, down, other.
RUN_BUCKETS = ("compile", "steps", "input", "communication", "eval", "checkpoint", "export")
BUCKETS = ("startup", "restart", "compile", "steps", "recomputed", "input", "communication",
           "eval", "checkpoint", "export", "down", "other")
REMOTE_SAVE_SECONDS = 30.0  # a remote (gs://) record is rewritten at most this often
# goodput/* scalars at most this often (and at the end): a dozen summary ops cost ~5 ms.
SCALAR_SECONDS = 10.0
# What the account reads of a record; a record without them is skipped.
REQUIRED = ("start", "updated", "startup", "seconds", "restored_step", "last_step",
            "steps_trained")
_first_clock = True  # only the first StartupClock of a process counts the import time
_latest: RunRecord | None = None  # the record brought up to date at interpreter exit


def covered(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] inside any of `intervals`, each second once (timed work
    can nest: the MFU action's FLOP count inside the plan trial)."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total, reach = total + b - a, b
    return total


class StartupClock:
    """Times a Trainer's start-up phases: the Trainer calls `mark(phase)` after each.

    The first clock of a process starts at tputrain's import (its `import` phase is
    the imports and config after it; `before` the process's time before it, not
    counted: `tputrain.runtime.process_start`); a later Trainer's starts at its own.
    `run` holds this Trainer's goodput record once `train()` begins.
    """

    def __init__(self) -> None:
        global _first_clock
        self._epoch, self._perf = time.time(), time.perf_counter()
        self.start, self.source = self._epoch, "Trainer()"
        self.phases: dict[str, float] = {"import": 0.0}
        self.before: dict[str, Any] = {"seconds": 0.0}
        if _first_clock:
            origin = process_start.vouched()
            self.phases["import"] = max(0.0, self._perf - process_start.IMPORTED_PERF)
            self.start, self.source = self._epoch - self.phases["import"], origin["source"]
            self.before = {"seconds": origin["before"], "process_start": origin["process_start"],
                           "source": origin["process_start_source"]}
        _first_clock = False
        self._last = self._perf
        self.run: RunRecord | None = None

    def now(self) -> float:
        """Epoch seconds on the monotonic clock (records agree with the phases)."""
        return self._epoch + time.perf_counter() - self._perf

    def mark(self, phase: str, value: Any = None) -> Any:
        """Ends `phase` now (its time: since the last mark); returns `value`, so a
        call can wrap the statement that ends the phase."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now
        return value


class RunRecord:
    """One process's goodput record: buckets timed between the Controller's hooks."""

    def __init__(self, path: str | None, clock: StartupClock, step: int, run: int,
                 fallback_rate: float | None):
        self.path, self.clock, self.fallback_rate = path, clock, fallback_rate
        self.data: dict[str, Any] = {
            "version": VERSION, "run": run, "host": socket.gethostname(), "pid": os.getpid(),
            "start": clock.start, "start_source": clock.source, "updated": clock.now(),
            "process_start": process_start.process_start_time()[0],
            "before_start": dict(clock.before), "finished": False, "startup": dict(clock.phases),
            "seconds": {bucket: 0.0 for bucket in RUN_BUCKETS},
            "restored_step": step, "last_step": step, "steps_trained": 0,
            "last_checkpoint_step": None, "seconds_per_step": None,
            "first_loop": None, "later_loops": [0, 0.0],
            # The process's CPU seconds (all threads) since it started: less swayed by a
            # loaded machine than the wall times (benchmarks/restart_compile.py).
            "cpu": {"train_begin": time.process_time(), "first_loop_end": None}}
        self._cursor = time.perf_counter()
        self._timed: list[tuple[float, float]] = []  # `timed` intervals since the cursor
        self._starting = True  # until the first loop: time between hooks is start-up
        self._loop = (0, 0.0)
        self._saved_at = -float("inf")
        self._broken = False
        self._pending: tuple[int, Callable[[], int | None] | None] | None = None
        self.earlier: list[dict[str, Any]] = []  # model_dir's earlier runs (the job's account)

    def since_cursor(self) -> float:
        """Seconds since the last hook this record saw, less what `timed` counted in
        them (and moves the cursor)."""
        now = time.perf_counter()
        seconds = now - self._cursor - covered(self._timed, -math.inf, math.inf)
        self._cursor, self._timed = now, []
        return max(0.0, seconds)

    def add_timed(self, bucket: str, start: float, end: float) -> None:
        """An action's own work from `start` to `end` (perf_counter), into `bucket` (a
        run bucket, else a start-up phase); kept out of the hooks' and loops' time.
        Work timed inside it, recorded first (it ended first), stays in its own bucket."""
        seconds = end - start - covered(self._timed, start, end)
        if bucket == "compile":  # the plan trial's, beside the first loop's compile
            self.data["plan_trial"] = self.data.get("plan_trial", 0.0) + seconds
            self._split_first_loop()
        elif bucket in RUN_BUCKETS:
            self.add(bucket, seconds)
        else:
            startup = self.data["startup"]
            startup[bucket] = startup.get(bucket, 0.0) + seconds
        self._timed.append((start, end))

    def _timed_within(self, start: float, end: float) -> float:
        """Seconds of the `timed` work since the cursor that fell between start and end."""
        return covered(self._timed, start, end)

    def add(self, bucket: str, seconds: float) -> None:
        self.data["seconds"][bucket] += seconds

    def resume(self, step: int) -> None:
        """Another `train()` of the same Trainer: its gap is the caller's (other)."""
        self.since_cursor()
        self.data["finished"] = False
        self.data["last_step"] = step

    def loop_started(self, steps: int, seconds: float) -> None:
        """A loop of `steps` steps took `seconds`; the rest since the last hook is the
        other actions' set-up before the first loop, else host work (other). `timed`
        work inside the loop (a FLOP count the XLA plan asked for) is not the loop's."""
        now = time.perf_counter()
        inside = self._timed_within(now - seconds, now)
        between = max(0.0, self.since_cursor() - (seconds - inside))
        if self._starting:  # (plus what `timed` added to it)
            startup = self.data["startup"]
            startup["actions"] = startup.get("actions", 0.0) + between
            self._starting = False
        self._loop = (steps, seconds, inside)

    def loop_done(self, step: int, logs: Mapping[str, float]) -> None:
        """Splits the loop: input stall, all-reduce, then compile and steps."""
        steps, seconds, inside = self._loop
        stall = min(1.0, float(logs.get("input/stall_fraction", 0.0))) * seconds
        comm = min(1.0, float(logs.get("comm/allreduce_fraction", 0.0))) * seconds
        seconds = max(0.0, seconds - inside)
        stall = min(stall, seconds)
        work = max(0.0, seconds - stall - comm)
        self.add("input", stall)
        self.add("communication", max(0.0, min(comm, seconds - stall)))
        if self.data["first_loop"] is None:
            self.data["first_loop"] = [steps, work]
            self.data["cpu"]["first_loop_end"] = time.process_time()
        else:
            later = self.data["later_loops"]
            self.data["later_loops"] = [later[0] + steps, later[1] + work]
        self.data["steps_trained"] += steps
        self.data["last_step"] = step
        self._split_first_loop()

    def _split_first_loop(self) -> None:
        """compile = the first loop's work beyond its steps at the steady rate."""
        first_steps, first = self.data["first_loop"] or (0, 0.0)
        later_steps, later = self.data["later_loops"]
        rate = later / later_steps if later_steps else self.fallback_rate
        compile_seconds = first if rate is None else min(first, max(0.0, first - first_steps * rate))
        self.data["seconds"]["compile"] = compile_seconds + self.data.get("plan_trial", 0.0)
        self.data["seconds"]["steps"] = later + first - compile_seconds
        self.data["seconds_per_step"] = rate

    def checkpoint_saved(self, step: int, committed: Callable[[], int | None] | None) -> None:
        """Records `step`'s checkpoint once it is committed: at once (`committed` None),
        or for an async save once `committed()`, the newest committed step, reaches it.
        Named before its write landed, a kill left a record of a checkpoint that never
        was, and the rerun warned that the checkpoints folder had been deleted."""
        self._pending = (step, committed)
        self._settle()

    def _settle(self) -> None:
        if self._pending is None:
            return
        step, committed = self._pending
        try:
            landed = committed is None or (committed() or -1) >= step
        except (OSError, tf.errors.OpError):  # the state file unreadable now: ask again later
            return
        if landed:
            self.data["last_checkpoint_step"], self._pending = step, None

    def save(self, force: bool = False) -> None:
        """Rewrites the record atomically (chief only); remote model_dirs at most
        every REMOTE_SAVE_SECONDS unless `force`. A failed write warns once: the
        account is a diagnostic and never stops training."""
        self.data["updated"] = self.clock.now()
        if self.path is None or self._broken:
            return
        self._settle()
        if not force and "://" in self.path and (
                time.perf_counter() - self._saved_at < REMOTE_SAVE_SECONDS):
            return
        try:
            # Rewritten every loop, a diagnostic: whole, but not fsynced each time.
            write_atomically(self.path, json.dumps(self.data, indent=1), durable=False)
            self._saved_at = time.perf_counter()
        except (OSError, tf.errors.OpError) as error:
            self._broken = True
            logging.warning("tputrain: goodput record %s not written (%s); the run goes on "
                            "without it", self.path, error)


@contextlib.contextmanager
def timed(context: Any, bucket: str) -> Iterator[None]:
    """Adds the seconds of an action's own work, done after the hook that started it,
    to `bucket` of this run's record: "export" (the Export action's SavedModel),
    "compile" (the plan trial, `tputrain.loop.plan_trial`: kept as `plan_trial`) or the
    start-up phase "actions" (the MFU action's FLOP count and peak probe, deferred past
    the first loop, or inside it where the XLA plan asks for it). The next hook's bucket
    and a loop around it leave it out: nothing counts twice."""
    start = time.perf_counter()
    try:
        yield
    finally:
        clock = getattr(context, "startup", None)
        record = getattr(clock, "run", None)
        if record is not None:
            record.add_timed(bucket, start, time.perf_counter())
            record.save(force=True)


@atexit.register
def _at_exit() -> None:
    """The process's tail after its last hook (a crash's, or the CLI's after train())
    is part of its wall time: the latest record is rewritten if it is still there."""
    record = _latest
    if record is not None and record.path is not None and tf.io.gfile.exists(record.path):
        record.save(force=True)


def read_records(model_dir: str) -> list[dict[str, Any]]:
    """The run records of model_dir, oldest first; unreadable ones are skipped."""
    records = []
    for path in tf.io.gfile.glob(RunDirectory(model_dir).goodput_record("*")):
        match = re.search(r"run-(\d+)\.json$", path)
        try:
            with tf.io.gfile.GFile(path) as f:
                record = json.loads(f.read())
            record["run"] = int(match.group(1))
        except (OSError, ValueError, TypeError, AttributeError, tf.errors.OpError) as error:
            logging.warning("tputrain: skipping the goodput record %s (%s)", path, error)
            continue
        missing = [key for key in REQUIRED if key not in record]
        if missing:
            logging.warning("tputrain: skipping the goodput record %s (no %s)", path,
                            ", ".join(missing))
            continue
        records.append(record)
    return sorted(records, key=lambda record: record["run"])


# ------------------------------------------------------------------ the account


def _previous_rate(record: Mapping[str, Any]) -> float:
    """Seconds per step of a run: its steady rate, else its step time over its steps."""
    rate = record.get("seconds_per_step")
    if rate:
        return float(rate)
    return float(record["seconds"].get("steps", 0.0)) / max(1, int(record.get("steps_trained", 0)))


def _status(record: Mapping[str, Any], is_last: bool) -> str:
    """finished; stopped (a later run exists: killed, crashed or preempted); running
    (its process is alive on this host); else ended (no clean end, nothing after it)."""
    if record.get("finished"):
        return "finished"
    if not is_last:
        return "stopped"
    if record.get("host") == socket.gethostname():
        try:
            start, _ = process_start_time(int(record["pid"]))
        except (KeyError, ValueError):
            return "ended"
        started = float(record.get("process_start", record["start"]))
        if abs(start - started) < 2.0 and os.path.exists(f"/proc/{record['pid']}"):
            return "running"
    return "ended"


def run_summary(record: Mapping[str, Any], previous: Mapping[str, Any] | None,
                is_last: bool = True) -> dict[str, Any]:
    """One run's numbers, with what its restart cost relative to `previous`."""
    seconds = {bucket: float(record["seconds"].get(bucket, 0.0)) for bucket in RUN_BUCKETS}
    startup = {phase: float(value) for phase, value in record["startup"].items()}
    summary = {
        "run": int(record["run"]), "status": _status(record, is_last),
        "start": float(record["start"]), "updated": float(record["updated"]),
        "wall": max(0.0, float(record["updated"]) - float(record["start"])),
        "startup": sum(startup.values()), "startup_phases": startup, "seconds": seconds,
        "restored_step": int(record["restored_step"]), "last_step": int(record["last_step"]),
        "steps_trained": int(record["steps_trained"]),
        "last_checkpoint_step": record.get("last_checkpoint_step"),
        "recomputed_steps": 0, "recomputed_seconds": 0.0, "down": 0.0, "between_runs": 0.0,
        "before_start": float(record.get("before_start", {}).get("seconds", 0.0))}
    if previous is not None:  # after a clean end the gap is a pause, else down time
        gap = max(0.0, float(record["start"]) - float(previous["updated"]))
        summary["between_runs" if previous.get("finished") else "down"] = gap
        lost = max(0, int(previous["last_step"]) - int(record["restored_step"]))
        summary["recomputed_steps"] = lost
        summary["recomputed_seconds"] = min(float(previous["seconds"].get("steps", 0.0)),
                                            lost * _previous_rate(previous))
    return summary


def account_of(records: Sequence[Mapping[str, Any]], model_dir: str = "") -> dict[str, Any]:
    """The account of a job from its run records (oldest first): per run and in total,
    buckets in seconds and as fractions of the wall time that add up to 1."""
    runs = [run_summary(record, records[i - 1] if i else None, i == len(records) - 1)
            for i, record in enumerate(records)]
    totals = dict.fromkeys(BUCKETS, 0.0)
    for i, run in enumerate(runs):
        totals["restart" if i else "startup"] += run["startup"]
        for bucket in RUN_BUCKETS:
            totals[bucket] += run["seconds"][bucket]
        totals["steps"] -= run["recomputed_seconds"]  # done again by this run: lost
        totals["recomputed"] += run["recomputed_seconds"]
        totals["down"] += run["down"]
    wall = sum(run["wall"] + run["down"] for run in runs)
    named = sum(v for bucket, v in totals.items() if bucket != "other")
    # Buckets are timed apart and never overlap; a rounding's excess is wall time too.
    totals["other"], wall = max(0.0, wall - named), max(wall, named)
    fractions = {bucket: value / wall if wall > 0 else 0.0 for bucket, value in totals.items()}
    return {"model_dir": model_dir, "runs": runs, "wall": wall, "seconds": totals,
            "between_runs": sum(run["between_runs"] for run in runs),
            "fractions": fractions, "goodput": fractions["steps"],
            "recomputed_steps": sum(run["recomputed_steps"] for run in runs),
            "steps_trained": sum(run["steps_trained"] for run in runs)}


def account(model_dir: str) -> dict[str, Any]:
    """The goodput account of the job in model_dir: every run, finished or running
    (as of its last record), and the totals (`account_of`)."""
    return account_of(read_records(model_dir), model_dir)


def summary_line(result: Mapping[str, Any]) -> str:
    """One line: goodput, then the share of every bucket that holds time (those that
    round to 0.0% say nothing); a job with no loop after a first one has no steady
    rate to price its steps, and says so rather than "goodput 0.0%"."""
    fractions = result["fractions"]
    shares = " | ".join(f"{bucket} {100 * fractions[bucket]:.1f}%" for bucket in BUCKETS
                        if bucket != "steps" and round(100 * fractions[bucket], 1))
    runs = len(result["runs"])
    priced = result["seconds"]["steps"] > 0 or result["seconds"]["recomputed"] > 0
    head = (f"goodput {100 * result['goodput']:.1f}%" if priced else
            "goodput unknown (no loop after the first to price the steps: all compile)")
    between = result.get("between_runs", 0.0)
    return (f"{head} of {result['wall']:.1f}s over {runs} run{'s' if runs != 1 else ''} | "
            f"{shares}" + (f" | recomputed steps {result['recomputed_steps']}"
                           if result["recomputed_steps"] else "")
            + (f" | between runs {between:.0f}s (not counted)" if between else ""))


_BUCKET_NOTES = {
    "startup": "first run: import, strategy, data, model, restore, actions",
    "restart": "start-up of every later run",
    "compile": "tracing and compiling (first loop of each run)",
    "steps": "productive steps: the goodput",
    "recomputed": "steps done again after a restart",
    "input": "waiting for the next batch",
    "communication": "gradient all-reduce (estimated)",
    "eval": "evaluations",
    "checkpoint": "checkpoint saves",
    "export": "SavedModel exports (the Export action)",
    "down": "after a run that did not end cleanly (killed, crashed, preempted), to the "
            "next run's start",
    "other": "the rest: progress lines, TensorBoard, actions",
}


def _run_lines(result: Mapping[str, Any]) -> list[str]:
    """The per-run table: status, wall, start-up by phase, step range, restarts."""
    lines = [f"{'run':>4}  {'status':<8}  {'started':<19}  {'wall':>8}  {'start-up':>8}  "
             f"{'steps':>15}  {'last ckpt':>9}  {'recomputed':>10}  start-up phases (s)"]
    for run in result["runs"]:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["start"]))
        span = f"{run['restored_step']}->{run['last_step']}"
        ckpt = "-" if run["last_checkpoint_step"] is None else str(run["last_checkpoint_step"])
        phases = " ".join(f"{k} {v:.2f}" for k, v in run["startup_phases"].items())
        lines.append(f"{run['run']:>4}  {run['status']:<8}  {started:<19}  "
                     f"{run['wall']:>7.1f}s  {run['startup']:>7.1f}s  {span:>15}  {ckpt:>9}  "
                     f"{run['recomputed_steps']:>10}  {phases}")
    return lines


def format_account(result: Mapping[str, Any]) -> str:
    """The account as text: the runs, then each bucket's seconds and share (to 100%)."""
    if not result["runs"]:
        return (f"no goodput records in {RunDirectory(result['model_dir']).goodput}: "
                "train there first (records are written by the chief while it trains)")
    lines = [f"goodput of {result['model_dir']}: {100 * result['goodput']:.1f}% of "
             f"{result['wall']:.1f}s wall over {len(result['runs'])} run(s); "
             f"{result['recomputed_steps']} step(s) recomputed", ""]
    lines += _run_lines(result) + ["", f"{'bucket':<14} {'seconds':>9} {'share':>7}"]
    for bucket in BUCKETS:
        lines.append(f"{bucket:<14} {result['seconds'][bucket]:>9.2f} "
                     f"{100 * result['fractions'][bucket]:>6.1f}%  {_BUCKET_NOTES[bucket]}")
    total = sum(result["fractions"].values())
    lines.append(f"{'total':<14} {result['wall']:>9.2f} {100 * total:>6.1f}%")
    lines.append(f"{'between runs':<14} {result.get('between_runs', 0.0):>9.2f} not counted: "
                 "pauses after a run that finished, before the next one")
    before = sum(run["before_start"] for run in result["runs"])
    lines.append(f"{'before import':<14} {before:>9.2f} not counted: each process's time "
                 "before tputrain's import (interpreter, earlier imports, a shell's work "
                 "before exec)")
    return "\n".join(lines)


def scalars(result: Mapping[str, Any]) -> dict[str, float]:
    """goodput/<bucket> (share of the job's wall time) and goodput/recomputed_steps."""
    values = {f"goodput/{bucket}": float(v) for bucket, v in result["fractions"].items()}
    values["goodput/recomputed_steps"] = float(result["recomputed_steps"])
    return values


# ------------------------------------------------------------------ the action


class GoodputAction(Action):
    """Times this run's buckets between the Controller's hooks, rewrites its record
    after each loop (chief), writes goodput/* to TensorBoard and logs the account at
    the end. Built in, first: its start-up ends before the others' set-up."""

    def __init__(self) -> None:
        self.record: RunRecord | None = None
        self._scalars_at = -float("inf")

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        clock = getattr(context, "startup", None)
        if clock is None:  # a Trainer that did not make one: start-up unknown
            clock = context.startup = StartupClock()
        if clock.run is None:
            clock.mark("restore")  # the rest of Trainer(), then train()'s restore
            clock.run = _new_record(context, clock, step)
        else:  # another train() of the same Trainer: one record per process
            clock.run.resume(step)
        self.record = clock.run
        self.record.save(force=True)

    def loop_metrics(self, context: ActionContext, step: int, steps: int,
                     seconds: float) -> Mapping[str, float]:
        self.record.loop_started(steps, seconds)
        return {}

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        self.record.loop_done(step, logs)
        self.record.save()
        if time.perf_counter() - self._scalars_at >= SCALAR_SECONDS:
            self._write_scalars(context, step)

    def on_eval_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        self.record.add("eval", self.record.since_cursor())
        self.record.save()

    def on_save(self, context: ActionContext, step: int, path: str | None) -> None:
        self.record.add("checkpoint", self.record.since_cursor())
        if path is not None:
            self.record.checkpoint_saved(step, _committed_step(context))
        self.record.save(force=True)

    def on_train_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        self.record.since_cursor()  # the tail since the final hook: other
        if getattr(context, "checkpointer", None) is not None:
            context.checkpointer.sync()  # the final async save lands: the record names it
            self.record.add("checkpoint", self.record.since_cursor())
        self.record.data["finished"] = True
        self.record.save(force=True)
        self._write_scalars(context, step)
        if context.is_chief:
            logging.info("tputrain: %s", summary_line(self.job()))

    def _write_scalars(self, context: ActionContext, step: int) -> None:
        if context.is_chief:  # the job's shares so far, in train/
            context.progress.write_scalars("train", step, scalars(self.job()))
        self._scalars_at = time.perf_counter()

    def job(self) -> dict[str, Any]:
        """The account of the job so far: the earlier runs' records and this one."""
        return account_of([*self.record.earlier, self.record.data])


def _committed_step(context: ActionContext) -> Callable[[], int | None] | None:
    """For an async save (its write lands later): a call that reads the newest committed
    step from the state file; None when a save is committed by the time `on_save` runs."""
    checkpointer = getattr(context, "checkpointer", None)
    if checkpointer is None or not checkpointer.async_save:
        return None

    def newest() -> int | None:
        latest = checkpointer.latest
        return None if latest is None else step_of(latest)
    return newest


def _new_record(context: ActionContext, clock: StartupClock, step: int) -> RunRecord:
    """This process's record, numbered after model_dir's earlier runs (the chief's)."""
    earlier = read_records(context.model_dir) if context.is_chief else []
    run = _next_run(context.model_dir) if context.is_chief else 1
    path = (RunDirectory(context.model_dir).goodput_record(run)
            if context.is_chief else None)
    rates = [r["seconds_per_step"] for r in earlier if r.get("seconds_per_step")]
    global _latest
    record = RunRecord(path, clock, step, run, rates[-1] if rates else None)
    record.earlier, _latest = earlier, record
    _warn_if_checkpoints_lost(context.model_dir, earlier, step)
    return record


def _next_run(model_dir: str) -> int:
    """One past every record's number, readable or not: numbered after the last readable
    one, a run overwrote a damaged latest record (kept for a look, skipped by the account)."""
    numbers = [int(match.group(1)) for path in
               tf.io.gfile.glob(RunDirectory(model_dir).goodput_record("*"))
               if (match := re.search(r"run-(\d+)\.json$", path))]
    return max(numbers, default=0) + 1


def _warn_if_checkpoints_lost(model_dir: str, earlier: list[dict[str, Any]], step: int) -> None:
    """A run starting from step 0 where an earlier run's record says it saved a
    checkpoint: the checkpoints folder was deleted or moved (one warning, it trains on)."""
    saved = max((r.get("last_checkpoint_step") or 0 for r in earlier), default=0)
    if step == 0 and saved > 0:
        logging.warning(
            "tputrain: %s starts from step 0, but an earlier run there saved checkpoints up "
            "to step %d (its goodput records say so): its checkpoints folder %s was deleted "
            "or moved. Put it back and rerun to resume; training on starts over.",
            model_dir, saved, RunDirectory(model_dir).checkpoints)
