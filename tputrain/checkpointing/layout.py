"""The input layout saved with every checkpoint, and a restore under another one.

A checkpoint written under another input layout (replicas, hosts, global batch:
`tputrain.checkpointing.input_layout`) is not corrupt: its data iterator cannot feed this
run's batches, so it is left out and `reposition` moves the fresh one past the
examples consumed (without `reposition` it is refused with `InputLayoutError`).
Checkpoints from before layouts were recorded restore as before.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from absl import logging

from tputrain.checkpointing.integrity import VARIABLE_SUFFIX, InputLayoutError
from tputrain.checkpointing.input_layout import KEY, InputLayout, LayoutChange


class LayoutRecord:
    """This run's layout (what every save records) and what a restore makes of a saved one.

    `data_names`: the saved objects that hold the data position (left out of a
    restore when the layout changed).
    """

    def __init__(self, layout: InputLayout | None, data_names: Iterable[str],
                 reposition: Callable[[LayoutChange], None] | None):
        self.layout = layout
        self.data_names = frozenset(data_names)
        self.reposition = reposition
        self.saveables = {KEY: layout.variable()} if layout else {}

    def change(self, path: str, reader: Any, saved: InputLayout | None) -> LayoutChange | None:
        """The change of input layout, if any: the data state (if saved) is then left
        out, and `reposition` reads the fresh input past the examples consumed; raises
        `InputLayoutError` if there is data state and no `reposition` to do that."""
        if saved is None or self.layout is None or saved.split() == self.layout.split():
            return None  # nothing to compare, or the saved iterator fits
        step = int(reader.get_tensor("step" + VARIABLE_SUFFIX))
        change = LayoutChange(path, step, saved, self.layout.split())
        if self.data_names and self.reposition is None:
            raise InputLayoutError(_layout_refusal(
                change, "this run cannot move its data position to the examples consumed"))
        return change

    def data_keys(self, left_out: bool) -> tuple[str, ...]:
        """Checkpoint key prefixes of the data state, when a layout change leaves it out
        (a host count change also moves it in or out of the main checkpoint)."""
        return tuple(f"{name}/" for name in sorted(self.data_names)) if left_out else ()

    def differs(self, saved: InputLayout | None) -> bool:
        """Whether a checkpoint saved under `saved` has another split than this run."""
        return (saved is not None and self.layout is not None
                and saved.split() != self.layout.split())

    def left_out(self, change: LayoutChange | None, saved: InputLayout | None) -> set[str]:
        """The saved objects a restore does not read: the data state on a layout change,
        the layout itself unless both the checkpoint and this run have one."""
        left_out = set(self.data_names) if change else set()
        if saved is None or not self.saveables:
            left_out.add(KEY)  # not in both: restored by neither
        return left_out

    def reset(self) -> None:
        """The layout saved next is this run's (also when a restore failed)."""
        if self.layout is not None:
            self.saveables[KEY].assign(self.layout.to_json())

    def restored(self, change: LayoutChange | None,
                 saved: InputLayout | None) -> LayoutChange | None:
        """After a restore: where this run's data started; the change for `reposition`
        to act on (None when there is no saved data state to reposition)."""
        if change is not None:  # its data starts where the checkpoint's stopped
            self.saveables[KEY].assign(change.continued().to_json())
            if not self.data_names:
                _check_distributed_position(change)
                return None
        elif saved is not None and self.layout is not None:
            self.saveables[KEY].assign(saved.to_json())  # its start carried on
        return change

    def recorded(self) -> InputLayout | None:
        """This run's layout and where its data started: what the next save records."""
        if not self.saveables:
            return None
        return InputLayout.from_json(self.saveables[KEY].numpy())


def _check_distributed_position(change: LayoutChange) -> None:
    """With no saved data state (input_mode="distributed") the input is rebuilt on
    every resume and skips `recorded_layout.input_steps(step)` batches: after a layout
    change, the examples consumed rounded up to this run's batch. One line says so."""
    logging.warning("tputrain: %s", change.recovered(
        rebuilt="the input is rebuilt on every resume (no data iterator is saved)"))


def _layout_refusal(change: LayoutChange, why: str) -> str:
    """The cause, both layouts, what is intact and what to do."""
    return (f"checkpoint {change.path} (step {change.step}) was written with "
            f"{change.saved.describe()}, this run has {change.now.describe()}: {why}. The "
            "checkpoint is intact: resume with the layout that wrote it, or through the "
            "Trainer (which reads the input past the examples consumed), or start a new "
            "model_dir from its weights (tputrain.InitCheckpoint)")
