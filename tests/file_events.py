"""The kill-at-a-file-event harness of the best-checkpoint and end-of-run tests: a CLI
run that prints its file events (tests/faults.py) and pauses before one, and what a
run ends with, compared bitwise."""

from __future__ import annotations

import json
import signal
import sys

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


def event_child(config, model_dir, pause_at: int | None = None, torn: bool = False,
                fifo=None, actions: str = "[@BestCheckpoint(), @EarlyStopping(), @Export()]"):
    """A CLI run that prints its file events (tests/faults.py), paused before one."""
    from faults import Process, child_env

    env = dict(child_env(cpus=2), TPUTRAIN_TEST_EVENTS="1")
    if pause_at:
        env.update(TPUTRAIN_TEST_PAUSE_AT=str(pause_at), TPUTRAIN_TEST_TORN=str(int(torn)))
    if fifo:
        env["TPUTRAIN_TEST_FIFO"] = str(fifo)
    return Process([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                    f"--gin_file={config}", f"--gin_param=Trainer.actions = {actions}",
                    f"--model_dir={model_dir}", "--deterministic"], env)


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


def kill_before_event(config, model_dir, event: int, torn: bool = False) -> str:
    process = event_child(config, model_dir, pause_at=event, torn=torn)
    process.wait_for(rf"tputrain-test: paused before file event {event}$", timeout=900)
    assert process.kill() == -signal.SIGKILL
    return process.text()
