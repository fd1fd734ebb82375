"""Named eval sets (`TrainerOptions.eval_splits`): one `Evaluator` per set, in turn.

Each set is evaluated exactly as the single split is (its own iterator, built
once and reused; its own step count, agreed across hosts; its last batch padded),
with the model's metric objects, reset before each set. The default single set
"eval" reports as it always has ({"loss", "accuracy", ...}, TensorBoard `eval/`);
named sets report "<set>/<metric>" keys and a TensorBoard run `eval/<set>/` each,
so `BestCheckpoint(metric="test/accuracy")` can pick by one of them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import keras

from tputrain.loop.evaluation import Evaluator
from tputrain.loop.inputs import Inputs
from tputrain.observe.progress import Progress, Stopwatch
from tputrain.task import Task

DEFAULT_SPLITS = ("eval",)
# (split, (logs, steps)) -> (logs, steps): what a caller adds to each set's result.
Extra = Callable[[str, tuple[dict[str, float], int]], tuple[dict[str, float], int]]


def is_default(splits: Iterable[str]) -> bool:
    """The single unnamed split, whose logs keep their bare metric names."""
    return tuple(splits) == DEFAULT_SPLITS


def log_keys(splits: Sequence[str], names: Sequence[str]) -> list[str]:
    """The keys of an evaluation's logs, given each set's metric `names`."""
    if is_default(splits):
        return list(names)
    return [f"{split}/{name}" for split in splits for name in names]


def merged(per_set: Mapping[str, tuple[Mapping[str, float], int]]) -> dict[str, float]:
    """One logs dict: the default split's as is, named sets' keys "<set>/<metric>"."""
    if is_default(per_set):
        return dict(per_set["eval"][0])
    return {f"{name}/{key}": value for name, (logs, _) in per_set.items()
            for key, value in logs.items()}


class EvalSets:
    """`run()` evaluates every eval set and reports it; returns the merged logs."""

    def __init__(self, task: Task, model: keras.Model, metrics: Sequence[keras.metrics.Metric],
                 inputs: Inputs, eval_steps: int | None, max_over_hosts: Callable[[int], int],
                 splits: Sequence[str]):
        self.evaluators = {split: Evaluator(task, model, metrics, inputs, eval_steps,
                                            max_over_hosts, split=split) for split in splits}

    def evaluate(self, extra: Extra | None = None) -> dict[str, tuple[dict[str, float], int]]:
        """Each set's (logs, eval steps run), in the order of `eval_splits`; `extra`
        adds to a set's result (`tputrain.jobs.aggregation`: host-side metrics)."""
        extra = extra or (lambda split, result: result)
        return {split: extra(split, evaluator.evaluate())
                for split, evaluator in self.evaluators.items()}

    def run(self, progress: Progress, step: int, averaged: bool = False,
            extra: Extra | None = None) -> dict[str, float]:
        """Evaluates every set, logs the line and writes TensorBoard (`progress`)."""
        with Stopwatch() as watch:
            per_set = self.evaluate(extra)
        if is_default(per_set):
            logs, steps = per_set["eval"]
            progress.eval_done(step, logs, watch.seconds, steps, averaged)
        else:
            progress.eval_sets_done(step, per_set, watch.seconds, averaged)
        return merged(per_set)

    def close(self) -> None:
        """Frees every set's eval iterator now."""
        for evaluator in self.evaluators.values():
            evaluator.close()
