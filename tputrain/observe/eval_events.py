"""The eval run's events, written so that TensorBoard keeps every evaluated step.

TensorBoard's default loader (the `tensorboard_data_server`, "fast loading")
treats a time series' steps as increasing: a point at step s, read after points
at higher steps of the same run and tag, *preempts* them (it takes them for the
orphans of a crashed job). Its Python loader (`--load_fast=false`) does not, for
TF2 event files. So `tputrain eval --step=1600` after training to 2000, a rerun,
or a side-car catching up on old checkpoints would hide every later eval point
in the default view, though the events hold them all.

`EvalEventWriter` writes one process's eval points into the eval run (the
`eval/` folder: one event file a writer, as before) and repairs what a lower
step hides: before each point it writes, and when it is closed, it reads the
run's event files in the order TensorBoard does (by name), replays the
preemption, and writes again, in step order, the hidden points (each with its
original step, wall time and values), and the points above them that the first
one would hide in turn. Before a point, only hidden points below its step are
restated (the point itself covers its step, and writing higher ones would be
preempted by it again); `close()` restates the rest. The loaders that do not
preempt then see a restated point twice, at the same step and value.

A point the run already shows as it is (the same step, tags and values: a rerun of
`tputrain eval --step=N`), below later points, is not written: it would hide them
and restate them once more, so every rerun added a copy of each (EventAccumulator,
`--load_fast=false` and pandas exports see them). At the run's last step a new
evaluation hides nothing and is written as any other.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import tensorflow as tf
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

# (step, wall time) -> {tag: the Summary.Value last written there}
Points = dict[tuple[int, float], dict[str, summary_pb2.Summary.Value]]


def event_files(directory: str) -> list[str]:
    """The run's event files in the order TensorBoard reads them (by name)."""
    if not tf.io.gfile.isdir(directory):
        return []
    return sorted(os.path.join(directory, name) for name in tf.io.gfile.listdir(directory)
                  if "tfevents" in name)


def read_events(path: str) -> list[event_pb2.Event]:
    """The file's events; a record still being written (another process's) ends it."""
    events = []
    for record in RawEventFileLoader(path).Load():
        events.append(event_pb2.Event.FromString(record))
    return events


@dataclass
class RunState:
    """A run's scalar points: all written, and those TensorBoard's loader keeps."""
    written: dict[str, dict[int, tuple[float, summary_pb2.Summary.Value]]] = field(
        default_factory=dict)  # tag -> step -> (wall time, value), the last read wins
    visible: dict[str, set[int]] = field(default_factory=dict)  # tag -> steps kept

    def add(self, event: event_pb2.Event) -> None:
        for value in event.summary.value:
            self.written.setdefault(value.tag, {})[event.step] = (event.wall_time, value)
            steps = self.visible.setdefault(value.tag, set())
            steps.difference_update({s for s in steps if s >= event.step})  # preempted
            steps.add(event.step)

    def shows_below_later(self, step: int, summary: summary_pb2.Summary) -> bool:
        """Every value of `summary` is shown at `step` already, as it is (a rerun's
        evaluation of the same checkpoint), and later points are shown: writing it
        again would only hide them and restate them, a copy more each time."""
        shown = all(step in self.visible.get(value.tag, ()) and
                    self.written[value.tag][step][1] == value for value in summary.value)
        return shown and any(max(self.visible.get(value.tag) or [step]) > step
                             for value in summary.value)

    def hidden_from(self, below: int | None) -> int | None:
        """The lowest step written but not kept (below `below`, if given), or None."""
        hidden = [step for tag, points in self.written.items() for step in points
                  if step not in self.visible[tag] and (below is None or step < below)]
        return min(hidden, default=None)

    def points(self, first: int, below: int | None) -> Points:
        """The written points of steps in [first, below), by (step, wall time)."""
        grouped: Points = {}
        for tag, points in self.written.items():
            for step, (wall_time, value) in points.items():
                if step >= first and (below is None or step < below):
                    grouped.setdefault((step, wall_time), {})[tag] = value
        return grouped


def run_state(directory: str) -> RunState:
    """Replays the run's event files as TensorBoard's default loader reads them."""
    state = RunState()
    for path in event_files(directory):
        for event in read_events(path):
            if event.HasField("summary"):
                state.add(event)
    return state


class EvalEventWriter:
    """Writes eval points into `directory` (a TensorBoard run) so that none is hidden:
    see the module docstring. The event file is created at the first write."""

    def __init__(self, directory: str):
        self.directory = directory
        self._writer: EventFileWriter | None = None

    def write(self, step: int, summary: summary_pb2.Summary) -> None:
        """Writes `summary` at `step`, after the hidden points below it; nothing if the
        run shows that point already, below later ones (`RunState.shows_below_later`)."""
        state = run_state(self.directory)
        if state.shows_below_later(step, summary):
            return
        writer = self._open()
        self._restate(below=step, state=state)
        writer.add_event(event_pb2.Event(step=step, wall_time=time.time(), summary=summary))
        writer.flush()

    def close(self) -> None:
        """Restates the points this writer's lower steps hid, and closes the file."""
        if self._writer is None:
            return
        self._restate(below=None)
        self._writer.close()
        self._writer = None

    def _open(self) -> EventFileWriter:
        if self._writer is None:
            self._writer = EventFileWriter(self.directory)
        return self._writer

    def _restate(self, below: int | None, state: RunState | None = None) -> None:
        state = state or run_state(self.directory)
        first = state.hidden_from(below)
        if first is None:
            return
        for (step, wall_time), values in sorted(state.points(first, below).items()):
            self._writer.add_event(event_pb2.Event(
                step=step, wall_time=wall_time,
                summary=summary_pb2.Summary(value=list(values.values()))))
        self._writer.flush()

