"""The end of `tputrain tune`: the trials as a table, and the best trial's bindings."""

from __future__ import annotations

from typing import Any

from tputrain.tuning.spec import TuningSpec
from tputrain.tuning.study import REFUSED, trial_bindings


def _value(trial: Any) -> str:
    return "-" if trial.value is None else f"{trial.value:.6g}"


def trials_table(study: Any, spec: TuningSpec) -> str:
    """One line a trial: number, state (REFUSED: refused its config, not counted; RUNNING:
    left to resume), metric (its last evaluation's), step, params."""
    rows = [("trial", "state", spec.metric, "step", "params")]
    for trial in study.trials:
        steps = trial.intermediate_values
        value = _value(trial) if trial.value is not None else (
            f"{steps[max(steps)]:.6g}" if steps else "-")
        state = "REFUSED" if REFUSED in trial.user_attrs else trial.state.name  # not counted
        rows.append((str(trial.number), state, value,
                     str(max(steps)) if steps else "-",
                     "; ".join(trial_bindings(spec, trial.params))))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths))
                     + "  " + row[4] for row in rows)


def best_lines(study: Any, spec: TuningSpec) -> list[str]:
    """The best completed trial and its bindings (a gin file's lines), or why none."""
    completed = [t for t in study.trials if t.state.name == "COMPLETE"]
    if not completed:
        return ["no trial completed: no best trial"]
    best = study.best_trial
    return [f"best trial {best.number}: {spec.metric} {_value(best)} "
            f"({spec.goal}); its bindings:", *trial_bindings(spec, best.params)]
