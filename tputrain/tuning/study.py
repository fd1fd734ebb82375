"""`tputrain tune`'s engine: a tuning spec searched locally with Optuna.

Each trial is a `tputrain run` subprocess with its own model_dir,
`<study_dir>/trial-<n>/`, its bindings as `--gin_param`s, and its output in
`trial-<n>.log`. It reports the spec's metric at each evaluation
(`tputrain.tuning.report`, the file Vertex AI reads too); the tuner reads it, hands
it to Optuna as the trial's intermediate value at that step and stops a trial the
pruner prunes (SIGTERM: it saves and exits 42). The study lives in
`<study_dir>/study.db` (SQLite): a tuner killed mid-study and started again
continues it. The trials it was running (stopped through their lifeline, as
`tputrain launch`'s workers are) resume from their checkpoints under the same
numbers; none is lost or run twice. A trial preempted while the tuner lives (it
saved and exited 42), and a tuner that gets SIGTERM or Ctrl-C, stop the study the
same way: the running trials are told to save (SIGTERM), are left as they are in
the study, and the rerun resumes them (`StudyStopped`). A trial that refuses its
config (exit 2) is recorded FAIL with a `refused` attribute and does not count
toward the spec's `trials`: fixed and rerun, the study still runs all of them.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from tputrain.distribution.launch import LAUNCHER_FD_ENV
from tputrain.fault_tolerance.preemption_early import PREEMPTED_EXIT_CODE
from tputrain.tuning.report import FILE_ENV, METRIC_ENV, TRIAL_ENV, read_report
from tputrain.tuning.spec import Param, TuningSpec, gin_literal

STUDY_NAME = "tputrain"
POLL_SECONDS = 0.5
ORPHAN_WAIT_SECONDS = 180.0  # a killed tuner's trials save and exit within this
EXIT_BAD_INPUT = 2
# A trial's exits that a rerun resumes from: saved on a signal (42); a second Ctrl-C
# (130: the last checkpoint stands); a signal before its handlers were in.
RESUMABLE_EXITS = (PREEMPTED_EXIT_CODE, 130, -signal.SIGTERM, -signal.SIGINT)
REFUSED = "refused"  # the user attribute of a trial that refused its config


class TrialConfigError(RuntimeError):
    """A trial refused its config (exit 2): every trial would; the study stops (the
    refused trial is not counted toward its `trials`)."""


class StudyStopped(RuntimeError):
    """The study stopped before its end (a trial preempted, the tuner signalled): its
    running trials saved and are left to the rerun, which resumes them."""


@dataclasses.dataclass
class RunningTrial:
    handle: Any  # optuna.trial.Trial
    process: subprocess.Popen
    report: str
    reported: set[int]
    pruned: bool = False
    stopping: bool = False  # told to save and exit by the tuner's stop


def open_study(spec: TuningSpec, study_dir: str) -> Any:
    """The study in `<study_dir>/study.db`, created or loaded."""
    import optuna  # pylint: disable=import-outside-toplevel  (the `tune` extra)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    os.makedirs(study_dir, exist_ok=True)
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=2) if spec.pruner == "median"
              else optuna.pruners.NopPruner())
    study = optuna.create_study(
        storage=f"sqlite:///{os.path.abspath(study_dir)}/study.db", study_name=STUDY_NAME,
        direction=spec.goal, sampler=optuna.samplers.TPESampler(seed=spec.seed),
        pruner=pruner, load_if_exists=True)
    # The sampler's state is not in the study: a continued study seeded as its first run
    # was would propose that run's points again. Its trials so far move the seed on.
    study.sampler = optuna.samplers.TPESampler(seed=spec.seed + len(study.trials))
    return study


def suggest(trial: Any, param: Param) -> Any:
    """The trial's value of `param` (a choice as its gin text: Optuna keeps scalars)."""
    if param.kind == "float":
        return trial.suggest_float(param.binding, param.low, param.high, log=param.log)
    if param.kind == "int":
        return trial.suggest_int(param.binding, param.low, param.high, log=param.log)
    return trial.suggest_categorical(param.binding, [gin_literal(v) for v in param.values])


def counted_trials(study: Any) -> list[Any]:
    """The trials that count toward the spec's `trials`: ended, but not refused."""
    import optuna  # pylint: disable=import-outside-toplevel
    states = optuna.trial.TrialState
    return [trial for trial in study.get_trials(states=(states.COMPLETE, states.PRUNED,
                                                        states.FAIL))
            if REFUSED not in trial.user_attrs]


def trial_bindings(spec: TuningSpec, values: dict[str, Any]) -> list[str]:
    """The gin bindings of a trial's values (a choice's value is its gin text)."""
    kinds = {param.binding: param.kind for param in spec.params}
    return [f"{name} = {value if kinds.get(name) == 'choice' else gin_literal(value)}"
            for name, value in values.items()]


class StudyRunner:
    """Runs a spec's trials (`parallel` at once) until the study has `trials` of them."""

    def __init__(self, spec: TuningSpec, study_dir: str, run_args: Sequence[str],
                 python: str = sys.executable):
        self.spec, self.study_dir, self.run_args, self.python = spec, study_dir, list(run_args), python
        self._lifeline_read, self._lifeline = os.pipe()  # EOF when this process dies
        self.log: list[str] = []
        self.study: Any = None
        self.stop_reason: str | None = None  # set: no trial starts, the running ones save
        self.refusal: str | None = None  # set: no trial starts, the running ones end

    def stop(self, reason: str) -> None:
        """Stops the study (a signal to the tuner, a trial preempted): no trial starts,
        the running ones save (SIGTERM) and are left to the rerun. Signal-safe."""
        self.stop_reason = self.stop_reason or reason

    def path(self, number: int, suffix: str = "") -> str:
        return os.path.join(self.study_dir, f"trial-{number}{suffix}")

    def run(self) -> Any:
        """Runs the study to its trial count; returns it. Raises TrialConfigError when a
        trial refused its config, StudyStopped when the study was stopped (`stop`)."""
        wait_for_orphans(self.study_dir, lambda: self.stop_reason is not None)
        self.study = study = open_study(self.spec, self.study_dir)
        import optuna  # pylint: disable=import-outside-toplevel
        resumed = [optuna.trial.Trial(study, t._trial_id)  # pylint: disable=protected-access
                   for t in study.get_trials(states=(optuna.trial.TrialState.RUNNING,))]
        running: list[RunningTrial] = []
        while True:
            while self._may_start(len(running), bool(resumed)):
                running.append(self._start(study, resumed.pop(0) if resumed else None))
            if self.stop_reason:
                self._tell_to_save(running)
            if not running:
                break
            time.sleep(POLL_SECONDS)
            running = [trial for trial in running if not self._poll(study, trial)]
        if self.refusal:
            raise TrialConfigError(self.refusal)
        if self.stop_reason:
            raise StudyStopped(f"{self.stop_reason}: rerun the same command to "
                               f"{left_to_resume(study)} (exit code {PREEMPTED_EXIT_CODE})")
        return study

    def _may_start(self, running: int, resumed: bool) -> bool:
        """Whether another trial starts now: a killed tuner's first, then new ones."""
        if self.stop_reason or self.refusal or running >= self.spec.parallel:
            return False
        return resumed or len(counted_trials(self.study)) + running < self.spec.trials

    def _tell_to_save(self, running: list[RunningTrial]) -> None:
        """The study stops: each running trial saves a checkpoint and exits 42."""
        for trial in running:
            if not trial.stopping and trial.process.poll() is None:
                trial.stopping = True
                trial.process.send_signal(signal.SIGTERM)

    def _start(self, study: Any, handle: Any | None) -> RunningTrial:
        """Starts a trial's run: a new one (`handle` None) or a killed tuner's."""
        handle = study.ask() if handle is None else handle
        for param in self.spec.params:  # a killed tuner's trial keeps the values it has
            suggest(handle, param)
        number, report = handle.number, self.path(handle.number, ".metrics")
        bindings = trial_bindings(self.spec, handle.params)
        env = dict(os.environ, **{METRIC_ENV: self.spec.metric, FILE_ENV: report,
                                  TRIAL_ENV: str(number),
                                  LAUNCHER_FD_ENV: str(self._lifeline_read)})
        with open(self.path(number, ".log"), "a", encoding="utf-8") as log:
            process = subprocess.Popen(
                [self.python, "-m", "tputrain.run", *self.run_args,
                 *(f"--gin_param={line}" for line in bindings),
                 f"--model_dir={self.path(number)}"],
                env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(self._lifeline_read,))
        with open(self.path(number, ".pid"), "w", encoding="utf-8") as f:
            f.write(f"{process.pid}\n")
        print(f"tputrain tune: trial {number} started: {'; '.join(bindings)}", flush=True)
        reported = set(study.trials[number].intermediate_values)
        return RunningTrial(handle, process, report, reported)

    def _poll(self, study: Any, trial: RunningTrial) -> bool:
        """Hands new evaluations to Optuna, prunes, and ends a trial whose run exited."""
        # Asked first: a run that has exited wrote all its reports, and is not pruned
        # after the fact (a short run can end between two polls).
        code = trial.process.poll()
        values = read_report(trial.report, self.spec.metric)
        new = sorted(set(values) - trial.reported)
        last = final_step(study) if new else None  # a study query only for new reports
        for step in new:
            trial.handle.report(values[step], step)
            trial.reported.add(step)
            if (code is None and not trial.pruned and (last is None or step < last)
                    and trial.handle.should_prune()):
                trial.pruned = True
                trial.process.send_signal(signal.SIGTERM)  # saves, exits 42
        if code is None:
            return False
        self._finish(study, trial, code, values)
        return True

    def _finish(self, study: Any, trial: RunningTrial, code: int, values: dict[int, float]
                ) -> None:
        import optuna  # pylint: disable=import-outside-toplevel
        number, states = trial.handle.number, optuna.trial.TrialState
        if trial.pruned and code != 0:  # exit 0: it ended before the signal
            study.tell(trial.handle, state=states.PRUNED)
            state = f"pruned at step {max(trial.reported)}"
        elif code == 0 and values:
            step = max(values)
            study.tell(trial.handle, values[step])
            state = f"{self.spec.metric} {values[step]:.6g} at step {step}"
        elif code in RESUMABLE_EXITS:  # left RUNNING: the rerun resumes it
            state = f"stopped (exit code {code}); left to resume"
            if not trial.stopping:  # not the tuner's doing: a preemption
                self.stop(f"trial {number} was preempted (exit code {code})")
        elif code == EXIT_BAD_INPUT:
            self._refused(study, trial)
            state = "refused its config (not counted toward the trials)"
        else:
            study.tell(trial.handle, state=states.FAIL)
            state = f"failed (exit code {code}; see {self.path(number, '.log')})"
        print(f"tputrain tune: trial {number} {state}", flush=True)

    def _refused(self, study: Any, trial: RunningTrial) -> None:
        """A trial refused its config (before training): FAIL, marked not to count; the
        study stops once the running trials end (they will likely be refused too)."""
        import optuna  # pylint: disable=import-outside-toplevel
        number, error = trial.handle.number, last_error(self.path(trial.handle.number, ".log"))
        trial.handle.set_user_attr(REFUSED, error)
        study.tell(trial.handle, state=optuna.trial.TrialState.FAIL)
        self.refusal = self.refusal or (
            f"trial {number} refused its config: {error} (not counted toward the study's "
            "trials: fix the config and rerun the same command)")


def left_to_resume(study: Any) -> str:
    """What a rerun of a stopped study does first: "resume trial 0", "resume trials 0, 2"."""
    import optuna  # pylint: disable=import-outside-toplevel
    left = [t.number for t in study.get_trials(states=(optuna.trial.TrialState.RUNNING,))]
    if not left:
        return "continue the study"
    return f"resume trial{'s' if len(left) > 1 else ''} {', '.join(map(str, left))}"


def final_step(study: Any) -> int | None:
    """The last step the completed trials report (their runs' end): a trial that has
    reached it has finished, and is not pruned there; None before any completes."""
    import optuna  # pylint: disable=import-outside-toplevel
    ends = [max(t.intermediate_values) for t in study.get_trials(
        states=(optuna.trial.TrialState.COMPLETE,)) if t.intermediate_values]
    return max(ends, default=None)


def last_error(log_path: str) -> str:
    """The trial's `tputrain: error:` message (without that prefix), or its last line."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    errors = [line.split("tputrain: error:", 1)[1].strip() for line in lines
              if "tputrain: error:" in line]
    return (errors or lines or ["(no output)"])[-1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"tputrain.run" in f.read()
    except OSError:
        return False


def wait_for_orphans(study_dir: str, give_up: Callable[[], bool] = lambda: False) -> None:
    """A killed tuner's trials stop by themselves (their lifeline): waits until they
    have (or `give_up()`), so a resumed trial does not find its model_dir still locked."""
    if not os.path.isdir(study_dir):
        return
    pids = []
    for name in os.listdir(study_dir):
        if name.endswith(".pid"):
            with open(os.path.join(study_dir, name), encoding="utf-8") as f:
                pids.append(int(f.read().strip() or 0))
    deadline = time.monotonic() + ORPHAN_WAIT_SECONDS
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline and not give_up():
        time.sleep(POLL_SECONDS)
