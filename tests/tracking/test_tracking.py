"""The trackers' common parts: the background sender (tputrain/tracking/sender.py), and
that the library imports no tracker or tuner package until a run uses one."""

from __future__ import annotations

import subprocess
import sys
import threading

from absl import logging as absl_logging

from tputrain.tracking import sender as sender_module
from tputrain.tracking.sender import Sender


def test_a_failing_tracker_is_retried_in_order_and_warned_about_once(monkeypatch, caplog):
    monkeypatch.setattr(sender_module, "FIRST_PAUSE", 0.001)
    failures, sent = [3], []

    def send(job):
        if failures[0]:
            failures[0] -= 1
            raise ConnectionError("connection refused\nsecond line")
        sent.append(job)

    sender = Sender("TestTracker", send)
    with caplog.at_level("INFO", logger=absl_logging.get_absl_logger().name):
        for job in range(5):
            sender.put(job)
        assert sender.flush(timeout=60)
    sender.close()
    assert sent == [0, 1, 2, 3, 4]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["tputrain: TestTracker: the tracker failed (ConnectionError: connection "
                        "refused): training goes on; its metrics are queued and retried"]


def test_a_full_queue_drops_new_jobs_and_says_so_once(caplog):
    taken, release, sent = threading.Event(), threading.Event(), []

    def send(job):
        taken.set()
        release.wait()
        sent.append(job)

    sender = Sender("TestTracker", send, max_jobs=2)
    sender.put("in flight")
    assert taken.wait(60)
    with caplog.at_level("WARNING", logger=absl_logging.get_absl_logger().name):
        for job in ("a", "b", "c", "d"):
            sender.put(job)  # never blocks
    release.set()
    assert sender.flush(timeout=60)
    sender.close()
    assert sent == ["in flight", "a", "b"] and sender.dropped == 2
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1


def test_the_library_and_its_commands_import_no_tracker_or_tuner_package():
    """Acceptance 6: without the extras nothing of tputrain needs them until a run uses
    one (here they are installed: the check is that nothing imported them)."""
    code = ("import sys, tputrain; tputrain.load_api(); import tputrain.tracking, "
            "tputrain.tuning.report, tputrain.tuning.spec, tputrain.tuning.vertex_job, "
            "tputrain.cli.tune, tputrain.cli.vertex_spec, tputrain.cli.run, tputrain.cli.eval; "
            "print(sorted(m for m in ('mlflow', 'wandb', 'optuna', 'yaml') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
