"""State each host has its own of (its data iterator), on multi-host runs."""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tputrain.checkpointing.files import INDEX, files_of


class HostState:
    """Each host's own part of a checkpoint, written beside the chief's.

    Every host writes its part for a step, all meet at a barrier, and only then
    does the chief commit the step (its state file): a listed step always has
    every host's part. Restoring, each host reads its own part of that step.
    """

    def __init__(self, directory: str, trackables: dict[str, Any], host: tuple[int, int],
                 barrier: Callable[[], Any] | None):
        index, count = host
        self.apart = count > 1 and bool(trackables)
        self.directory = f"{directory.rstrip('/')}/hosts/host-{index}-of-{count}"
        self.checkpoint = tf.train.Checkpoint(**trackables) if self.apart else None
        self.barrier = barrier or (lambda: None)

    def save(self, step: int, keep: int) -> None:
        if not self.apart:
            return
        self.checkpoint.write(f"{self.directory}/ckpt-{step}")
        self.barrier()
        stale = sorted(int(m.group(1)) for m in map(INDEX.match, tf.io.gfile.listdir(
            self.directory)) if m)[:-(keep + 1)]
        for old in stale:  # keep + 1: the chief may still list the oldest of them
            for path in files_of(f"{self.directory}/ckpt-{old}"):
                tf.io.gfile.remove(path)

    def restore(self, step: int) -> None:
        if not self.apart:
            return
        prefix = f"{self.directory}/ckpt-{step}"
        if not tf.io.gfile.exists(f"{prefix}.index"):
            raise RuntimeError(f"this host's data position for step {step} ({prefix}) is "
                               "missing: restore it, or start over in a new model_dir")
        self.checkpoint.read(prefix).assert_consumed()
