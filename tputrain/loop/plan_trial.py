"""The plan trial: `jit_compile="auto"` times the plausible XLA plans and keeps the fastest.

`decide_xla`'s rules were each measured on one machine; a user's CPU is another.
With `Trainer.plan_trial` "auto" (the default) or True, where more than one plan is
plausible for the model on a CPU (the rules' plan, `jit_compile=True`'s and none: XLA
for the whole step against none at least), the first loop of `train()` first builds
the run's own train loop for each (its steps per XLA program included), runs it for
`WARMUP_STEPS` untimed steps (its trace and compile) and `TIMED_STEPS` timed ones
on a stand-in batch (`Inputs.stand_in_iterator`: the train split's first batch,
read at start-up, or zeros of its shape; the user's data is not read again, so
a reshuffling dataset's order and a Python source's elements are the run's), on the
run's variables saved before and written back after each (so the weights a run
trains are bitwise those of a run without the trial), keeps the plan with the
least CPU time a step (`clock`), logs the table in one line and records the choice
in `model_dir/plan.json` (`RunDirectory.plan_record`), keyed by the model,
precision, strategy and CPU kind (`plan_key`), and for the machine
(`MachineRecord`, under `TPUTRAIN_CACHE_DIR`). The rules' plan is timed first;
the trial stops trying plans when the next would take it over `TIME_SHARE` of the
run's estimated time (`over_share`): it trains with the best plan timed so far, and
its table names the plans not tried and why (a cut-short choice is recorded in
model_dir only, not for the machine: a longer run here still tries every plan).
The winner's loop is kept when it
was built last, else built again (XLA's cache holds its programs). A resume runs
model_dir's plan without a trial (bitwise resume kept; a record that cannot be
read stops a resume rather than let it switch plans); another run of the same
model on the same machine runs the machine's plan without a trial, so two runs
(a test's reference and its resumed chain, each in its own model_dir) never train
with different plans because two trials timed differently: the machine's first
record stands, and a trial that finds one written meanwhile trains with it.

A run shorter than `RUN_SHARE` times the trial's steps has no trial. With "auto" it
records nothing and reads no machine record: it runs the rules' plan as with the
trial off and leaves model_dir as such a run does (the default suite's short runs,
and the tests of model_dir's files, see no new file). A resume of a run that
recorded no plan keeps the rules' plan its steps ran, so a model_dir trains with
one plan throughout. True forces the trial on such a resume, and a short run
records the rules' plan in model_dir, so a longer resume keeps it.

No trial: jit_compile=True or False (a pinned plan), plan_trial=False, a TPU (the
whole step, always compiled), a GPU, several hosts (each would choose alone), a
Task's own `train_step` on several replicas, `run_loop` outside `train()`. The
trial's time is counted in goodput's compile bucket (`tputrain.observe.goodput.timed`).
Steps per XLA program are not part of the trial (each count is another compile).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Callable, ContextManager, NamedTuple

import keras
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.atomic import atomic_path, write_atomically
from tputrain.checkpointing.files import first_line
from tputrain.checkpointing.run_directory import ModelDirError, RunDirectory
from tputrain.checkpointing.seeds import seed_generator_states
from tputrain.core.cache_dir import cache_root
from tputrain.core.cpu_info import cpu_name
from tputrain.distribution.strategy import without_gpus
from tputrain.loop.random_draws import features_spec
from tputrain.loop.source_counts import checkpointed
from tputrain.loop.step import StepBuilder
from tputrain.loop.compile_cache import cpu_key
from tputrain.loop.convolutions import onednn_enabled
from tputrain.loop.xla_plan import XLA_OFF, XlaPlan, decide_xla, fused_forward

WARMUP_STEPS = 2  # untimed steps a candidate (at least one program launch): its compile
TIMED_STEPS = 10  # timed steps a candidate (rounded up to whole program launches)
RUN_SHARE = 10  # no trial for a run of fewer than RUN_SHARE x the trial's steps
TIME_SHARE = 0.1
"""The most of a run's time the trial may take. Its cost is mostly compiling, which
no count of steps bounds: before each candidate after the first, the trial stops
when its cost so far and the next candidate's (the largest compile and warm-up seen
so far, plus its timed steps) would exceed this share of the run's estimated time
(its remaining steps at the best step time measured), and trains with the best plan
timed so far. The rules' plan is timed first, so a cut-short trial keeps it: a first
short run of a model pays little more than its own compile."""
VERSION = 1
# What the trial times with: the process's CPU seconds (all threads), less swayed by
# other jobs on the machine than wall time. A test sets its own to decide the winner.
clock: Callable[[], float] = time.process_time
# What a candidate's build, compile and warm-up steps are timed with (wall seconds:
# the table's and TIME_SHARE's). A test sets its own to decide the bound.
compile_clock: Callable[[], float] = time.perf_counter

_FIELDS = tuple(f for f in XlaPlan._fields if f != "why")


class Timing(NamedTuple):
    """One candidate's row of the trial's table."""

    plan: XlaPlan
    seconds: float | None  # `clock` seconds a timed step; None: refused by XLA or not tried
    compile_seconds: float  # wall seconds of its untimed steps (trace, compile, one step)
    timed_steps: int = 0  # the timed steps it ran
    not_tried: str | None = None  # why the trial stopped before it (TIME_SHARE)


def describe(plan: XlaPlan) -> str:
    """What `plan` compiles, in a few words (the trial's table)."""
    parts = []
    if plan.whole_step:
        parts.append("whole step")
    if plan.gradients_only:
        parts.append("forward/backward")
    if plan.apply_only or plan.apply_per_replica:
        parts.append("update" + (" per device" if plan.apply_per_replica else ""))
    if plan.fuse_elementwise:
        parts.append("GELUs/layer norms")
    name = " + ".join(parts) or "none"
    return name + (" (fused batch norms)" if plan.fuse_batch_norm else "")


def _fields(plan: XlaPlan) -> tuple:
    return tuple(getattr(plan, name) for name in _FIELDS)


def candidates(builder: StepBuilder, train_spec: Any) -> list[XlaPlan]:
    """The plausible plans, each once: the rules' ("auto"'s, first: a trial cut short
    by TIME_SHARE keeps it), then jit_compile=True's and none."""
    run_plan = builder.run_plan
    features = features_spec(train_spec, run_plan.batch.accumulation_steps,
                             builder.source_counter.key if builder.source_counter else None)
    pinned_on = decide_xla(True, run_plan.precision, run_plan.custom_train_step,
                           builder.strategy, builder.model, builder.optimizer, features)
    rules = run_plan.xla_plan
    plans, seen = [], {_fields(rules)}
    for plan in (pinned_on, fused_forward(XLA_OFF, True)):
        if _fields(plan) not in seen:
            seen.add(_fields(plan))
            plans.append(plan)
    return [rules] + plans


def why_not(builder: StepBuilder, num_hosts: int, remaining: int | None) -> str | None:
    """Why this run has no trial (a pinned plan, a TPU, ...), or None."""
    run_plan = builder.run_plan
    if run_plan.options.plan_trial is False or run_plan.jit_compile != "auto":
        return "not asked" if run_plan.options.plan_trial is False else "jit_compile pinned"
    if isinstance(builder.strategy, tf.distribute.TPUStrategy):
        return "a TPU compiles the whole step"
    if not without_gpus(builder.strategy):
        return "CPU only"
    if num_hosts > 1:
        return "several hosts"
    if run_plan.custom_train_step and builder.strategy.num_replicas_in_sync > 1:
        return "a Task.train_step override on several replicas"
    return "not in train()" if remaining is None else None


def cpu_kind() -> str:
    """The CPU's model name and core count, the machine's key."""
    return f"{cpu_name()} x{os.cpu_count()}"


def plan_key(builder: StepBuilder, train_spec: Any) -> str:
    """What a recorded plan is valid for: the model (its layers' classes and weights'
    shapes, the input's spec, the optimizer's class), precision, strategy, CPU kind."""
    model = builder.model
    layers = [type(layer).__name__ for layer in model._flatten_layers(include_self=True, recursive=True)]  # pylint: disable=protected-access
    shapes = [(tuple(v.shape), str(v.dtype)) for v in model.variables]
    fingerprint = json.dumps([layers, shapes, str(train_spec), type(builder.optimizer).__name__,
                              builder.run_plan.custom_train_step])
    strategy = builder.strategy
    return json.dumps({
        "model": hashlib.sha256(fingerprint.encode()).hexdigest()[:16],
        "precision": builder.run_plan.precision,
        "strategy": f"{type(strategy).__name__} x{strategy.num_replicas_in_sync}",
        "cpu": cpu_kind()}, sort_keys=True)


def recorded_plan(entry: Any) -> XlaPlan:
    """The plan of a record's entry (`{"plan": {field: value}}`); ValueError naming what
    is wrong for one written by hand or by another version."""
    plan = entry.get("plan") if isinstance(entry, dict) else None
    if not isinstance(plan, dict):
        raise ValueError(f"its entry holds no plan: {entry!r}")
    missing = [name for name in XlaPlan._fields if name not in plan]
    wrong = [name for name in _FIELDS if name in plan and not isinstance(plan[name], bool)]
    if missing or wrong or not isinstance(plan.get("why"), str):
        raise ValueError(f"its plan {plan!r} lacks {missing} or has non-bool {wrong}")
    return XlaPlan(**{name: plan[name] for name in XlaPlan._fields})


class PlanRecord:
    """`model_dir/plan.json`: the plan chosen for each key (`plan_key`), written whole."""

    def __init__(self, model_dir: str):
        self.path = RunDirectory(model_dir).plan_record

    def entries(self, resumed: bool = False) -> dict[str, Any]:
        """The record's plans by key; {} when there is none (or it is unreadable: a
        warning; `resumed`, a `ModelDirError`, see `_damaged`)."""
        if not tf.io.gfile.exists(self.path):
            return {}
        try:
            with tf.io.gfile.GFile(self.path) as f:
                return dict(json.loads(f.read())["plans"])
        except (ValueError, KeyError, TypeError, tf.errors.OpError) as error:
            return self._damaged(error, resumed) or {}

    def read(self, key: str, resumed: bool = False) -> XlaPlan | None:
        """The plan recorded for `key`, or None (none, or not a plan: a warning; with
        `resumed`, a `ModelDirError`)."""
        entry = self.entries(resumed).get(key)
        if entry is None:
            return None
        try:
            return recorded_plan(entry)
        except ValueError as error:
            return self._damaged(error, resumed)

    def _damaged(self, error: Exception, resumed: bool) -> None:
        """A record that cannot be read is none for a run with no checkpoint yet (it
        chooses and records a plan); a resumed run stops: taken for none, the resume
        ran another plan than its steps so far, no longer bitwise, without a word."""
        text = first_line(error)
        if resumed:
            raise ModelDirError(
                f"{self.path} is damaged or unreadable ({text}): it holds the XLA plan this "
                "run's steps so far trained with: put it back (from a copy of model_dir), or "
                "delete it to choose the plan again (the resume is then not bitwise)")
        logging.warning("tputrain: ignoring the plan record %s (%s)", self.path, text)

    def write(self, key: str, plan: XlaPlan, table: str) -> None:
        """Records `plan` for `key` (beside the other keys' plans)."""
        entries = self.entries()
        entries[key] = {"plan": plan._asdict(), "table": table, "time": time.time()}
        write_atomically(self.path, json.dumps({"version": VERSION, "plans": entries},
                                               indent=1, sort_keys=True))


class MachineRecord:
    """The machine's plans, one file a key under `cache_root()/plans/`: written once (the
    first trial's choice stands, so runs in other model_dirs train as it did), read by
    every later run of the key. Its key is `plan_key` and what makes the same CPU kind
    run other code: its instruction set and any cap on it (`compile_cache.cpu_key`),
    oneDNN on or off, TensorFlow's version. Delete the folder to try the plans again."""

    def __init__(self, key: str):
        self.key = json.dumps([key, cpu_key(), onednn_enabled(), tf.__version__])
        digest = hashlib.sha256(self.key.encode()).hexdigest()[:24]
        self.path = os.path.join(cache_root(), "plans", f"{digest}.json")

    def read(self) -> tuple[XlaPlan, str] | None:
        """(the plan recorded for the key, its trial's table), or None."""
        try:
            with open(self.path, encoding="utf-8") as f:
                entry = json.load(f)
            if entry["key"] != self.key:
                return None
            return recorded_plan(entry), entry["table"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            logging.warning("tputrain: ignoring the plan record %s (%s)", self.path, error)
            return None

    def add(self, plan: XlaPlan, table_line: str) -> tuple[XlaPlan, str] | None:
        """Records `plan` unless a record exists (another process's trial, finished
        first): the record that stands, or None when the folder is not writable."""
        text = json.dumps({"version": VERSION, "key": self.key, "plan": plan._asdict(),
                           "table": table_line, "time": time.time()}, indent=1, sort_keys=True)
        try:
            with atomic_path(self.path, overwrite=False) as temp, \
                    open(temp, "w", encoding="utf-8") as f:
                f.write(text)
        except FileExistsError:
            pass  # another process's trial recorded the key first: its record stands
        except OSError as error:
            logging.warning("tputrain: cannot record the plan in %s (%s): a run in another "
                            "model_dir tries the plans again", self.path, error)
            return None
        return self.read()


def held_tf_variables(model: keras.Model) -> list[tf.Variable]:
    """The plain tf.Variables in the model's object graph (what its checkpoint holds
    beyond its Keras variables): a `tf.random.Generator`'s state, a layer's own."""
    return [t for t in tf.train.TrackableView(model).descendants() if isinstance(t, tf.Variable)]


class SavedState:
    """The values of the variables a train step writes, written back by `restore`: the
    model's (weights, statistics, seed generators, any other tf.Variable it holds), the
    optimizer's, the guard's and a mixture's counts, and `variables` (the step counter,
    the EMA); each device's copy of a distributed variable on its own."""

    def __init__(self, builder: StepBuilder, variables: list[Any]):
        trackables = [*variables, *builder.model.variables, *builder.optimizer.variables,
                      *seed_generator_states(builder.model), *held_tf_variables(builder.model),
                      *(v for v in vars(builder.guard).values() if isinstance(v, tf.Variable)),
                      *checkpointed(builder.source_counter).values()]
        self.saved: list[tuple[tf.Variable, tf.Tensor]] = []
        seen = set()
        for variable in trackables:
            for component in _components(variable):
                if id(component) not in seen:
                    seen.add(id(component))
                    self.saved.append((component, tf.identity(component.read_value())))

    def restore(self) -> None:
        for component, value in self.saved:
            component.assign(value)


def _components(variable: Any) -> list[tf.Variable]:
    """The tf.Variables holding `variable`: a Keras variable's, each device's copy."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


class TrialRun(NamedTuple):
    """What the trial runs each plan with: the run's own train loop and state."""

    builder: StepBuilder  # its `run_plan` is set to each candidate's in turn
    build_loop: Callable[[], tuple[Callable, int]]  # `host_loop.train_loop` for it
    iterator: Callable[[], Any]  # a stand-in train iterator (no user data read)
    variables: list[Any]  # what the loop writes beyond the step's: counter, EMA


def time_plan(trial: TrialRun, plan: XlaPlan) -> tuple[Timing, Any]:
    """Builds the run's train loop for `plan` (its steps per program included) and
    times it: (the row, (loop, steps per program)); the caller restores the state."""
    builder = trial.builder
    builder.run_plan = dataclasses.replace(builder.run_plan, xla_plan=plan)
    start = compile_clock()
    loop, program_steps = trial.build_loop()
    if _fields(builder.plan()) != _fields(plan):  # XLA refused it (`StepBuilder._compiles`)
        return Timing(plan, None, compile_clock() - start), None
    iterator = trial.iterator()
    int(loop(iterator, max(WARMUP_STEPS, program_steps))[1])  # traced, compiled, warm
    compile_seconds = compile_clock() - start
    timed = program_steps * -(-TIMED_STEPS // program_steps)  # whole launches
    begin = clock()
    ran = int(loop(iterator, timed)[1])
    seconds = (clock() - begin) / ran if ran else None
    return Timing(plan, seconds, compile_seconds, ran), (loop, program_steps)


def over_share(timings: list[Timing], remaining: int) -> bool:
    """Whether timing one more plan would take the trial over TIME_SHARE of the run:
    its cost so far (compiles and warm-ups, timed steps) and the next plan's expected
    one (the largest compile and warm-up so far, TIMED_STEPS at the slowest step
    time so far) against `remaining` steps at the best step time so far. False
    before any plan ran a timed step (nothing to estimate the run by)."""
    steps = [t.seconds for t in timings if t.seconds is not None]
    if not steps:
        return False
    spent = sum(t.compile_seconds + (t.seconds or 0.0) * t.timed_steps for t in timings)
    expected = max(t.compile_seconds for t in timings) + TIMED_STEPS * max(steps)
    return spent + expected > TIME_SHARE * remaining * min(steps)


def table(timings: list[Timing], chosen: XlaPlan) -> str:
    """The trial in one line: each plan's CPU time a step (and its compile's wall time)."""
    rows = [f"{describe(t.plan)}: not tried: {t.not_tried}" if t.not_tried else
            f"{describe(t.plan)}: " + ("refused by XLA" if t.seconds is None else
                                       f"{1e3 * t.seconds:.3f} ms/step")
            + f" (compile {t.compile_seconds:.1f}s)" for t in timings]
    return f"{' | '.join(rows)} -> {describe(chosen)} (CPU time a step)"


def run_trial(trial: TrialRun, plans: list[XlaPlan],
              remaining: int) -> tuple[XlaPlan, list[Timing], Any]:
    """Times each of `plans` on the run's state, written back after each, until the
    next would take the trial over TIME_SHARE of a run of `remaining` steps
    (`over_share`; the rest are rows "not tried"): (the fastest, the table's rows,
    its loop if it was built last, else None). The rules' plan (the first) if XLA
    refused every other."""
    builder = trial.builder
    original = builder.run_plan
    saved = SavedState(builder, trial.variables)
    timings, loops, built = [], {}, []
    try:
        for plan in plans:
            if over_share(timings, remaining):
                timings.append(Timing(plan, None, 0.0,
                                      not_tried=f"over {TIME_SHARE:.0%} of the run"))
                continue
            try:
                timing, loop = time_plan(trial, plan)
                timings.append(timing)
                loops[_fields(plan)] = (loop, builder.run_plan)
                built.append(_fields(plan))
            finally:
                saved.restore()
    finally:
        builder.run_plan = original
    timed = [t for t in timings if t.seconds is not None]
    fastest = min(timed, key=lambda t: t.seconds).plan if timed else plans[0]
    if built and built[-1] == _fields(fastest) and loops[built[-1]][0] is not None:
        loop, builder.run_plan = loops[built[-1]]  # its step's Python state is current
        return fastest, timings, loop
    return fastest, timings, None


class Choice(NamedTuple):
    """The plan a run trains with, and its train loop if the trial built it last."""

    plan: XlaPlan
    loop: tuple[Callable, int] | None = None


_TIMED = Choice(XLA_OFF)  # `_no_trial`'s answer for a run the trial times


def _no_trial(builder: StepBuilder, record: PlanRecord, key: str, remaining: int,
              step: int, trial_steps: int) -> Choice | None:
    """`chosen_plan`'s answer for a run the trial does not time (too short, or with
    plan_trial "auto" a resume of a run that recorded no plan), else `_TIMED`. "auto"
    records nothing: None, the rules' plan stands as with the trial off; True records
    the rules' plan of a short run, so a longer resume keeps it."""
    rules, forced = builder.run_plan.xla_plan, builder.run_plan.options.plan_trial is True
    if remaining < RUN_SHARE * trial_steps:
        if not forced:  # silent: a short run's log is as with the trial off
            return None
        logging.info("tputrain: no plan trial for a run of %d steps (under %d x the trial's "
                     "%d): the rules' plan (%s) is recorded in %s", remaining, RUN_SHARE,
                     trial_steps, describe(rules), record.path)
        record.write(key, rules, "the rules' plan (a run too short for the trial)")
        return Choice(rules)
    if step > 0 and not forced:
        logging.info("tputrain: no plan trial at step %d: %s records no plan, so its steps "
                     "ran the rules' plan (%s), which it keeps (plan_trial=True tries the "
                     "plans)", step, record.path, describe(rules))
        return None
    return _TIMED


def _machine_choice(record: PlanRecord, key: str, machine: MachineRecord,
                    known: tuple[XlaPlan, str]) -> Choice:
    """The machine's recorded plan for this run, recorded in model_dir too (a resume
    keeps it even if the machine's record goes)."""
    plan, line = known
    logging.info("tputrain: XLA plan %s, recorded on this machine in %s (delete it to try "
                 "the plans again)", describe(plan), machine.path)
    record.write(key, plan, line)
    return Choice(plan._replace(
        why=f"auto: {describe(plan)} (recorded on this machine in {machine.path}: {line})"))


def chosen_plan(trial: TrialRun, train_spec: Any, model_dir: str, num_hosts: int,
                remaining: int | None,
                timing: Callable[[], ContextManager] = contextlib.nullcontext,
                step: int = 0) -> Choice | None:
    """The plan this run trains with where the trial decides (`why_not`), else None
    (the rules' plan stands): model_dir's record for this key, the rules' plan for a
    run the trial does not time (`_no_trial`), the machine's record, or the trial's
    choice (`timing()` around it: goodput's compile bucket), recorded in model_dir
    and, unless cut short, for the machine. `remaining`: the steps train() has left; `step`: its first."""
    builder = trial.builder
    if why_not(builder, num_hosts, remaining) is not None:
        return None
    key, record = plan_key(builder, train_spec), PlanRecord(model_dir)
    recorded = record.read(key, resumed=step > 0)  # a resume keeps its steps' plan
    if recorded is not None:
        logging.info("tputrain: XLA plan %s, recorded in %s (delete it to try the plans "
                     "again)", describe(recorded), record.path)
        return Choice(recorded._replace(
            why=f"auto: {describe(recorded)} (recorded in {record.path})"))
    plans = candidates(builder, train_spec)
    if len(plans) == 1:
        return None
    skipped = _no_trial(builder, record, key, remaining, step,
                        len(plans) * (WARMUP_STEPS + TIMED_STEPS))
    if skipped is not _TIMED:
        return skipped
    machine = MachineRecord(key)
    known = machine.read()
    if known is not None:
        return _machine_choice(record, key, machine, known)
    with timing():
        chosen, timings, loop = run_trial(trial, plans, remaining)
    line = table(timings, chosen)
    logging.info("tputrain: plan trial: %s", line)
    # Cut short (TIME_SHARE), it did not measure every plan: not the machine's record,
    # so a longer run of this model here still tries them all.
    cut_short = any(t.not_tried for t in timings)
    stands = None if cut_short else machine.add(chosen, line)
    if stands is not None and _fields(stands[0]) != _fields(chosen):
        logging.info("tputrain: another run on this machine recorded its trial first: it "
                     "stands")
        return _machine_choice(record, key, machine, stands)
    record.write(key, chosen, line)
    return Choice(chosen._replace(
        why=f"auto: {describe(chosen)} (fastest in the plan trial: {line})"), loop)
