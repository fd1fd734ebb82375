"""Hyper-parameters the config owns (the learning-rate variables), kept over a restore.

A rerun with a lower learning rate uses it, and so does a script's next
`train()` after it set one on a live Trainer; everything else comes from the
checkpoint.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from absl import logging


class ConfigOwned:
    """The values `variables` hold before a restore, put back after it."""

    def __init__(self, variables: Sequence[Any]):
        self.variables = list(variables)
        self._values: list[tuple[Any, tf.Tensor]] = []

    def keep(self) -> None:
        """Before a restore: the config-owned values as they are now, not as they were
        when the Checkpointer was made (a script may have lowered the learning rate on
        a live Trainer between two `train()` calls)."""
        self._values = [(v, tf.identity(v)) for v in self.variables]

    def apply(self) -> None:
        """Puts the config's hyper-parameters back over what a checkpoint held."""
        for variable, value in self._values:
            restored = variable.numpy()
            if not np.array_equal(restored, value.numpy()):
                logging.warning("tputrain: %s is %s in the config and %s in the checkpoint: "
                                "using the config's", getattr(variable, "path", variable.name),
                                value.numpy(), restored)
                variable.assign(value)
