"""TensorBoard summaries on a full disk: diagnostics, so a write that finds no space is
skipped with one warning a run, and training goes on.

Ending the run at a summary write would throw away the steps since the last checkpoint
for a plot, and on several workers end the chief alone (only it writes summaries) while
the others wait in a collective. The checkpoint save guards the run's state instead:
before each save it checks the free space and, if the disk is still full, stops the run
in one line naming the intact last good checkpoint (docs/fault_tolerance.md). A writer
that failed is dropped, so once there is room again the summaries go on in a new event
file.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf
from absl import logging

from tputrain.checkpointing.files import first_line, is_disk_full


class SummarySpace:
    """Runs a run's summary writes; a full disk warns once and skips the write."""

    def __init__(self) -> None:
        self.warned = False

    def write(self, directory: str, write: Callable[[], None]) -> bool:
        """Calls `write` (a summary write into `directory`); False, after the warning
        (once), if it found the disk full. Other errors are raised."""
        try:
            write()
        except (tf.errors.OpError, OSError) as error:
            if not is_disk_full(error):
                raise
            self._warn(directory, error)
            return False
        return True

    def _warn(self, directory: str, error: BaseException) -> None:
        if self.warned:
            return
        self.warned = True
        logging.warning(
            "tputrain: TensorBoard summaries are not written: no space left on %s (%s); "
            "training goes on (summaries again once there is room) and the next checkpoint "
            "save stops the run in one line if the disk is still full", directory,
            first_line(error))
