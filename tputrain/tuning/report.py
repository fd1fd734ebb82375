"""`TrialReport`: a tuning trial's metric at each evaluation, where the tuner reads it.

The file is the `cloudml-hypertune` convention, which Vertex AI's tuning service
reads (and `tputrain tune` too): JSON lines `{"global_step": "400", "<metric>":
"0.97", "timestamp": ..., "trial": "3"}` in `$CLOUD_ML_HP_METRIC_FILE`
(default `/tmp/hypertune/output.metrics`), the last `KEEP` evaluations, the whole
file rewritten atomically after each evaluation, so a reader never sees half a line
and the metric arrives at every evaluation, not only at the end.

The Trainer adds this action by itself (chief only) when the environment names the
metric: `$TPUTRAIN_TUNE_METRIC` (set by `tputrain tune` and by the jobs of
`tputrain vertex-spec --tune`), or Vertex's `$CLOUD_ML_HP_METRIC_TAG`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Mapping

from tputrain.actions.base import Action
from tputrain.runtime.context import ActionContext
from tputrain.observe.goodput import write_atomically
from tputrain.loop.eval_sets import log_keys

METRIC_ENV = "TPUTRAIN_TUNE_METRIC"
VERTEX_METRIC_ENV = "CLOUD_ML_HP_METRIC_TAG"
FILE_ENV = "CLOUD_ML_HP_METRIC_FILE"
TRIAL_ENV = "CLOUD_ML_TRIAL_ID"
DEFAULT_FILE = "/tmp/hypertune/output.metrics"
KEEP = 100  # entries kept in the file (as the hypertune package keeps)


def eval_metric_names(context: ActionContext) -> list[str]:
    """The keys of an evaluation's logs: loss and the Task's metrics, each `<set>/...`
    with named eval sets."""
    return log_keys(context.options.eval_splits,
                    ["loss", *(metric.name for metric in context.eval_metrics)])


class TrialReport(Action):
    """Writes `metric` of each evaluation to `path` (the module docstring)."""

    def __init__(self, metric: str, path: str = DEFAULT_FILE, trial: str = "0"):
        self.metric, self.path, self.trial = metric, path, trial
        self.entries: list[dict[str, object]] = []

    @classmethod
    def from_environment(cls) -> "TrialReport | None":
        metric = os.environ.get(METRIC_ENV) or os.environ.get(VERTEX_METRIC_ENV)
        if not metric:
            return None
        return cls(metric, os.environ.get(FILE_ENV) or DEFAULT_FILE,
                   os.environ.get(TRIAL_ENV, "0"))

    def preflight(self, context: ActionContext) -> None:
        names = eval_metric_names(context)
        if self.metric not in names:
            raise ValueError(f"the tuning metric {self.metric!r} is not one of this run's eval "
                             f"metrics {names}: fix `metric` in the tuning spec")

    def eval_recorded(self, context: ActionContext, step: int) -> bool:
        """Whether the report holds `step`: a rerun of a trial killed between its last
        checkpoint and that evaluation's line evaluates again for it."""
        return not context.is_chief or step in read_report(self.path, self.metric)

    def on_eval_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if not context.is_chief or self.metric not in logs:
            return
        if not self.entries:  # a resumed trial's process keeps what the file holds
            self.entries = _entries(self.path)
        self.entries = [e for e in self.entries if int(e["global_step"]) != step][-(KEEP - 1):]
        self.entries.append({"global_step": str(step), self.metric: str(float(logs[self.metric])),
                             "timestamp": time.time(), "trial": self.trial})
        write_atomically(self.path, "".join(json.dumps(e, sort_keys=True) + "\n"
                                            for e in self.entries))


def with_trial_report(actions: list[Action]) -> list[Action]:
    """`actions`, and a `TrialReport` last when the environment names a tuning metric."""
    report = TrialReport.from_environment()
    return actions + [report] if report else actions


def _entries(path: str) -> list[dict[str, object]]:
    """The entries of a report file with a step (missing or half-written: what is there)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
            int(entry["global_step"])
        except (ValueError, KeyError, TypeError):
            continue
        entries.append(entry)
    return entries


def read_report(path: str, metric: str) -> dict[int, float]:
    """{step: value} of a report file (missing or half-written: what is there)."""
    values = {}
    for entry in _entries(path):
        try:
            values[int(entry["global_step"])] = float(entry[metric])
        except (ValueError, KeyError, TypeError):
            continue
    return values
