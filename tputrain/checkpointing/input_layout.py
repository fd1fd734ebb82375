"""The input layout a checkpoint's data position was saved under, and how a run on
another layout finds that position again: by the examples consumed.

In `input_mode="host"` a checkpoint holds each host's tf.data iterator, and that
iterator is only valid for the pipeline it was built from: its batches are
per-replica (global batch / replicas / micro-batches), its shard is the host's.
Resumed on another replica count the saved iterator either fails to restore
("Failed to restore dataset iterator") or restores and yields batches of the old
shape. So every checkpoint also records the layout (`KEY`) and where the data
stood when that layout took over (`start_step`, `start_examples`): the examples
consumed at any later step are `start_examples + (step - start_step) * global_batch`
(checkpoints written before this field: `step * global_batch`). A resume compares
the saved layout with the run's own before touching the iterator:

* same layout: the iterator is restored (exact resume; a distributed-input run
  skips to the recorded position, `InputLayout.input_steps`);
* any other layout (replicas, micro-batches, fetch structure, global batch, hosts):
  weights, optimizer and step are restored, the saved iterator is left out, and
  the fresh input is read past the examples consumed, in whole steps of the new
  global batch (`LayoutChange.resume_steps`); the run's layout then records that
  position as its start. Every host reads past `resume_steps` of its own batches.

What that position is, for a pipeline whose order of examples is deterministic
and does not depend on the batch size (shuffle, if any, before batching, with a
seed):

* same hosts: each host's own example stream is unchanged, and every host read
  `examples / hosts` of it, so skipping that many is exact;
* another host count: exact where each host reads every n-th example of one order
  (`Dataset.shard` of examples, before batching: the hosts together then read the
  first `examples` of that order); where hosts read other units (files), the
  position is approximate: examples may be read again or passed over. The log says so.
  A positional `TFRecordInput` is exact here in both input modes: the layout
  records each host count and where it took over (`host_history`), from which every
  host's windows are replayed (`tputrain.data.ledger`); no iterator is saved for it,
  and the Trainer builds it at its position on every resume.
* examples consumed not a multiple of the new global batch: the input goes on to
  the next whole batch; the examples passed over (fewer than one batch) are never
  trained on, and count as consumed.

The step counter (the optimizer's `iterations`) continues, so a learning-rate
schedule by steps continues from the step: after a batch change a step is another
number of examples, which the resume's log line says.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

import tensorflow as tf

KEY = "input_layout"  # its name in the checkpoint (a string variable: JSON)
CHECKPOINT_KEY = f"{KEY}/.ATTRIBUTES/VARIABLE_VALUE"


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """How one step's global batch is split: over hosts, replicas and micro-batches;
    how the train iterator fetches it (`Inputs.fetch_groups`); and the step and the
    examples consumed when this layout took over (0, 0 for a run started under it)."""

    replicas: int
    hosts: int
    global_batch: int
    accumulation: int = 1
    fetch: str = "stacked"  # what every checkpoint before this field was written with
    start_step: int = 0  # checkpoints before these two fields: step * global batch
    start_examples: int = 0
    # The host counts so far and the examples consumed when each took over, as
    # "examples:hosts,...": what a positional input replays to place every host
    # (`tputrain.data.ledger`); "examples:hosts:1" for a change whose fresh windows
    # are dealt by load (every change recorded since). Empty: these hosts from the start.
    host_history: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> InputLayout:
        values = json.loads(text)
        return cls(**{f.name: (str if f.type == "str" else int)(values[f.name])
                      for f in dataclasses.fields(cls) if f.name in values})

    def variable(self) -> tf.Variable:
        """What the checkpoint saves (a string: new fields stay readable)."""
        with tf.init_scope():
            return tf.Variable(self.to_json(), trainable=False, name=KEY)

    def split(self) -> InputLayout:
        """The layout without its start: what decides whether a saved iterator fits."""
        return dataclasses.replace(self, start_step=0, start_examples=0, host_history="")

    def history(self) -> tuple[tuple[int, ...], ...]:
        """(examples consumed, hosts[, 1 if dealt by load]) at each host count the run
        had, this one last (`InputContext.layout_history`)."""
        if not self.host_history:
            return ((0, self.hosts),)
        return tuple(tuple(int(field) for field in entry.split(":"))
                     for entry in self.host_history.split(","))

    def examples(self, step: int) -> int:
        """The examples consumed (read past, over all hosts) once `step` steps are done."""
        return self.start_examples + (step - self.start_step) * self.global_batch

    def input_steps(self, step: int) -> int:
        """Batches of this layout's global batch the input is past at `step` (the
        start is a whole number of them: `LayoutChange.resume_steps`)."""
        return self.examples(step) // self.global_batch

    def describe(self, fetch: bool = False) -> str:
        """'2 replicas on 1 host, global batch 64' (and micro-batches when accumulating;
        with `fetch`, how the iterator fetches)."""
        text = (f"{self.replicas} replica{'s' * (self.replicas != 1)} on {self.hosts} "
                f"host{'s' * (self.hosts != 1)}, global batch {self.global_batch}")
        text += f" in {self.accumulation} micro-batches" if self.accumulation > 1 else ""
        if not fetch:
            return text
        return text + (" (batches fetched as built)" if self.fetch == "direct"
                       else " (batches stacked per fetch)")


class LayoutChange(NamedTuple):
    """A checkpoint (`path`, at `step`) written under `saved`, resumed under `now`."""

    path: str
    step: int
    saved: InputLayout
    now: InputLayout

    @property
    def consumed(self) -> int:
        """The examples read past when the checkpoint was written."""
        return self.saved.examples(self.step)

    @property
    def resume_steps(self) -> int:
        """Whole batches of the new global batch to read past: the examples consumed,
        rounded up (a batch is never split, nor an example read twice)."""
        return -(-self.consumed // self.now.global_batch)

    @property
    def passed_over(self) -> int:
        """Examples after the position that the round-up skips without training."""
        return self.resume_steps * self.now.global_batch - self.consumed

    def continued(self) -> InputLayout:
        """The run's layout, starting where its input resumes (a host count change
        is added to the host history there)."""
        start = self.resume_steps * self.now.global_batch
        history = self.saved.history()
        if history[-1][1] != self.now.hosts:
            history += ((start, self.now.hosts, 1),)  # dealt by load (`Ledger.relayout`)
        # One host count since step 0 is the empty history (`history()` reads it back):
        # a layout that never changed its hosts saves as it did before there was one.
        return dataclasses.replace(
            self.now.split(), start_step=self.step, start_examples=start,
            host_history="" if len(history) == 1 else
            ",".join(":".join(map(str, entry)) for entry in history))

    def recovered(self, read_steps: int | None = None, rebuilt: str = "") -> str:
        """The one line logged on such a resume: both layouts, the examples consumed,
        where the data resumes (`read_steps`: the batches actually read past, fewer if
        a finite input ended) and what is approximate."""
        fetch = self.saved.fetch != self.now.fetch
        ended = ("" if read_steps in (None, self.resume_steps) else
                 f"; the input ended after {read_steps} of them")
        over = (f" and the next {self.passed_over} (to a whole batch of this run; "
                "never trained on)" if self.passed_over else "")
        return (f"checkpoint {self.path} was written with {self.saved.describe(fetch)}, this "
                f"run has {self.now.describe(fetch)}: "
                f"{rebuilt or 'its data iterator cannot feed these batches'}, so the model, "
                f"optimizer and step {self.step} were restored and the input resumes past "
                f"{self.resume_steps} steps of {self.now.global_batch} examples (read from "
                "its start and skipped, or built there by a positional input): the "
                f"{self.consumed} examples consumed{over}{ended} "
                f"({self._exactness()}){self._schedule()}")

    def _exactness(self) -> str:
        if self.saved.hosts == self.now.hosts:
            return "exact for a deterministic input pipeline" + (
                "" if self.saved.global_batch == self.now.global_batch else
                " whose order of examples does not depend on the batch size")
        return (f"the input was split into {self.saved.hosts} host shard(s), now "
                f"{self.now.hosts}: exact only where each host reads every n-th example "
                "of one deterministic order (Dataset.shard of examples) or "
                "TFRecordInput(positional=True) places every host by the layout's host "
                "history; otherwise approximate, examples may be read again or passed "
                "over")

    def _schedule(self) -> str:
        if self.saved.global_batch == self.now.global_batch:
            return ""
        return (f"; the step counts on from {self.step}, so a learning-rate schedule by "
                f"steps continues there, and a step is now {self.now.global_batch} examples "
                f"(was {self.saved.global_batch})")


def saved_layout(reader: Any) -> InputLayout | None:
    """The layout a checkpoint recorded; None for one written before layouts were."""
    if not reader.has_tensor(CHECKPOINT_KEY):
        return None
    value = reader.get_tensor(CHECKPOINT_KEY)
    try:
        return InputLayout.from_json(value)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"its {KEY} is not readable ({error})") from None
