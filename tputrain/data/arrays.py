"""Arrays from a `.npz` or `.csv` file, ready for `tputrain.data.write_tfrecords`.

A `.npz`: every array is a feature; they share the leading example dimension.
A `.csv` with a header row: every column is a scalar feature; integer columns
become int64, other numeric columns float32, the rest strings.
`tputrain write-tfrecords` (tputrain/cli/write_tfrecords.py) is the command.
"""

from __future__ import annotations

import csv
import os
import zipfile

import numpy as np
import tensorflow as tf


def _column(values: list[str], name: str = "", path: str = "") -> np.ndarray:
    """int64 if every value is an integer, else float32 if numeric, else str. Codes
    with leading zeros ("02134") stay str (an int would drop the zeros); a number
    column with empty cells is an error naming them (str would hide the column's type)."""
    present = [v for v in values if v.strip()]
    if not present or any(_zero_led(v) for v in present):
        return np.array(values, dtype=str)
    for dtype in (np.int64, np.float32):
        try:
            numbers = [dtype(v) if dtype is np.float32 else int(v) for v in present]
        except ValueError:
            continue
        if len(present) < len(values):
            empty = [n for n, v in enumerate(values, start=2) if not v.strip()]
            raise ValueError(f"{path}: column {name!r} holds numbers but {len(empty)} empty "
                             f"cell(s) (line {', '.join(map(str, empty[:5]))}): fill the "
                             "missing values, or drop those rows")
        return np.array(numbers, dtype=dtype)
    return np.array(values, dtype=str)


def _zero_led(value: str) -> bool:
    """A code such as "02134" (a zero before another digit), which an int would shorten."""
    digits = value.strip().lstrip("+-")
    return len(digits) > 1 and digits[0] == "0" and digits[1].isdigit()


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
    return {name: _column([row[i] for row in rows], name, path)
            for i, name in enumerate(header)}


def read_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of a .npz file (no pickles); a missing, empty or damaged file is
    a one-line error naming it (numpy's own are EOFError or BadZipFile tracebacks)."""
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            with np.load(f, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
    except (EOFError, zipfile.BadZipFile, ValueError, OSError, tf.errors.OpError) as error:
        what = "is empty (0 bytes)" if tf.io.gfile.stat(path).length == 0 else (
            f"is not a readable .npz file ({type(error).__name__}: {error})")
        raise ValueError(f"--input={path} {what}: write it with numpy.savez") from None
    if not arrays:
        raise ValueError(f"{path} holds no arrays")
    return arrays


def check_output_prefix(prefix: str) -> None:
    """The shards' folder must be a folder or creatable: a prefix under a file fails
    here in one line, not as TensorFlow's traceback from the first shard."""
    if "://" in prefix:  # object stores have no files to be under
        return
    folder = os.path.dirname(prefix)
    while folder and not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # the nearest existing ancestor
    if folder and os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"--output_prefix={prefix}: {folder} is a file, not a "
                                 "folder: choose a prefix in a folder")


def read_input(path: str) -> dict[str, np.ndarray]:
    """The features of a .npz or .csv file, by its extension."""
    if path.endswith((".npz", ".csv")) and (not tf.io.gfile.exists(path)
                                            or tf.io.gfile.isdir(path)):
        raise FileNotFoundError(f"--input={path} does not exist or is a folder: pass a .npz "
                                "or .csv file")
    if path.endswith(".npz"):
        return read_npz(path)
    if path.endswith(".csv"):
        return read_csv(path)
    raise ValueError(f"--input={path}: use a .npz or a .csv file")


if __name__ == "__main__":  # `python -m tputrain.data.arrays` (older name) is the command
    from tputrain.cli.write_tfrecords import console_main

    console_main()
