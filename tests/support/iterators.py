"""What the iterators a piece of code makes run with."""

from __future__ import annotations

import tensorflow as tf


def autotune_of_iterators(monkeypatch) -> list:
    """A list that gets, for each iterator made from now on (a for loop, `iter`),
    whether tf.data's autotuning is on for it (None: TensorFlow's default, on)."""
    seen, original = [], tf.data.Dataset.__iter__

    def recording(self):
        seen.append(self.options().autotune.enabled)
        return original(self)

    monkeypatch.setattr(tf.data.Dataset, "__iter__", recording)
    return seen
