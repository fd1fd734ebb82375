"""The kill-at-a-file-event harness of the best-checkpoint and end-of-run tests: a CLI
run that prints its file events (tests/support/faults.py) and pauses before one, and what a
run ends with, compared bitwise."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

# A run with a best checkpoint, early stopping and dropout on 2 replicas.
CONFIG = """
Trainer.task = @FaultTask()
Trainer.train_steps = 80
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.eval_every = 4
Trainer.eval_steps = 2
Trainer.checkpoint_every = 6
Trainer.keep_checkpoints = 2
Trainer.report_mfu = False
BestCheckpoint.metric = 'eval/loss'
BestCheckpoint.mode = 'min'
EarlyStopping.metric = 'loss'
EarlyStopping.patience = 3
EarlyStopping.min_delta = 0.01
resolve_strategy.strategy = 'mirrored'
FaultTask.dropout = 0.3
FaultTask.learning_rate = 0.2
"""


def model_variables(prefix: str) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(prefix)
            if name.startswith("model/")}


def event_child(config, model_dir, pause_at: int | str | None = None, torn: bool = False,
                fifo=None, actions: str = "[@BestCheckpoint(), @EarlyStopping(), @Export()]"):
    """A CLI run that prints its file events (tests/support/faults.py), paused before one
    (`pause_at="every"`: before each, told what next on its stdin)."""
    from faults import Process, child_env

    env = dict(child_env(cpus=2), TPUTRAIN_TEST_EVENTS="1")
    if pause_at:
        env.update(TPUTRAIN_TEST_PAUSE_AT=str(pause_at), TPUTRAIN_TEST_TORN=str(int(torn)))
    if pause_at == "every":
        fifo = "/dev/stdin"
    if fifo:
        env["TPUTRAIN_TEST_FIFO"] = str(fifo)
    return Process([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                    f"--gin_file={config}", f"--gin_param=Trainer.actions = {actions}",
                    f"--model_dir={model_dir}", "--deterministic"], env,
                   stdin=pause_at == "every")


def copy_state(model_dir: Path, target: Path) -> None:
    if model_dir.exists():
        shutil.copytree(model_dir, target, symlinks=True)
    else:  # nothing written yet
        target.mkdir(parents=True)


def kill_states(config, model_dir, states) -> tuple[int, str]:
    """One run, paused before each file event: copies model_dir as a kill there leaves
    it (the flock dies with its holder; temp names carry a pid that has ended by the
    time they are read) to `states/<n>-0`, and for a copy, cut in half, to `<n>-1`.
    Returns the run's exit code and output (it runs on to the end: the reference)."""
    from faults import file_events

    process = event_child(config, model_dir, pause_at="every")
    while match := process.next_match(r"tputrain-test: paused before file event (\d+)$",
                                      timeout=900):
        number = match.group(1)
        copy_state(model_dir, states / f"{number}-0")
        op, target = dict(file_events(process.text()))[int(number)].split(" ", 1)
        if op == "copy":  # target: "<folder>/<name>" in model_dir
            process.send("torn")
            process.wait_for(rf"tputrain-test: torn before file event {number}$")
            copy_state(model_dir, states / f"{number}-1")
            assert (states / f"{number}-1" / target).exists(), target  # the half file
            assert not (states / f"{number}-0" / target).exists(), target
        process.send("go")
    return process.finish(timeout=900), process.text()


def run_outcome(model_dir) -> dict:
    """What a run ends with: its records, final and best checkpoints, exports, weights."""
    from faults import final_weights

    best = json.loads((model_dir / "best" / "best.json").read_text())
    return {"early_stopping": json.loads((model_dir / "checkpoints" / "early_stopping.json")
                                         .read_text()),
            "best": best,
            "final": tf.train.latest_checkpoint(str(model_dir / "checkpoints")).rsplit("/")[-1],
            "best_files": sorted(p.name for p in (model_dir / "best").iterdir()),
            "exports": sorted(p.name for p in (model_dir / "export").iterdir()),
            "weights": final_weights(str(model_dir)),
            "best_weights": model_variables(str(model_dir / "best" / best["checkpoint"]))}


def assert_same_outcome(actual: dict, expected: dict, context: str) -> None:
    for key in ("early_stopping", "best", "final", "best_files", "exports"):
        assert actual[key] == expected[key], f"{context}: {key}"
    for key in ("weights", "best_weights"):
        assert actual[key].keys() == expected[key].keys(), f"{context}: {key}"
        for name in expected[key]:
            np.testing.assert_array_equal(actual[key][name], expected[key][name],
                                          err_msg=f"{context}: {key} {name}")
