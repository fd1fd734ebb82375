"""Checkpoints: the names imported from here before they moved to `tputrain.checkpointing`.

What a checkpoint holds and how damage is handled: `tputrain.checkpointing`
(the package docstring); `Checkpointer` is in `tputrain.checkpointing.manager`.
"""

from tputrain.checkpointing.files import CheckpointList, list_checkpoints
from tputrain.checkpointing.integrity import (CheckpointMismatchError, InputLayoutError,
                                              NonFiniteStateError, describe_mismatch)
from tputrain.checkpointing.manager import Checkpointer
from tputrain.checkpointing.recovery import UNREADABLE_ERRORS, first_readable, read_newest
from tputrain.checkpointing.seeds import seed_generator_states

__all__ = ["CheckpointList", "CheckpointMismatchError", "Checkpointer", "InputLayoutError",
           "NonFiniteStateError", "UNREADABLE_ERRORS", "describe_mismatch", "first_readable",
           "list_checkpoints", "read_newest", "seed_generator_states"]
