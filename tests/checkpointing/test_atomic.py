"""tputrain.write_atomically / atomic_path: a kill at any file event of a write leaves the
old file or the new one whole; two writers never share a temp file."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import tputrain
from tputrain.checkpointing import atomic

# A writer in a child that stops before each file event of the helper (a write, a
# close, an fsync, the rename) until told "go" on its stdin. It loads no TensorFlow
# (local files: plain `os` calls); with TensorFlow the same steps go through
# `tf.io.gfile`, whose events tests/support/faults.py watches in the best and export tests.
CHILD = r"""
import os, sys
from tputrain.checkpointing import atomic

def paused(what, call):
    def run(*args, **kwargs):
        print(f"paused before {what}", flush=True)
        sys.stdin.readline()
        return call(*args, **kwargs)
    return run

class File:
    def __init__(self, *args, **kwargs):
        self.file = open(*args, **kwargs)
        self.write, self.close = paused("write", self.file.write), paused("close", self.file.close)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.close()

atomic.open = File
os.fsync = paused("fsync", os.fsync)
os.replace = paused("rename", os.replace)
atomic.write_atomically(sys.argv[1], open(sys.argv[2], "rb").read())
print("written", "tensorflow" in sys.modules, flush=True)
"""


def test_a_kill_at_any_file_event_leaves_the_old_file_or_the_new_one(tmp_path):
    from faults import Process, child_env

    folder = tmp_path / "run"
    folder.mkdir()
    target = folder / "record.json"
    old, new = b"old " * 1000, np.random.default_rng(0).bytes(3 << 20)
    target.write_bytes(old)
    (tmp_path / "new").write_bytes(new)
    process = Process([sys.executable, "-c", CHILD, str(target), str(tmp_path / "new")],
                      child_env(), stdin=True)
    events = []
    while match := process.next_match(r"^paused before (\w+)$", timeout=300):
        events.append(match.group(1))
        state = tmp_path / f"killed-{len(events)}"
        shutil.copytree(folder, state)  # what a kill now leaves
        assert (state / target.name).read_bytes() in (old, new), events
        process.send("go")
    assert process.finish() == 0, process.text()
    assert "written False" in process.text()
    assert target.read_bytes() == new and os.listdir(folder) == [target.name]
    # The data is on disk before the rename, and the rename is on disk after it.
    rename = events.index("rename")
    assert "fsync" in events[:rename] and "fsync" in events[rename + 1:], events
    assert events.index("close") < rename and events[-1] == "fsync", events


def test_two_writers_never_share_a_temp_file(tmp_path):
    """Each of 4 threads writes its own whole file 20 times to one path: each write
    succeeds, every read in between sees one writer's file whole, no temp is left."""
    target = tmp_path / "state.bin"
    contents = [bytes([i]) * (256 << 10) for i in range(4)]
    errors, reads = [], []
    start = threading.Barrier(5)

    def write(data):
        start.wait()
        try:
            for _ in range(20):
                tputrain.write_atomically(str(target), data)
        except Exception as error:  # noqa: BLE001 - collected for the assertion
            errors.append(error)

    threads = [threading.Thread(target=write, args=(data,)) for data in contents]
    for thread in threads:
        thread.start()
    start.wait()
    while any(thread.is_alive() for thread in threads):
        if target.exists():
            reads.append(target.read_bytes())
    for thread in threads:
        thread.join()
    assert errors == []
    assert all(read in contents for read in reads)
    assert target.read_bytes() in contents and os.listdir(tmp_path) == [target.name]


def test_temp_names_are_the_writers_own_and_recognised(tmp_path):
    target = str(tmp_path / "best.json")
    first, second = atomic.temp_path(target), atomic.temp_path(target)
    assert first != second and os.path.dirname(first) == str(tmp_path)
    assert atomic.temp_owner(first)[1] == os.getpid() and atomic.is_temp(first)
    assert not atomic.is_temp(target)
    assert atomic.temp_path(str(tmp_path / "model.keras"), keep_suffix=True).endswith(".keras")


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "final.weights.h5"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with tputrain.atomic_path(str(target)) as temp:
            with open(temp, "w") as f:
                f.write("half")
            raise RuntimeError("writer failed")
    assert target.read_text() == "old" and os.listdir(tmp_path) == [target.name]


def test_a_folder_is_written_whole_and_text_is_text(tmp_path):
    with tputrain.atomic_path(str(tmp_path / "export" / "8"), overwrite=False) as temp:
        os.makedirs(os.path.join(temp, "variables"))
        with open(os.path.join(temp, "saved_model.pb"), "wb") as f:
            f.write(b"pb")
    assert (tmp_path / "export" / "8" / "saved_model.pb").read_bytes() == b"pb"
    assert tputrain.write_atomically(str(tmp_path / "a.gin"), "x = 1\n") == str(tmp_path / "a.gin")
    assert (tmp_path / "a.gin").read_text() == "x = 1\n"


def test_a_write_that_must_not_overwrite_keeps_a_file_that_appears_at_its_last_step(tmp_path,
                                                                                     monkeypatch):
    """`overwrite=False` (the first writer's file stands: a plan record, an export): another
    writer's file that appears between this writer's check and its last step is kept, and
    this writer gets FileExistsError and leaves no temp."""
    target = tmp_path / "record.json"

    def the_other_writer_first(call):
        def wrapped(source, destination, *args, **kwargs):
            if os.fspath(destination) == str(target):
                target.write_text("first")
            return call(source, destination, *args, **kwargs)
        return wrapped

    for name in ("rename", "link", "replace"):
        monkeypatch.setattr(os, name, the_other_writer_first(getattr(os, name)))
    with pytest.raises(FileExistsError):
        with tputrain.atomic_path(str(target), overwrite=False) as temp:
            with open(temp, "w") as f:
                f.write("second")
    assert target.read_text() == "first" and os.listdir(tmp_path) == [target.name]


def test_a_temp_is_left_by_a_dead_writer_only_when_its_process_on_this_host_is_gone():
    """What a later writer may remove: a killed writer's temps (write_tfrecords' shards,
    an export's folder), never a running one's or another host's."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    mine = atomic.temp_path("/data/train-00000-of-00001.tfrecord", hidden=True)
    killed = mine.replace(f"-{os.getpid()}-", f"-{int(dead.stdout)}-")
    host = socket.gethostname().replace("/", "_")
    elsewhere = killed.replace(f".tmp-{host}-", ".tmp-another-host-")
    assert atomic.left_by_dead_writer(killed)
    assert not atomic.left_by_dead_writer(mine) and not atomic.left_by_dead_writer(elsewhere)
    assert not atomic.left_by_dead_writer("/data/train-00000-of-00001.tfrecord")
