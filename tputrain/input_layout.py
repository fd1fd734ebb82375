"""The input layout a checkpoint's data position was saved under.

In `input_mode="host"` a checkpoint holds each host's tf.data iterator, and that
iterator is only valid for the pipeline it was built from: its batches are
per-replica (global batch / replicas / micro-batches), its shard is the host's.
Resumed on another replica count the saved iterator either fails to restore
("Failed to restore dataset iterator") or restores and yields batches of the old
shape. So every checkpoint also records the layout (`KEY`), and a resume compares
it with the run's own before touching the iterator:

* same layout: the iterator is restored (exact resume);
* other replicas or micro-batches, same hosts and global batch: each host still
  reads the same example stream and a step still means `global_batch` examples,
  so the saved iterator is left out and a fresh one read past the steps done
  (what `input_mode="distributed"` does on every resume);
* another fetch structure (`fetch`: "stacked" groups, or "direct" batches read as
  the task built them, for one replica a host and one step a fetch), same hosts and
  global batch: as for other replicas (the iterator's structure differs);
* another global batch or host count: no position in the new pipeline matches
  the old one (a step covers other examples, or the hosts' shards differ), so the
  resume is refused, naming both layouts.
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
    and how the train iterator fetches it (`Inputs.fetch_groups`)."""

    replicas: int
    hosts: int
    global_batch: int
    accumulation: int = 1
    fetch: str = "stacked"  # what every checkpoint before this field was written with

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

    def why_not_repositionable(self) -> str | None:
        """None if reading a fresh input past `step` steps recovers the position."""
        if self.saved.global_batch != self.now.global_batch:
            return (f"a step was {self.saved.global_batch} examples and is now "
                    f"{self.now.global_batch}: the steps done name no position in the new input")
        if self.saved.hosts != self.now.hosts:
            return (f"the input was split into {self.saved.hosts} host shard(s) and now into "
                    f"{self.now.hosts}: no position in the new shards is the one reached")
        return None

    def recovered(self, skipped_steps: int) -> str:
        """The warning logged once the data position was recovered by skipping."""
        ended = ("" if skipped_steps == self.step else
                 f"; the input ended after {skipped_steps} of them")
        fetch = self.saved.fetch != self.now.fetch
        return (f"checkpoint {self.path} was written with {self.saved.describe(fetch)}, this "
                f"run has {self.now.describe(fetch)}: its data iterator cannot feed these "
                f"batches, so the model, optimizer and step {self.step} were restored and "
                f"the input, read from its start, skipped the {self.step} steps done "
                f"({self.step * self.now.global_batch} examples; exact for a deterministic "
                f"input pipeline, as input_mode='distributed' resumes{ended})")


def saved_layout(reader: Any) -> InputLayout | None:
    """The layout a checkpoint recorded; None for one written before layouts were."""
    if not reader.has_tensor(CHECKPOINT_KEY):
        return None
    value = reader.get_tensor(CHECKPOINT_KEY)
    try:
        return InputLayout.from_json(value)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"its {KEY} is not readable ({error})") from None
