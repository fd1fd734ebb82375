"""`Tracker`: the action an experiment tracker (MLflow, W&B) is built on.

On the chief only, it sends the run's parameters (the operative config's scalar
bindings, the Trainer's options and its resolved plan), each progress line's
figures as `train/<name>` and each evaluation's as `eval/<name>` (`eval/<set>/...`
with named eval sets) at their step, and at the end goodput's shares as
`goodput/<bucket>`, the operative config and goodput's account as artifacts, and
the export and best checkpoint as references (tags; nothing large is copied).

Every call to the tracker runs on a background thread (`Sender`): a tracker that
is down or slow never stops or slows training; the first failure is one warning
and the calls are retried. The run's id is kept in `model_dir/tracking/` (record.py),
so a rerun, a resume after kill -9 and `tputrain eval` continue the same run; a
metric at a step the run already holds (the steps a resume computes again) is not
sent twice (a metric by the name the tracker stores it under, `metric_key`; an
evaluation is checked against the run as it is when it is sent, since `tputrain eval`
and the training may both evaluate a step). Each metric is also appended to the tracker's spool in model_dir
(spool.py) before its hook returns: a resume first sends the spool's metrics, up to
the restored step, that a killed process's queue or tracker client had not written. A bad tracking URI is refused by `preflight`: one line, before anything
is written to model_dir.

A subclass connects a tracker: `check`, `open_run`, `logged_steps`, `metric_key`, `first_step`,
`send_params`, `send_metrics`, `send_artifact`, `send_tags`, `finish` (all but `check`
run on the sender's thread). When training raises or is preempted, the run is ended FAILED or
KILLED and the queue is sent before the error leaves `train()` (`on_train_error`).
"""

from __future__ import annotations

import os
from typing import Any, Collection, Mapping

import tensorflow as tf
from absl import logging

from tputrain.observe import goodput
from tputrain.actions.base import Action
from tputrain.actions.best import best_record
from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.fault_tolerance.preemption import Preempted
from tputrain.actions.config_summary import config_text
from tputrain.runtime.context import ActionContext
from tputrain.tracking.record import prefixed, read_record, run_params, write_record
from tputrain.tracking.sender import Sender
from tputrain.tracking.spool import Spool


class Tracker(Action):
    """Base class of the trackers (the module docstring). `name` names its record."""

    name = "tracker"

    def __init__(self, flush_seconds: float = 30.0, max_queue: int = 1000):
        self.flush_seconds, self.max_queue = flush_seconds, max_queue
        self.sender: Sender | None = None
        self.spool: Spool | None = None
        self.run_id: str | None = None
        self.sent_steps: dict[str, int] = {}  # the run's last step of each metric
        self.step_floor = 0  # the open run takes no step below it
        self.writing = True  # the run is training's (False: `tputrain eval` adds to it)
        self.model_dir: str | None = None  # the run's; None before `start`
        self._params_sent = self._finished = False

    # ---------------------------------------------------------- for subclasses

    def check(self, model_dir: str, resuming: bool) -> None:
        """Raises ValueError naming the fix when the tracker cannot work (a bad URI, the
        package missing). `resuming`: model_dir already has a run of this tracker."""

    def open_run(self, run_id: str | None, model_dir: str) -> str:
        """Opens (None: creates) the tracker's run; returns its id. `self.writing` is
        False for `tputrain eval`, which adds evaluations and leaves the run's state."""
        raise NotImplementedError

    def logged_steps(self, keys: Collection[str] | None = None) -> dict[str, int]:
        """The open run's last logged step of each metric (of `keys`, when given), by
        `metric_key`."""
        return {}

    def metric_key(self, name: str) -> str:
        """The name the tracker stores metric `name` under (MLflow replaces some
        characters): `logged_steps`' keys."""
        return name

    def first_step(self) -> int:
        """The first step the open run takes a metric at (0: any)."""
        return 0

    def send_params(self, params: Mapping[str, str]) -> None:
        raise NotImplementedError

    def send_metrics(self, step: int, values: Mapping[str, float]) -> None:
        raise NotImplementedError

    def send_artifact(self, name: str, text: str) -> None:
        raise NotImplementedError

    def send_tags(self, tags: Mapping[str, str]) -> None:
        raise NotImplementedError

    def finish(self, status: str = "FINISHED") -> None:
        """The run ended (it may be continued later): FINISHED, or FAILED (training raised)
        or KILLED (preempted, interrupted)."""

    # ---------------------------------------------------------- the hooks

    def preflight(self, context: ActionContext) -> None:
        self.check(context.model_dir, read_record(context.model_dir, self.name) is not None)

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        if not context.is_chief:
            return
        self._params_sent = False  # each train() sends them (a notebook's may differ)
        if self.sender is not None and self.model_dir != context.model_dir:
            self.close()  # one tracker given to Trainers on two model_dirs (a sweep)
            self.sender.close()
            self.sender = None
        if self.sender is None:
            self.start(context.model_dir, writer=True, restored_step=step)
            self.sender.put(("tags", {"tputrain.model_dir": context.model_dir}))
        elif self._finished:  # another train() of this Trainer after the run's end
            record = read_record(context.model_dir, self.name)
            self.sender.put(("open", record and record["run_id"], context.model_dir, True,
                             step))
        self._finished = False

    def start(self, model_dir: str, writer: bool, restored_step: int | None = None) -> None:
        """Starts the sender and opens the run (the record's, else a new one, recorded
        when `writer`: `tputrain eval` reads it, and does nothing without one). With
        `restored_step` (training), the spool's metrics up to it that the run lacks are
        sent first: those a kill -9 kept from the tracker (spool.py)."""
        record = read_record(model_dir, self.name)
        if record is None and not writer:
            logging.warning("tputrain: %s: no run in %s yet (tracking/%s.json): these "
                            "evaluations are not tracked", type(self).__name__, model_dir,
                            self.name)
            return
        self.model_dir = model_dir
        self.spool = Spool(model_dir, self.name)
        self.sender = Sender(type(self).__name__, self._send, self.max_queue)
        self.sender.put(("open", record["run_id"] if record else None, model_dir, writer,
                         restored_step))

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if self.sender is None:
            return
        if not self._params_sent:  # after the first loop: the plan's XLA is decided
            self._params_sent = True
            self.sender.put(("params", run_params(context)))
        self.put_metrics(step, prefixed("train", logs))

    def on_eval_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if self.sender is not None:
            self.put_metrics(step, prefixed("eval", logs), check_run=True)

    def on_train_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if self.sender is None:
            return
        if not self._params_sent:
            self._params_sent = True
            self.sender.put(("params", run_params(context)))
        account = goodput.account(context.model_dir)
        self.put_metrics(step, goodput.scalars(account))
        self.sender.put(("artifact", "operative_config.gin", config_text(context)))
        self.sender.put(("artifact", "goodput.txt", goodput.format_account(account) + "\n"))
        self.sender.put(("tags", references(context.model_dir)))
        self.sender.put(("finish",))
        self._finished = True
        self.close()

    def on_train_error(self, context: ActionContext, step: int, error: BaseException) -> None:
        """Training raised, or stopped on SIGTERM after its checkpoint (`Preempted`): the
        run is ended KILLED (a preemption, an interrupt) or FAILED, and what is queued is
        sent now, since a command's process ends right after (the sender's thread with it)."""
        if self.sender is None or self._finished:
            return
        stopped = isinstance(error, (Preempted, KeyboardInterrupt))
        self.sender.put(("finish", "KILLED" if stopped else "FAILED"))
        self._finished = True
        self.close()

    def put_metrics(self, step: int, values: Mapping[str, float],
                    check_run: bool = False) -> None:
        """Spools the metrics (in model_dir, before this returns), then queues them
        (`check_run`: sent only at a step past the run's own, as it is then)."""
        self.spool.append(step, values)
        self.sender.put(("metrics", step, values, check_run))

    def close(self) -> None:
        """Sends what is queued (at most `flush_seconds`)."""
        if self.sender is not None:
            self.sender.flush(self.flush_seconds)
        if self.spool is not None:
            self.spool.close()

    # ---------------------------------------------------------- the sender's side

    def _send(self, job: tuple[Any, ...]) -> None:
        kind, *args = job
        if kind == "open":
            self._open(*args)
        elif kind == "metrics":
            self._metrics(*args)
        elif kind == "params":
            self.send_params(*args)
        elif kind == "artifact":
            self.send_artifact(*args)
        elif kind == "tags":
            self.send_tags(*args)
        elif kind == "finish":
            self.finish(*args)

    def _open(self, run_id: str | None, model_dir: str, writer: bool,
              restored_step: int | None = None) -> None:
        self.writing = writer
        self.run_id = self.open_run(run_id, model_dir)
        self.sent_steps = self.logged_steps() if self.run_id == run_id else {}
        self.step_floor = self.first_step()
        if writer and self.run_id != run_id:
            write_record(model_dir, self.name, {"run_id": self.run_id})
        if restored_step is not None:
            self._resend(restored_step)

    def _resend(self, restored_step: int) -> None:
        """Sends the spool's metrics at steps up to `restored_step` that the run does not
        hold (a killed process had them queued, or its tracker client had not written
        them), in step order; the resumed training sends the later steps again."""
        jobs = sorted((job for job in self.spool.read() if job[0] <= restored_step),
                      key=lambda job: job[0])
        resent = sorted({step for step, values in jobs if self._metrics(step, values)})
        if resent:
            logging.info("tputrain: %s: sent again from the spool the metrics of steps %s "
                         "(the run did not hold them)", type(self).__name__, resent)

    def _metrics(self, step: int, values: Mapping[str, float], check_run: bool = False) -> bool:
        """Sends the values the run does not hold at `step` yet (a resume's recomputed
        steps were logged by the run that first computed them; with `check_run`, an
        evaluation another process sent since the run was opened); True if any."""
        if check_run:
            held = self.logged_steps([self.metric_key(key) for key in values])
            for key, last in held.items():
                self.sent_steps[key] = max(last, self.sent_steps.get(key, -1))
        new = {key: value for key, value in values.items()
               if step > self.sent_steps.get(self.metric_key(key), -1)
               and step >= self.step_floor}
        if new:
            self.send_metrics(step, new)
            self.sent_steps.update({self.metric_key(key): step for key in new})
        return bool(new)


def references(model_dir: str) -> dict[str, str]:
    """Where the run's large outputs are (tags, not copies): the newest export, the best
    checkpoint."""
    tags = {}
    exports = [path for path in tf.io.gfile.glob(RunDirectory(model_dir).export_version("*"))
               if os.path.basename(path).isdigit()]
    if exports:
        tags["tputrain.serving.export"] = max(exports, key=lambda path: int(os.path.basename(path)))
    best = best_record(model_dir, strict=False)  # tags only: a damaged record is said
    if best is not None:
        tags["tputrain.best_checkpoint"] = best["checkpoint"]
        tags["tputrain.best_step"] = str(best["step"])
    return tags
