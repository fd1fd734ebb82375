"""Hyper-parameters the config owns (the learning-rate variables), kept over a restore.

A rerun with a lower learning rate uses it, and so does a script's next
`train()` after it set one on a live Trainer; everything else comes from the
checkpoint. Unless an action sets them during the run (`set_by`, e.g. Keras's
ReduceLROnPlateau): the checkpoint's values then win. Either way, a value the
config and the checkpoint disagree on is logged, with the one used.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from absl import logging


class ConfigOwned:
    """The values `variables` hold before a restore, put back after it (unless `set_by`
    names what sets them during the run: then only logged where they differ)."""

    def __init__(self, variables: Sequence[Any], set_by: str = ""):
        self.variables = list(variables)
        self.set_by = set_by
        self._values: list[tuple[Any, tf.Tensor]] = []

    @classmethod
    def of(cls, owned: "Sequence[Any] | ConfigOwned") -> "ConfigOwned":
        """`owned` as it is, or its variables the config's (nothing sets them)."""
        return owned if isinstance(owned, ConfigOwned) else cls(owned)

    def keep(self) -> None:
        """Before a restore: the config-owned values as they are now, not as they were
        when the Checkpointer was made (a script may have lowered the learning rate on
        a live Trainer between two `train()` calls)."""
        self._values = [(v, tf.identity(v)) for v in self.variables]

    def apply(self) -> None:
        """Puts the config's hyper-parameters back over what a checkpoint held (keeps
        the checkpoint's where `set_by` sets them), saying which won where they differ."""
        for variable, value in self._values:
            restored = variable.numpy()
            if np.array_equal(restored, value.numpy()):
                continue
            name = getattr(variable, "path", variable.name)
            if self.set_by:
                logging.warning("tputrain: %s is %s in the config and %s in the checkpoint: "
                                "using the checkpoint's, as %s sets it during the run (for the "
                                "config's, train in a new model_dir)", name, value.numpy(),
                                restored, self.set_by)
                continue
            logging.warning("tputrain: %s is %s in the config and %s in the checkpoint: "
                            "using the config's", name, value.numpy(), restored)
            variable.assign(value)
