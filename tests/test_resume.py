"""Exact resume, end to end through the CLI: kill it at any moment, rerun the same
command, and the result is bitwise what an uninterrupted run gives.

One chain of interruptions on one model_dir (2 replicas, dropout, a shuffle
buffer in the input, op determinism on): SIGKILL after a random step, SIGKILL
while a checkpoint is being written, SIGTERM after a random step (exit 42 with a
checkpoint at the step it stopped), then a rerun to the end. An uninterrupted
reference runs alongside. Process starts dominate the time (~6 s of TF import
each), so the trials share one chain.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from faults import Process, child_env, final_weights

TRAIN_STEPS = 40  # long enough that a kill lands before the run ends
CONFIG = f"""
Trainer.task = @FaultTask()
Trainer.train_steps = {TRAIN_STEPS}
Trainer.steps_per_loop = 3
Trainer.global_batch_size = 16
Trainer.checkpoint_every = 4
Trainer.keep_checkpoints = 2
Trainer.eval_steps = 1
Trainer.report_mfu = False  # skips tracing the step to count FLOPs
resolve_strategy.strategy = 'mirrored'
FaultTask.dropout = 0.3
# 32 MB of frozen weights: a checkpoint write takes long enough to be interrupted.
FaultTask.ballast_floats = 8000000
"""
PREEMPTED_EXIT_CODE = 42


class Child(Process):
    """A `tputrain` training run of `config` into `model_dir`."""

    def __init__(self, config: Path, model_dir: Path):
        super().__init__([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                          f"--gin_file={config}", f"--model_dir={model_dir}", "--deterministic"],
                         child_env(cpus=2))


def listed_checkpoints(model_dir: Path) -> list[str]:
    state = tf.train.get_checkpoint_state(str(model_dir / "checkpoints"))
    return [os.path.basename(p) for p in state.all_model_checkpoint_paths] if state else []


def kill_during_write(config: Path, model_dir: Path, attempts: int = 3) -> int:
    """SIGKILLs a run as soon as a new checkpoint's files appear, before it is listed.

    Returns the step of the torn checkpoint. If the kill lands after the write
    committed (a slow poll), tries again on a fresh run.
    """
    checkpoints = model_dir / "checkpoints"
    for _ in range(attempts):
        child = Child(config, model_dir)
        step = int(child.wait_for(r"tputrain: saving checkpoint at step (\d+)").group(1))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            names = os.listdir(checkpoints) if checkpoints.exists() else []
            if any(name.startswith(f"ckpt-{step}") for name in names):
                break
        child.kill()
        if f"ckpt-{step}" not in listed_checkpoints(model_dir):
            leftovers = [n for n in os.listdir(checkpoints) if n.startswith(f"ckpt-{step}")]
            assert leftovers, "the kill should have left a partial checkpoint behind"
            return step
    pytest.fail(f"could not kill a run mid-write in {attempts} attempts")


@pytest.mark.slow
def test_sigkill_and_sigterm_at_random_steps_resume_bitwise(tmp_path):
    seed = int(time.time())
    rng = random.Random(seed)
    print(f"random kill steps from seed {seed}")
    config = tmp_path / "resume.gin"
    config.write_text(CONFIG)
    reference = Child(config, tmp_path / "reference")  # runs alongside the chain
    model_dir = tmp_path / "interrupted"

    # 1. SIGKILL after a random step.
    child = Child(config, model_dir)
    kill_after = rng.randint(2, 9)
    child.wait_for(rf"tputrain: step (?:{'|'.join(map(str, range(kill_after, TRAIN_STEPS)))})/")
    assert child.kill() == -signal.SIGKILL

    # 2. SIGKILL while a checkpoint is being written: the torn one is never restored.
    torn = kill_during_write(config, model_dir)
    child = Child(config, model_dir)
    restored = child.wait_for(r"tputrain: (?:restored \S+ \(step (\d+)\)|training from step (\d+))")
    assert int(restored.group(1) or restored.group(2)) < torn

    # 3. SIGTERM after a random later step: a checkpoint at the step it stopped, exit 42.
    term_after = rng.randint(torn + 1, min(torn + 8, TRAIN_STEPS // 2 + 8))
    child.wait_for(rf"tputrain: step (?:{'|'.join(map(str, range(term_after, TRAIN_STEPS)))})/")
    assert child.kill(signal.SIGTERM) == PREEMPTED_EXIT_CODE, child.log()
    stopped = re.search(r"preempted at step (\d+); saved \S+ckpt-(\d+)", child.text())
    assert stopped and stopped.group(1) == stopped.group(2), child.log()
    assert int(stopped.group(1)) < TRAIN_STEPS
    assert f"ckpt-{stopped.group(1)}" in listed_checkpoints(model_dir)

    # 4. Rerun the same command to the end.
    final = Child(config, model_dir)
    assert final.finish() == 0, final.log()
    assert re.search(rf"restored \S+ckpt-{stopped.group(1)} ", final.text()), final.log()
    assert reference.finish() == 0, reference.log()

    expected, actual = final_weights(str(tmp_path / "reference")), final_weights(str(model_dir))
    assert expected.keys() == actual.keys() and len(expected) > 4
    assert any(key.startswith("seeds/") for key in expected), "dropout RNG state is saved"
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)
