"""`Spool`: the metrics a tracker was asked to send, kept in model_dir before they are
sent, so a process killed with kill -9 loses no metric of a step its checkpoint kept.

A tracker's client holds what it was given before it reaches the tracker's files or
server: W&B's service (wandb-core) writes the offline run file in 32 KiB blocks and,
when the training process dies, exits without writing what it holds; the tracker's
own queue (sender.py) dies with the process. So each metrics job is appended, by the
hook that makes it, to `model_dir/tracking/<tracker>.spool.jsonl`: one JSON line in one
`write` to a file opened with O_APPEND (no fsync: a killed process's writes are in the
kernel's cache; a power loss may lose the last lines, as it loses the tracker's). A
kill leaves whole lines and at most a last line cut short, which `read` skips. On a
resume the tracker sends the spool's values at steps up to the restored checkpoint's
that its run does not hold (base.py); the steps after it are computed, and sent,
again by the resumed training.

Only a local model_dir has a spool: `gs://` and other `tf.io.gfile` stores cannot
append (there the tracker's own files and queue are all there is).
"""

from __future__ import annotations

import json
import os
from typing import Mapping

from absl import logging

from tputrain.checkpointing.run_directory import RunDirectory


class Spool:
    """Appends each metrics job to the tracker's spool file; reads them back."""

    def __init__(self, model_dir: str, tracker: str):
        self.path = (None if "://" in model_dir
                     else RunDirectory(model_dir).tracking_spool(tracker))
        self._fd: int | None = None

    def append(self, step: int, values: Mapping[str, float]) -> None:
        """One line `{"step": ..., "values": {...}}`, in one write. A failure (a full
        disk) is one warning and turns the spool off: training goes on."""
        if self.path is None or not values:
            return
        line = json.dumps({"step": int(step), "values": dict(values)}) + "\n"
        try:
            if self._fd is None:
                line = self._open() + line
            os.write(self._fd, line.encode("utf-8"))
        except OSError as error:
            logging.warning("tputrain: tracker spool %s cannot be written (%s): a kill -9 "
                            "may lose the metrics the tracker had not written yet",
                            self.path, error)
            self.close()
            self.path = None

    def _open(self) -> str:
        """Opens the file for appending; returns a newline when a killed writer left its
        last line cut short (so this process's first line is not glued to it)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self._fd).st_size
        return "\n" if size and os.pread(self._fd, 1, size - 1) != b"\n" else ""

    def read(self) -> list[tuple[int, dict[str, float]]]:
        """Every whole line's (step, values), in the order they were written."""
        if self.path is None or not os.path.exists(self.path):
            return []
        jobs = []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    job = json.loads(line)
                    jobs.append((int(job["step"]), dict(job["values"])))
                except (ValueError, KeyError, TypeError):  # a line a kill cut short
                    continue
        return jobs

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
