"""Tests for tputrain/actions/profiler.py: a trace that finds the disk full."""

import shutil
import subprocess
import sys

import pytest

_DRIVER = r"""
import logging, os, sys
import tensorflow as tf
from absl import logging as absl_logging
from tputrain.actions.profiler import ProfilerAction

disk = sys.argv[1]
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
absl_logging.get_absl_logger().addHandler(handler)
absl_logging.set_verbosity(absl_logging.INFO)

def fill():
    try:
        with open(os.path.join(disk, "fill"), "wb") as f:
            while True:
                f.write(b"x" * 4096)
    except OSError:
        pass

def steps():
    x = tf.random.normal([64, 64])
    for _ in range(5):
        x = tf.matmul(x, x) / 64

profile = os.path.join(disk, "train", "plugins", "profile")
action = ProfilerAction(2, 4, os.path.join(disk, "train"))
action.update(2)
steps()
fill()  # the disk fills while the trace runs
action.update(4)  # stops it: the trace's write finds no space
print("RUNNING", action.running)
print("RUNS", sorted(os.listdir(profile)) if os.path.isdir(profile) else [])
os.remove(os.path.join(disk, "fill"))  # room again: the next trace is written
again = ProfilerAction(6, 8, os.path.join(disk, "train"))
again.update(6)
steps()
again.update(8)
print("TRACES", len(tf.io.gfile.glob(os.path.join(profile, "*", "*.xplane.pb"))))
print("LOG", lines)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a private mount")
def test_a_trace_that_finds_the_disk_full_warns_leaves_no_partial_run_and_goes_on(tmp_path):
    """On a real full disk (a private 2 MB tmpfs) the profiler's stop raised
    ResourceExhaustedError out of the training loop, ending the run for a diagnostic
    and leaving a half-written trace for TensorBoard."""
    from faults import child_env

    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -rm is not permitted here: {probe.stderr.decode().strip()}")
    disk = tmp_path / "disk"
    disk.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    shell = f"mount -t tmpfs -o size=2m tmpfs {disk} && exec {sys.executable} {driver} {disk}"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True,
                            text=True, env=child_env(), timeout=300)
    text = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, text
    assert "RUNNING False" in text and "RUNS []" in text, text
    assert "TRACES 1" in text, text
    log = next(line for line in text.splitlines() if line.startswith("LOG "))
    assert log.count("not written: no space left") == 1, log
    assert ("tputrain: the profile of steps 2-4 is not written: no space left on "
            f"{disk}/train") in log and "training goes on" in log, log
    assert "profile of steps 6-8 written to" in log, log
