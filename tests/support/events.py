"""Reading a TensorBoard run's scalars back, the way the tests check what was written."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf


def scalar_points(run_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every scalar in the run's event files (by file name,
    then in write order)."""
    points: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(tf.io.gfile.glob(str(Path(run_dir) / "events.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                points.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor))))
    return points


def train_scalars(model_dir, split: str = "train") -> dict[str, list[float]]:
    """Every value of each tag written to the run's train/ (or eval/) folder."""
    return {tag: [value for _, value in points]
            for tag, points in scalar_points(Path(model_dir) / split).items()}


def last_scalars(run_dir) -> dict[str, float]:
    """Each tag's last written value."""
    return {tag: points[-1][1] for tag, points in scalar_points(run_dir).items()}
