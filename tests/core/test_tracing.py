"""Lean tracing (tputrain/core/tracing.py, issue 38): the step traced once per loop, tputrain's
own helpers unconverted by AutoGraph, a user's code converted as before, and the
same weights as with lean tracing off."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import child_env, final_weights
from processes import Launch
from tiny import TraceCountingTask, strategy_for
from tputrain.core import tracing


def test_a_training_loop_traces_the_step_once(tmp_path):
    assert tracing.ENABLED  # the suite runs the default
    task = TraceCountingTask(num_examples=64)
    trainer = tputrain.Trainer(task, str(tmp_path), strategy=strategy_for(1), train_steps=8,
                               steps_per_loop=4, steps_per_fetch=2, global_batch_size=16,
                               jit_compile=False, report_mfu=False)
    trainer.run_loop(4)
    # The peeled first step, the rest of the first fetch and the later fetches call
    # one traced step (lean tracing off: three traces).
    assert task.traces == 1
    trainer.run_loop(4)
    assert task.traces == 1
    trainer.close()


# A Task whose loss has Python control flow on a tensor: only AutoGraph makes it a
# graph (unconverted, `if` on a symbolic tensor raises). `lean` sets the switch.
SCRIPT = r"""
import json, sys
model_dir, lean = sys.argv[1], sys.argv[2]
import os
os.environ["TPUTRAIN_LEAN_TRACING"] = lean
import faults  # splits the CPU into the child's logical devices
import tputrain, keras, tensorflow as tf
from tiny import TinyTask, devices, strategy_for

class BranchingTask(TinyTask):
    def compute_loss(self, labels, outputs):
        loss = keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)
        if tf.reduce_sum(labels) > 8:  # a tensor condition: AutoGraph's tf.cond
            loss = loss * 2.0
        return loss

if sys.argv[3] == "collective":  # MirroredStrategy's own CPU all-reduce, as users build it
    strategy = tf.distribute.MirroredStrategy(devices(2))
else:
    strategy = strategy_for(int(sys.argv[3]))
trainer = tputrain.Trainer(BranchingTask(num_examples=64, dropout=0.25), model_dir,
                           strategy=strategy, train_steps=6,
                           steps_per_loop=3, steps_per_fetch=3, global_batch_size=16,
                           jit_compile=False, report_mfu=False)
initial = [w.numpy().tolist() for w in trainer.model.weights]
trainer.train()
print("RESULT " + json.dumps({"lean": tputrain.core.tracing.ENABLED,
                              "initial": initial,
                              "weights": [w.numpy().tolist() for w in trainer.model.weights]}))
"""


def _train(tmp_path, name: str, lean: str, replicas: int | str) -> dict:
    script = tmp_path / "branching.py"  # a file: AutoGraph reads the source it converts
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / name), lean,
                             str(replicas)], env=child_env(cpus=2), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.start_early(1)
@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.slow), "collective"])
def test_a_users_control_flow_is_converted_and_the_weights_are_those_of_lean_tracing_off(
        tmp_path, replicas):  # one device; MirroredStrategy over two, reduced on one
    # device or by its default collective all-reduce
    lean = _train(tmp_path, "lean", "on", replicas)
    full = _train(tmp_path, "full", "off", replicas)
    assert lean["lean"] and not full["lean"]
    assert lean["weights"] == full["weights"]  # bitwise: the same ops
    assert lean["weights"] != lean["initial"]  # it trained


WORKERS_CONFIG = """
Trainer.task = @FaultTask()
Trainer.train_steps = 6
Trainer.steps_per_loop = 3
Trainer.global_batch_size = 16
Trainer.checkpoint_every = 6
Trainer.eval_steps = 1
Trainer.report_mfu = False
FaultTask.dropout = 0.3
"""


# slow tier: the collective case stays in the default tier
@pytest.mark.slow
def test_two_worker_processes_train_with_lean_tracing_as_without(tmp_path, monkeypatch):
    # MultiWorkerMirroredStrategy, one device a worker: its cross-worker all-reduce in
    # a nested step function under the loop's `tf.cond` failed to run ("You must feed
    # a value for placeholder"), on every multi-worker run with a loop of 2+ steps.
    config = tmp_path / "mw.gin"
    config.write_text(WORKERS_CONFIG)
    weights = {}
    for lean in ("on", "off"):
        monkeypatch.setenv("TPUTRAIN_LEAN_TRACING", lean)
        launch = Launch(["--workers", "2", "--gin_import=faults", f"--gin_file={config}",
                         f"--model_dir={tmp_path / lean}", "--deterministic"])
        assert launch.finish(timeout=300) == 0, launch.text()[-4000:]
        weights[lean] = final_weights(str(tmp_path / lean))
    assert weights["on"].keys() == weights["off"].keys()
    for name, value in weights["off"].items():
        np.testing.assert_array_equal(weights["on"][name], value, err_msg=name)


def test_the_switch_turns_off_both(monkeypatch):
    monkeypatch.setattr(tracing, "ENABLED", False)

    def helper(x):
        return x + 1
    assert tracing.once(helper) is helper and tracing.graph_helper(helper) is helper
    monkeypatch.setattr(tracing, "ENABLED", True)
    assert isinstance(tracing.once(helper), tf.types.experimental.PolymorphicFunction)
    assert tracing.graph_helper(helper)(1) == 2


def test_a_loop_function_is_unconverted_only_with_lean_tracing(monkeypatch):
    """tputrain's loops (explicit tf.while_loop/tf.cond, the user's step its own
    `once` function) are traced without AutoGraph; with the switch off, converted."""

    def branching(x):
        if x > 0:  # a tensor condition: only AutoGraph makes it a tf.cond
            return x
        return -x
    with pytest.raises(TypeError):  # OperatorNotAllowedInGraphError: Python bool of a tensor
        tracing.loop_function(branching)(tf.constant(-2))
    monkeypatch.setattr(tracing, "ENABLED", False)
    assert tracing.loop_function(branching)(tf.constant(-2)).numpy() == 2


class BranchingDigits(tputrain.tasks.DigitsTask):
    """The user's loss has an `if` on a tensor: AutoGraph must still convert it."""

    def compute_loss(self, labels, outputs):
        loss = super().compute_loss(labels, outputs)
        if tf.reduce_sum(labels) > 8:  # a tensor condition: only AutoGraph makes it a tf.cond
            loss = loss * 1.0
        return loss


def _spy_conversions(monkeypatch) -> list[str]:
    """The `module.qualname` of each function AutoGraph converts from now on (its cache
    of conversions emptied, so earlier tests' conversions count again)."""
    from tensorflow.python.autograph.impl import api  # TF internals: no public hook
    from tensorflow.python.autograph.pyct import cache

    converted, convert = [], api._convert_actual
    monkeypatch.setattr(api._TRANSPILER, "_cache", cache.CodeObjectCache())

    def spy(entity, program_ctx):
        converted.append(f"{getattr(entity, '__module__', '')}.{entity.__qualname__}")
        return convert(entity, program_ctx)
    monkeypatch.setattr(api, "_convert_actual", spy)
    return converted


def test_only_task_methods_and_the_users_code_are_converted(tmp_path, monkeypatch):
    """Every restart pays for each conversion again: tputrain's input
    pipeline, loss helpers, steps, loops, actions, export and checkpoint check (no
    control flow on tensors) are left as they are; the Task's methods, which a user
    may override, and the user's loss are converted."""
    converted = _spy_conversions(monkeypatch)
    task = BranchingDigits(hidden_units=(8,), cache_dir=str(tmp_path / "digits"))
    with tputrain.Trainer(task, str(tmp_path / "run"), strategy=strategy_for(1),
                          train_steps=2, steps_per_loop=2, global_batch_size=16,
                          eval_steps=1, jit_compile=False,
                          actions=[tputrain.Export()]) as trainer:
        trainer.train()
    assert f"{__name__}.BranchingDigits.compute_loss" in converted
    task_methods = {"tputrain.task.Task.compute_gradients", "tputrain.task.Task.eval_step"}
    assert task_methods <= set(converted)
    assert (tmp_path / "run" / "export").is_dir()
    helpers = ("tputrain.data.", "tputrain.checkpointing.", "tputrain.task.unpack_batch",
               "tputrain.task.per_example_weights", "tputrain.task.average_loss",
               "tputrain.loop.", "tputrain.core.", "tputrain.jobs.aggregation.", "tputrain.actions.",
               "tputrain.serving.export.")
    assert sorted(set(name for name in converted if name.startswith(helpers))) == []
