"""The trackers' spool (tputrain/tracking/spool.py): the metrics a tracker was asked to
send, kept in model_dir, read back after a kill, and sent again on resume to a run that
lacks them (only the steps the restored checkpoint kept, each once)."""

from __future__ import annotations

import os
import threading

from tputrain.tracking.base import Tracker
from tputrain.tracking.record import write_record
from tputrain.tracking.spool import Spool


def test_a_spool_reads_back_whole_lines_and_a_kill_s_cut_line_costs_no_later_line(tmp_path):
    spool = Spool(str(tmp_path), "memory")
    spool.append(100, {"train/loss": 0.5})
    spool.append(200, {"train/loss": 0.25, "train/mfu": float("nan")})
    spool.close()
    with open(spool.path, "a", encoding="utf-8") as f:
        f.write('{"step": 300, "values": {"train/lo')  # a kill in the middle of a line
    again = Spool(str(tmp_path), "memory")  # the resumed process
    again.append(300, {"train/loss": 0.125})
    again.close()
    jobs = again.read()
    assert [(step, sorted(values)) for step, values in jobs] == [
        (100, ["train/loss"]), (200, ["train/loss", "train/mfu"]), (300, ["train/loss"])]
    assert jobs[2][1]["train/loss"] == 0.125
    assert spool.path == os.path.join(str(tmp_path), "tracking", "memory.spool.jsonl")


def test_a_remote_model_dir_has_no_spool():
    spool = Spool("gs://bucket/run", "memory")
    spool.append(100, {"train/loss": 0.5})  # nothing to append to: no error
    assert spool.path is None and spool.read() == []


class MemoryTracker(Tracker):
    """A tracker whose run is a list in memory: it holds `held` already (what the killed
    process's tracker had written), and records what is sent."""

    name = "memory"

    def __init__(self, held):
        super().__init__()
        self.held, self.sent, self.opened = held, [], threading.Event()

    def open_run(self, run_id, model_dir):
        self.opened.set()
        return run_id or "run-1"

    def logged_steps(self):
        steps = {}
        for step, values in self.held:
            steps.update({key: step for key in values})
        return steps

    def send_metrics(self, step, values):
        self.sent.append((step, dict(values)))


def test_a_resume_sends_the_spooled_steps_up_to_the_restored_one_that_the_run_lacks(tmp_path):
    model_dir = str(tmp_path)
    write_record(model_dir, "memory", {"run_id": "run-1"})
    killed = Spool(model_dir, "memory")  # what the killed process was asked to send
    for step in (100, 200, 300):
        killed.append(step, {"train/loss": 1.0 / step})
    killed.append(200, {"eval/accuracy": 0.5})
    killed.append(300, {"eval/accuracy": 0.6})
    killed.close()
    # Its tracker wrote step 100 only; the resume restored the checkpoint of step 200.
    tracker = MemoryTracker(held=[(100, {"train/loss": 0.01})])
    tracker.start(model_dir, writer=True, restored_step=200)
    assert tracker.sender.flush(timeout=60)
    tracker.sender.close()
    assert tracker.sent == [(200, {"train/loss": 1.0 / 200}), (200, {"eval/accuracy": 0.5})]
    # What the resumed training logs from here on goes to the spool and the run once.
    tracker.put_metrics(300, {"train/loss": 0.3})
    tracker.close()
    assert [step for step, _ in Spool(model_dir, "memory").read()] == [100, 200, 300, 200, 300,
                                                                      300]


def test_a_first_run_and_tputrain_eval_send_nothing_from_the_spool(tmp_path):
    model_dir = str(tmp_path)
    spool = Spool(model_dir, "memory")
    spool.append(100, {"train/loss": 0.5})
    spool.close()
    for tracker, writer in ((MemoryTracker(held=[]), True),  # a run from step 0
                            (MemoryTracker(held=[]), False)):  # then `tputrain eval`
        tracker.start(model_dir, writer=writer, restored_step=0 if writer else None)
        assert tracker.sender.flush(timeout=60)  # (the first wrote the run's record)
        tracker.sender.close()
        assert tracker.opened.is_set() and tracker.sent == []


class ResumedOnlineTracker(MemoryTracker):
    """A run whose server took steps up to 299 and takes none below 300 (W&B online's
    `starting_step`), though the killed process's local files hold none of them."""

    def first_step(self):
        return 300


def test_a_resume_sends_nothing_below_the_first_step_the_run_takes(tmp_path):
    model_dir = str(tmp_path)
    write_record(model_dir, "memory", {"run_id": "run-1"})
    killed = Spool(model_dir, "memory")
    for step in (100, 200):
        killed.append(step, {"train/loss": 1.0 / step})
    killed.close()
    tracker = ResumedOnlineTracker(held=[])
    tracker.start(model_dir, writer=True, restored_step=200)
    tracker.put_metrics(300, {"train/loss": 0.3})
    assert tracker.sender.flush(timeout=60)
    tracker.close()
    assert tracker.sent == [(300, {"train/loss": 0.3})]
