"""Preemption: a real SIGTERM mid-loop stops at the next step, saves, exits 42, resumes exactly.

(The same through the CLI, with a rerun of the command, is in test_resume.py.)
"""

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.observe import goodput
from tputrain.fault_tolerance.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionWatcher
from faults import Process, child_env
from tiny import TinyTask, strategy_for, weights

STEPS = 300  # one loop of 300 steps: the signal must land inside it, even under load


class SignalTask(TinyTask):
    """TinyTask that sends this process SIGTERM from inside the compiled loop, on the
    `kill_at`-th loss computation (each replica computes one per step): the signal
    lands mid-loop by construction, not by racing a watcher thread against it."""

    def __init__(self, kill_at: int | None = None):
        super().__init__(dropout=0.3)
        self.kill_at, self.calls = kill_at, 0

    def _tick(self):
        self.calls += 1
        if self.calls == self.kill_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def compute_loss(self, labels, outputs):
        with tf.control_dependencies([tf.py_function(self._tick, [], [])]):
            return tf.identity(super().compute_loss(labels, outputs))


def make_trainer(model_dir, kill_at=None, **kwargs):
    options = dict(train_steps=STEPS, steps_per_loop=STEPS, global_batch_size=16,
                   checkpoint_every=STEPS, eval_steps=1)
    options.update(kwargs)
    return tputrain.Trainer(SignalTask(kill_at), str(model_dir), strategy=strategy_for(2),
                            **options)


def test_sigterm_mid_loop_saves_at_the_next_step_and_resumes_exactly(tmp_path):
    reference = make_trainer(tmp_path / "reference")
    reference.train()

    handler_before = signal.getsignal(signal.SIGTERM)
    # The 5th loss of 2 replicas: during step 2 of one 300-step compiled loop.
    trainer = make_trainer(tmp_path / "run", kill_at=5)
    with pytest.raises(Preempted) as caught:
        trainer.train()
    preempted = caught.value
    assert isinstance(preempted, SystemExit) and preempted.code == PREEMPTED_EXIT_CODE == 42
    # One compiled loop would run all STEPS steps: it stopped at a step boundary inside it.
    assert 2 <= preempted.step < STEPS
    assert preempted.checkpoint.endswith(f"ckpt-{preempted.step}")
    assert int(trainer.step.numpy()) == preempted.step
    assert signal.getsignal(signal.SIGTERM) is handler_before, "the old handler is back"

    resumed = make_trainer(tmp_path / "run")
    resumed.train()
    assert int(resumed.step.numpy()) == STEPS
    # The goodput account saw the preemption's save: nothing was lost or recomputed.
    first, second = goodput.read_records(str(tmp_path / "run"))
    assert first["last_checkpoint_step"] == first["last_step"] == preempted.step
    assert first["seconds"]["checkpoint"] > 0 and not first["finished"]
    assert second["restored_step"] == preempted.step
    assert goodput.account(str(tmp_path / "run"))["recomputed_steps"] == 0
    for a, b in zip(weights(reference), weights(resumed)):
        np.testing.assert_array_equal(a, b)


def test_watcher_sets_the_flag_from_the_signal_while_python_is_blocked():
    watcher = PreemptionWatcher()
    assert watcher.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        # The watcher thread sets the TF flag without the main thread running Python
        # handlers: wait for it on the flag itself.
        deadline = time.monotonic() + 10
        while not bool(watcher.flag.numpy()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bool(watcher.flag.numpy()) and watcher.requested
    finally:
        watcher.uninstall()


def test_watcher_off_the_main_thread_does_not_install():
    watcher = PreemptionWatcher()
    results = []
    thread = threading.Thread(target=lambda: results.append(watcher.install()))
    thread.start()
    thread.join()
    assert results == [False]
    watcher.uninstall()  # a no-op


def test_preempted_message_says_how_to_resume():
    text = str(Preempted(7, "/m/checkpoints/ckpt-7"))
    assert "step 7" in text and "rerun the same command" in text and "42" in text


def test_sigterm_while_the_input_is_read_before_training_exits_42(tmp_path):
    """The CLI's pre-training handler ran in Python only, and the main thread waited
    inside TensorFlow's first read of the train split: SIGTERM was never acted on (a
    0-byte shuffled shard spun so). The test waits for the read to have started; the
    timeout is a hang guard only."""
    config = tmp_path / "blocking.gin"
    config.write_text("Trainer.task = @BlockingInputTask()\nTrainer.train_steps = 2\n"
                      "Trainer.global_batch_size = 8\nTrainer.eval_steps = 1\n")
    process = Process([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                       f"--gin_file={config}", f"--model_dir={tmp_path / 'model'}"],
                      child_env())
    process.wait_for("tputrain-test: reading input")
    process.process.send_signal(signal.SIGTERM)
    try:
        code = process.finish(timeout=120)
    finally:
        process.process.kill()
    assert code == PREEMPTED_EXIT_CODE, process.log()
    assert "before training started; nothing to save" in process.text()
    assert "Traceback" not in process.text()


def test_ctrl_c_on_the_cli_saves_at_the_next_step_and_a_second_one_stops_at_once(tmp_path):
    """Ctrl-C (SIGINT) on `tputrain run` raised KeyboardInterrupt through the compiled
    loop: 68 lines of traceback and no checkpoint of the steps since the last one. It
    now stops as SIGTERM does: the next step boundary is saved and the run exits 42
    (rerun to resume); a second Ctrl-C before that stops at once (exit 130), as a
    kill would, the last checkpoint intact."""
    model_dir = tmp_path / "model"
    command = [sys.executable, "-m", "tputrain.run", "--gin_import=faults",
               "--gin_param=Trainer.task=@FaultTask()", f"--model_dir={model_dir}",
               "--gin_param=Trainer.train_steps=100", "--gin_param=Trainer.steps_per_loop=10",
               "--gin_param=Trainer.global_batch_size=16", "--gin_param=Trainer.eval_steps=1",
               "--gin_param=Trainer.checkpoint_every=1000", "--gin_param=Trainer.report_mfu=False",
               "--gin_param=Trainer.actions=[@PauseAtStep()]", "--gin_param=PauseAtStep.step=30"]
    process = Process(command, child_env())
    process.wait_for(r"tputrain-test: paused at step 30")
    process.process.send_signal(signal.SIGINT)
    code = process.finish(timeout=300)
    assert code == PREEMPTED_EXIT_CODE, process.log()
    assert "received SIGINT" in process.text() and "Traceback" not in process.text()
    saved = {int(name.split(".")[0][5:]) for name in os.listdir(model_dir / "checkpoints")
             if name.startswith("ckpt-")}
    # Saved past the pause and before the end (the next launch of 10 steps a program).
    assert len(saved) == 1 and 30 < saved.pop() < 100, os.listdir(model_dir / "checkpoints")

    script = ("import os, signal, time\n"
              "from tputrain.fault_tolerance.preemption import PreemptionWatcher\n"
              "watcher = PreemptionWatcher((signal.SIGTERM, signal.SIGINT))\n"
              "watcher.install()\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "while not watcher.requested: time.sleep(0.01)\n"
              "print('tputrain-test: asked once', flush=True)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(60)\n")
    twice = Process([sys.executable, "-c", script], child_env())
    twice.wait_for("tputrain-test: asked once")
    assert twice.finish(timeout=60) == 130, twice.log()
    assert "second" in twice.text() and "Traceback" not in twice.text()
