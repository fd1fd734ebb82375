"""Arrays from a `.npz` or `.csv` file, ready for `tputrain.data.write_tfrecords`.

A `.npz`: every array is a feature; they share the leading example dimension.
A `.csv` with a header row: every column is a scalar feature; integer columns
become int64, other numeric columns float32, the rest strings.
`tputrain write-tfrecords` (tputrain/cli/write_tfrecords.py) is the command.
"""

from __future__ import annotations

import csv

import numpy as np
import tensorflow as tf


def _column(values: list[str]) -> np.ndarray:
    """int64 if every value is an integer, else float32 if numeric, else str."""
    for dtype in (np.int64, np.float32):
        try:
            return np.array([dtype(v) if dtype is np.float32 else int(v) for v in values],
                            dtype=dtype)
        except ValueError:
            continue
    return np.array(values, dtype=str)


def read_csv(path: str) -> dict[str, np.ndarray]:
    """Columns of a CSV file with a header row, typed per column."""
    with tf.io.gfile.GFile(path, "r") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise ValueError(f"{path} is empty: a header row and data rows are needed") from None
        rows = list(reader)
    if not rows:
        raise ValueError(f"{path} has a header but no rows")
    if len(set(header)) != len(header) or not all(header):
        raise ValueError(f"{path}: the header {header} needs unique, non-empty column names")
    for number, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise ValueError(f"{path} line {number} has {len(row)} fields but the header has "
                             f"{len(header)}")
    return {name: _column([row[i] for row in rows]) for i, name in enumerate(header)}


def read_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of a .npz file (no pickles)."""
    with tf.io.gfile.GFile(path, "rb") as f:
        with np.load(f, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    if not arrays:
        raise ValueError(f"{path} holds no arrays")
    return arrays


def read_input(path: str) -> dict[str, np.ndarray]:
    """The features of a .npz or .csv file, by its extension."""
    if path.endswith(".npz"):
        return read_npz(path)
    if path.endswith(".csv"):
        return read_csv(path)
    raise ValueError(f"--input={path}: use a .npz or a .csv file")


if __name__ == "__main__":  # `python -m tputrain.write_tfrecords_cli` (older name) is the command
    from tputrain.cli.write_tfrecords import console_main

    console_main()
