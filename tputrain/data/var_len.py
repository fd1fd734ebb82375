"""Variable-length features for the writer: ragged columns, their rows and their kind.

A variable-length feature holds one rank-1 array per example, of any length
(empty included): token ids of a document, say. It is stored as the values'
list in the `tf.train.Example` (an empty row as a feature with no values, so it
parses as empty whatever the dtype) and read back with a `RaggedFeature`
(`tputrain.data.manifest.var_len_feature`). TPUs still need static shapes:
the reader makes them static by packing, padding or bucketing
(`tputrain.data.packing`, `.padding`, `.bucketing`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

VAR_LEN_SHAPE = (None,)  # the writer's shape of a variable-length feature
_EMPTY_KIND = "float"  # numpy's dtype of [], for a feature whose rows are all empty


def is_ragged(value: Any) -> bool:
    """Whether a column of a dict of arrays is a list of rows of different lengths."""
    if isinstance(value, tf.RaggedTensor):
        return True
    if isinstance(value, np.ndarray) and value.dtype != object:
        return False
    if not isinstance(value, (list, tuple, np.ndarray)) or not len(value):
        return False
    if not all(isinstance(row, (list, tuple, np.ndarray)) for row in value):
        return False
    return len({np.shape(row) for row in value}) > 1


def column_rows(key: str, value: Any, as_array: Callable[[str, Any], np.ndarray]
                ) -> list[np.ndarray]:
    """A variable-length column's rows, each checked to be rank 1."""
    if isinstance(value, tf.RaggedTensor):
        if value.shape.rank != 2:
            raise ValueError(f"feature {key!r}: a variable-length feature has one dimension "
                             f"per example, got a ragged tensor of rank {value.shape.rank}")
        value = list(value.numpy())
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ValueError(f"feature {key!r}: a variable-length column is a list of rows, "
                         f"got {type(value).__name__}")
    return [check_row(key, f"row {i}", as_array(key, row)) for i, row in enumerate(value)]


def check_row(key: str, where: str, array: np.ndarray) -> np.ndarray:
    """One example's value of a variable-length feature: rank 1 (or empty)."""
    if array.ndim != 1 and array.size:
        raise ValueError(
            f"feature {key!r}: {where} has shape {array.shape}, but a variable-length "
            "feature has one dimension per example: flatten it, or store the other "
            "dimensions as fixed-length features")
    return array.reshape(-1)


def row_kind(array: np.ndarray, kind_of: Callable[[np.ndarray], str]) -> str | None:
    """A row's stored kind; None for an empty row, which fits any kind."""
    return kind_of(array) if array.size else None


def column_kind(key: str, rows: Sequence[np.ndarray],
                kind_of: Callable[[np.ndarray], str]) -> str:
    """The one kind of a variable-length column's non-empty rows."""
    kinds = {}
    for i, row in enumerate(rows):
        kind = row_kind(row, kind_of)
        if kind is not None:
            kinds.setdefault(kind, i)
    if len(kinds) > 1:
        (first, i), (other, j) = sorted(kinds.items(), key=lambda item: item[1])[:2]
        raise ValueError(f"feature {key!r} is {other} in row {j} but {first} in row {i}: "
                         "cast it to one type")
    return next(iter(kinds), _EMPTY_KIND)


def stored_row(array: np.ndarray) -> np.ndarray | None:
    """What the encoder writes for a row: None (no values, no type) when empty."""
    return array if array.size else None
