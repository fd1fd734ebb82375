"""A SIGTERM before the CLI's own handling is installed (TensorFlow still importing)
exits 42 with the pre-training line, not -15: the entry holds it, the handler that
takes over acts on it."""

import os
import signal

from faults import sigterm_while_importing
from tputrain.fault_tolerance.preemption_early import hold_early_signals, take_early_signal


def test_a_held_signal_is_taken_once_and_the_replaced_handler_is_handed_on():
    received = []
    before = signal.signal(signal.SIGUSR1, lambda s, f: received.append(s))
    try:
        hold_early_signals((signal.SIGUSR1,))
        os.kill(os.getpid(), signal.SIGUSR1)  # Python runs the handler before the next line
        replaced = {signal.SIGUSR1: signal.signal(signal.SIGUSR1, signal.SIG_IGN)}
        assert take_early_signal(replaced) == signal.SIGUSR1
        assert take_early_signal() is None  # once
        assert received == []  # held, not acted on
        signal.signal(signal.SIGUSR1, replaced[signal.SIGUSR1])  # restoring it later...
        os.kill(os.getpid(), signal.SIGUSR1)
        assert received == [signal.SIGUSR1]  # ...brings back the handler the holder replaced
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_sigterm_while_tensorflow_is_imported_exits_42(tmp_path):
    """Before: the process died by SIGTERM (-15, 143 in a shell) until `tputrain run`
    installed its handler, seconds in. The child holds in its import of tensorflow
    (tests/support/startup_hold) until the test has sent the signal."""
    process = sigterm_while_importing(
        ["--gin_file=digits.gin", f"--model_dir={tmp_path / 'model'}"])
    assert process.code == 42, process.log()
    assert process.text().strip().splitlines()[-1] == (
        "tputrain: signal 15 before training started; nothing to save: rerun the same "
        "command to resume (exit code 42)")
    assert not (tmp_path / "model").exists()
