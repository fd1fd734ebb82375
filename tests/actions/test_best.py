"""BestCheckpoint and EarlyStopping: what they keep, when they stop, and that a run
killed with SIGKILL and resumed ends with the same best checkpoint and stop step."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from file_events import (CONFIG, assert_same_outcome, event_child, kill_states, model_variables,
                         run_outcome)
from tiny import TinyTask, strategy_for
from tputrain.actions.best import Watch, write_json
from tputrain.actions.early_stopping import early_stopping_path
from tputrain.checkpointing.run_directory import ModelDirError


class Evals(tputrain.Action):
    """Records each evaluation's logs and the weights evaluated, and the hooks' order."""

    def __init__(self):
        self.evals, self.weights, self.calls = {}, {}, []

    def on_eval_end(self, trainer, step, logs):
        self.evals[step] = dict(logs)
        self.weights[step] = [np.asarray(w) for w in trainer.model.get_weights()]
        self.calls.append(("eval", step))

    def on_save(self, trainer, step, path):
        self.calls.append(("save", step))

    def on_train_end(self, trainer, step, logs):
        self.calls.append(("end", step))


def make(model_dir, actions, **kwargs):
    options = dict(train_steps=12, steps_per_loop=2, global_batch_size=16, eval_every=2,
                   eval_steps=2, checkpoint_every=4, keep_checkpoints=1, report_mfu=False)
    options.update(kwargs)
    return tputrain.Trainer(TinyTask(dropout=0.3), str(model_dir), strategy=strategy_for(1),
                            actions=actions, **options)


# ------------------------------------------------------------ the metric


def test_watch_compares_by_mode_and_min_delta_and_never_takes_nan():
    assert Watch("X", "eval/accuracy", "max").key == "accuracy"
    high = Watch("X", "accuracy", "max", min_delta=0.1)
    assert high.improved(0.5, None) and high.improved(0.71, 0.6) and not high.improved(0.65, 0.6)
    low = Watch("X", "loss", "min")
    assert low.improved(0.4, 0.5) and not low.improved(0.5, 0.5)
    assert not low.improved(float("nan"), None) and not low.improved(float("inf"), 1.0)
    with pytest.raises(ValueError, match="mode must be 'max' or 'min'"):
        Watch("X", "loss", "down")
    with pytest.raises(ValueError, match="min_delta"):
        Watch("X", "loss", "min", min_delta=-1)
    with pytest.raises(ValueError, match=r"'top5' is not an eval metric.*\['accuracy', 'loss'\]"):
        Watch("X", "top5", "max").value({"loss": 1.0, "accuracy": 0.5})
    with pytest.raises(ValueError, match="patience must be >= 1"):
        tputrain.EarlyStopping(patience=0)


# ------------------------------------------------------------ best checkpoint


def test_best_checkpoint_keeps_the_best_eval_outside_the_rotation(tmp_path):
    """Evals at 2, 6, 10 fall between checkpoints (every 4, keep 1): the best is saved
    at its own step and survives the rotation, with the weights that were evaluated."""
    evals = Evals()
    best = tputrain.BestCheckpoint("eval/loss", "min")
    make(tmp_path / "run", [evals, best]).train()
    losses = {step: logs["loss"] for step, logs in evals.evals.items()}
    assert sorted(losses) == [2, 4, 6, 8, 10, 12]
    expected = min(losses, key=lambda step: (losses[step], step))
    record = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert (record["step"], record["value"]) == (expected, losses[expected])
    assert (best.step, best.value) == (expected, losses[expected])
    kept = model_variables(str(tmp_path / "run" / "best" / f"ckpt-{expected}"))
    saved = sorted(kept.values(), key=lambda a: (a.shape, a.sum()))
    evaluated = sorted(evals.weights[expected], key=lambda a: (a.shape, a.sum()))
    for a, b in zip(saved, evaluated):
        np.testing.assert_array_equal(a, b)
    assert sorted(p.name for p in (tmp_path / "run" / "best").iterdir() if p.name.startswith(
        "ckpt-")) == [f"ckpt-{expected}.data-00000-of-00001", f"ckpt-{expected}.index"]


def test_best_checkpoint_resumes_comparing_against_the_kept_best(tmp_path):
    first = tputrain.BestCheckpoint("accuracy", "max")
    make(tmp_path / "run", [first], train_steps=4).train()
    second = tputrain.BestCheckpoint("accuracy", "max")
    make(tmp_path / "run", [second], train_steps=8).train()
    assert second.value >= first.value
    record = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert (record["step"], record["value"]) == (second.step, second.value)


# ------------------------------------------------------------ early stopping


def never_improves_after_the_first(patience: int) -> tputrain.EarlyStopping:
    """Accuracy never rises by more than 1.0: the first eval is the best, then patience runs out."""
    return tputrain.EarlyStopping("accuracy", "max", patience=patience, min_delta=1.0)


def test_early_stopping_stops_saves_and_ends_once(tmp_path):
    evals = Evals()
    trainer = make(tmp_path / "run", [never_improves_after_the_first(2), evals],
                   train_steps=100)
    final = trainer.train()
    assert trainer.current_step == 6
    # No second evaluation at the stop step; the run still saves and ends normally.
    assert evals.calls == [("eval", 2), ("eval", 4), ("save", 4), ("eval", 6), ("save", 6),
                           ("end", 6)]
    assert final == evals.evals[6]
    record = json.loads(open(early_stopping_path(str(tmp_path / "run"))).read())
    assert sorted(map(int, record["evals"])) == [2, 4, 6]

    again = Evals()  # a rerun stays stopped: no step, one evaluation
    rerun = make(tmp_path / "run", [never_improves_after_the_first(2), again], train_steps=100)
    rerun.train()
    assert rerun.current_step == 6 and again.calls == [("save", 6), ("eval", 6), ("end", 6)]

    more = make(tmp_path / "run", [never_improves_after_the_first(4)], train_steps=100)
    more.train()  # more patience: training goes on from the same record
    assert more.current_step == 10


def test_early_stopping_resumes_from_the_evals_up_to_the_restored_step(tmp_path):
    reference = make(tmp_path / "reference", [never_improves_after_the_first(3)],
                     train_steps=100)
    reference.train()
    assert reference.current_step == 8

    make(tmp_path / "run", [never_improves_after_the_first(3)], train_steps=100).train(
        num_steps=4)
    path = early_stopping_path(str(tmp_path / "run"))
    record = json.loads(open(path).read())
    # As if killed after an eval at step 5 whose checkpoint never got written.
    record["evals"]["5"] = 0.0
    del record["checksum"]
    write_json(path, record)
    resumed = make(tmp_path / "run", [never_improves_after_the_first(3)], train_steps=100)
    resumed.train()
    assert resumed.current_step == reference.current_step == 8


# ------------------------------------------------------------ a lost or damaged best


def stopped_with_a_best(model_dir, keep: int) -> tuple[dict, list[tputrain.Action]]:
    """A run that stopped early with its best (accuracy) kept at an earlier step than
    the stop (the rerun evaluates the stop step again); returns best.json and the
    actions for the rerun."""
    def actions():
        return [tputrain.BestCheckpoint("accuracy", "max"),
                tputrain.EarlyStopping("accuracy", "max", patience=2), tputrain.Export()]

    trainer = make(model_dir, actions(), keep_checkpoints=keep, train_steps=40)
    trainer.train()
    record = json.loads((model_dir / "best" / "best.json").read_text())
    assert record["step"] < trainer.current_step < 40, (record, trainer.current_step)
    return record, actions()


def damage(model_dir, record: dict, what: str) -> None:
    prefix = model_dir / "best" / record["checkpoint"]
    if what == "index lost":
        os.remove(f"{prefix}.index")
    else:  # bit rot in the middle of the data file
        data = bytearray(open(f"{prefix}.data-00000-of-00001", "rb").read())
        for i in range(len(data) // 3, len(data) // 3 + 64):
            data[i] ^= 0xFF
        open(f"{prefix}.data-00000-of-00001", "wb").write(bytes(data))


@pytest.mark.parametrize("what", ["index lost", "data damaged"])
def test_a_lost_or_damaged_best_is_copied_again_from_its_checkpoint(tmp_path, what):
    """Issue 50.1: the rerun deleted the rest of the best, took the stop step (a worse
    accuracy) for the best, exported it and exited 0. The best's step is still in
    checkpoints/: it is copied again, and the best and the export are unchanged."""
    model_dir = tmp_path / "run"
    record, actions = stopped_with_a_best(model_dir, keep=10)
    step = record["step"]
    assert (model_dir / "checkpoints" / f"ckpt-{step}.index").exists()
    damage(model_dir, record, what)
    make(model_dir, actions, keep_checkpoints=10, train_steps=40).train()
    assert actions[0].step == step and actions[0].value == record["value"]
    assert json.loads((model_dir / "best" / "best.json").read_text()) == record
    for suffix in (".index", ".data-00000-of-00001"):
        assert (model_dir / "best" / f"ckpt-{step}{suffix}").read_bytes() == \
            (model_dir / "checkpoints" / f"ckpt-{step}{suffix}").read_bytes(), suffix
    assert sorted(p.name for p in (model_dir / "export").iterdir()) == [str(step)]


@pytest.mark.parametrize("what", ["index lost", "data damaged"])
def test_a_lost_or_damaged_best_without_its_checkpoint_stops_the_run(tmp_path, what):
    """Issue 50.1 with the best's step rotated out of checkpoints/: one line naming what
    is missing, before anything is written; best/ is left as it was."""
    model_dir = tmp_path / "run"
    record, actions = stopped_with_a_best(model_dir, keep=1)
    step = record["step"]
    assert not (model_dir / "checkpoints" / f"ckpt-{step}.index").exists()
    damage(model_dir, record, what)
    before = sorted(p.name for p in (model_dir / "best").iterdir())
    with pytest.raises(ModelDirError) as raised:
        make(model_dir, actions, keep_checkpoints=1, train_steps=40)
    message = str(raised.value).split("\n  In call to configurable")[0]  # gin's addition
    assert "\n" not in message and f"ckpt-{step}" in message and "checkpoints" in message, \
        message
    assert ("missing" if what == "index lost" else "damaged") in message, message
    assert json.loads((model_dir / "best" / "best.json").read_text()) == record
    assert sorted(p.name for p in (model_dir / "best").iterdir()) == before
    assert sorted(p.name for p in (model_dir / "export").iterdir()) == [str(step)]


def one_line(error: BaseException) -> str:
    message = str(error).split("\n  In call to configurable")[0]  # gin's addition
    assert "\n" not in message, message
    return message


def listing(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("intact, damaged", [('"mode"', '"mode'), ('"max"', '"mbx"'),
                                             ('"max"', '"min"'), ('"value": ', '"value": 1')])
def test_a_damaged_best_record_stops_the_run_and_keeps_the_best(tmp_path, intact, damaged):
    """One damaged byte in best.json was taken for no record: the rerun started the best
    over, overwrote best.json, deleted the true best and exported a worse step (exit 0).
    It now stops before anything is written, naming the record and the fix; best/ and
    export/ are left as they were."""
    model_dir = tmp_path / "run"
    record, actions = stopped_with_a_best(model_dir, keep=10)
    path = model_dir / "best" / "best.json"
    assert intact in path.read_text()
    path.write_text(path.read_text().replace(intact, damaged, 1))
    before = listing(model_dir / "best")
    with pytest.raises(ModelDirError) as raised:
        make(model_dir, actions, keep_checkpoints=10, train_steps=40)
    message = one_line(raised.value)
    assert str(path) in message and "damaged" in message and "delete" in message, message
    assert listing(model_dir / "best") == before
    assert sorted(p.name for p in (model_dir / "export").iterdir()) == [str(record["step"])]
    with pytest.raises(ModelDirError, match="best.json"):
        actions[0].repair(make_context(model_dir, actions))


def make_context(model_dir, actions):
    """An action context of a Trainer on `model_dir` built without its actions (whose
    pre-flight would stop it), for calling one action's hook directly."""
    return make(model_dir, [], keep_checkpoints=10, train_steps=40).context


@pytest.mark.parametrize("intact, damaged", [('"', "X"), ('": 0.', '": 1.')])
def test_a_damaged_early_stopping_record_stops_the_run_before_training(tmp_path, intact,
                                                                      damaged):
    """One damaged byte in early_stopping.json was taken for no record: an early-stopped
    run trained on to train_steps and exported another step. It now stops before the
    first step, naming the record and the fix; so does damage that leaves valid JSON
    (a value's digit: the record's checksum no longer matches)."""
    model_dir = tmp_path / "run"
    trainer = make(model_dir, [never_improves_after_the_first(2)], train_steps=100)
    trainer.train()
    assert trainer.current_step == 6
    path = model_dir / "checkpoints" / "early_stopping.json"
    assert intact in path.read_text()
    path.write_text(path.read_text().replace(intact, damaged, 1))
    checkpoints = sorted(p.name for p in (model_dir / "checkpoints").iterdir())
    with pytest.raises(ModelDirError) as raised:
        make(model_dir, [never_improves_after_the_first(2)], train_steps=100).train()
    message = one_line(raised.value)
    assert str(path) in message and "damaged" in message and "delete" in message, message
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == checkpoints


# ------------------------------------------------------------ kill -9 and resume

ACTIONS = "Trainer.actions = [@BestCheckpoint(), @EarlyStopping()"


def child(config, model_dir, pause_at: int | None = None, pausable: bool = False):
    """A CLI run; `pause_at`: it pauses after that step's loop (`pausable`: until told
    on its stdin, `copy_at_pause`; else until killed)."""
    from faults import Process, child_env, pausable_env

    actions = ACTIONS + (", @PauseAtStep()]" if pause_at else "]")
    extra = [f"--gin_param=PauseAtStep.step={pause_at}"] if pause_at else []
    env = pausable_env(child_env(cpus=2)) if pausable else child_env(cpus=2)
    return Process([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                    f"--gin_file={config}", f"--gin_param={actions}", *extra,
                    f"--model_dir={model_dir}", "--deterministic"], env, stdin=pausable)


def kill_at(config, model_dir, step: int) -> None:
    process = child(config, model_dir, pause_at=step)
    process.wait_for(r"tputrain-test: paused at step")
    assert process.kill() == -signal.SIGKILL


@pytest.mark.slow
def test_sigkill_and_resume_keep_the_same_best_and_stop_step(tmp_path):
    config = tmp_path / "stop.gin"
    config.write_text(CONFIG)
    from faults import copy_at_pause

    # The uninterrupted run pauses after step 22 (the best so far kept at step 20, before
    # the next): "run" is its model_dir as a SIGKILL there leaves it.
    reference = child(config, tmp_path / "reference", pause_at=22, pausable=True)
    run = tmp_path / "run"
    copy_at_pause(reference, tmp_path / "reference", run, r"tputrain-test: paused at step")
    kill_at(config, run, 32)  # two non-improving evals counted (24, 28), the last save at 30
    resumed = child(config, run)
    assert resumed.finish() == 0, resumed.log()
    assert reference.finish() == 0, reference.log()
    assert "restored" in resumed.text() and "training from step 30 " in resumed.text(), \
        resumed.log()

    def outcome(model_dir):
        stop = json.loads((model_dir / "checkpoints" / "early_stopping.json").read_text())
        best = json.loads((model_dir / "best" / "best.json").read_text())
        return stop, best, tf.train.latest_checkpoint(str(model_dir / "checkpoints"))

    expected, actual = outcome(tmp_path / "reference"), outcome(run)
    # The reference really stopped early, after non-improving evals the kill cut across.
    assert expected[2].endswith("ckpt-32") and "early stopping at step 32" in reference.text()
    assert expected[0] == actual[0] and expected[1] == actual[1]
    assert actual[2].endswith("ckpt-32") and "early stopping at step 32" in resumed.text()
    step = expected[1]["step"]
    reference_best = model_variables(str(tmp_path / "reference" / "best" / f"ckpt-{step}"))
    resumed_best = model_variables(str(run / "best" / f"ckpt-{step}"))
    assert reference_best.keys() == resumed_best.keys()
    for key in reference_best:
        np.testing.assert_array_equal(resumed_best[key], reference_best[key], err_msg=key)


# ------------------------------------------------------------ kill at every file event

# The file events of one new best after an earlier one: the checkpoint of the step,
# the copy into best/, the commit (best.json), the previous best's files deleted,
# then early_stopping.json's record of the same evaluation.
BEST_WINDOW = [r"save checkpoints/ckpt-(\d+)", r"copy best/ckpt-{S}\.data-00000-of-00001",
               r"copy best/ckpt-{S}\.index", r"rename best/best\.json",
               r"remove best/ckpt-\d+\.index", r"remove best/ckpt-\d+\.data-00000-of-00001",
               r"rename checkpoints/early_stopping\.json"]


@pytest.fixture(scope="module")
def best_reference(tmp_path_factory):
    """The uninterrupted run, its file events, and the folder of its model_dir as a
    kill before each event leaves it (`<n>-0`; a copy cut in half: `<n>-1`): one run
    paused at every event (file_events.kill_states), not a run killed per event."""
    from faults import file_events

    directory = tmp_path_factory.mktemp("best_reference")
    config = directory / "stop.gin"
    config.write_text(CONFIG)
    code, text = kill_states(config, directory / "model", directory / "killed")
    assert code == 0, text[-3000:]
    return config, directory / "model", file_events(text), text, directory / "killed"


def best_window(events: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """BEST_WINDOW's events around the second best kept (the first had no previous)."""
    starts = [i for i, (_, what) in enumerate(events)
              if re.fullmatch(BEST_WINDOW[0], what) and i + 1 < len(events)
              and events[i + 1][1].startswith("copy best/")]
    assert len(starts) >= 2, events
    start = starts[1]
    step = re.fullmatch(BEST_WINDOW[0], events[start][1]).group(1)
    window = events[start:start + len(BEST_WINDOW)]
    for (_, what), pattern in zip(window, BEST_WINDOW):
        assert re.fullmatch(pattern.replace("{S}", step), what), (what, pattern, events)
    return window


@pytest.mark.same_worker("best_reference")
@pytest.mark.slow
@pytest.mark.parametrize("offset, torn", [(i, False) for i in range(len(BEST_WINDOW))]
                         + [(1, True)])
def test_a_kill_at_any_file_event_of_a_new_best_ends_as_the_uninterrupted_run(
        best_reference, tmp_path, offset, torn):
    """Issue 33.3: killed before each file event of keeping a new best (and with the
    copy into best/ cut in half), the rerun ends with the uninterrupted run's best step,
    early-stopping record, stop step, export and weights (it resumed at the best's
    step without its evaluation recorded, stopped later and exported another step)."""
    config, reference, events, reference_text, killed = best_reference
    number, what = best_window(events)[offset]
    model_dir = tmp_path / "model"
    shutil.copytree(killed / f"{number}-{int(torn)}", model_dir, symlinks=True)
    rerun = event_child(config, model_dir)
    assert rerun.finish(timeout=900) == 0, rerun.log()
    stop = re.search(r"early stopping at step (\d+)", reference_text).group(1)
    assert f"early stopping at step {stop}" in rerun.text(), rerun.log()
    assert_same_outcome(run_outcome(model_dir), run_outcome(reference),
                        f"killed before event {number} ({what}, torn={torn})")


_FULL_DISK_DRIVER = """
import os, shutil, subprocess, sys
from pathlib import Path

model_dir, fifo, event, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
command = sys.argv[5:]
env = dict(os.environ, TPUTRAIN_TEST_EVENTS="1", TPUTRAIN_TEST_PAUSE_AT=event,
           TPUTRAIN_TEST_FIFO=fifo)
first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
lines = []
for line in first.stdout:
    lines.append(line)
    if "tputrain-test: paused before file event " in line:  # the one pause, at `event`
        filler = model_dir.parent / "filler"  # someone else's file takes the last bytes
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\\0" * 4096)
                    f.flush()
            except OSError:
                pass
        with open(fifo, "w") as f:
            f.write("go\\n")
lines += first.stdout.readlines()
print("FIRST", first.wait(), flush=True)
print("".join(lines[-12:]), flush=True)
print("BEST FILES", sorted(p.name for p in (model_dir / "best").iterdir()), flush=True)
os.remove(model_dir.parent / "filler")  # room again; nothing of tputrain's deleted
env.pop("TPUTRAIN_TEST_PAUSE_AT")
rerun = subprocess.run(command, env=env, capture_output=True, text=True)
print("RERUN", rerun.returncode, flush=True)
print(rerun.stdout[-3000:], rerun.stderr[-3000:], flush=True)
shutil.copytree(model_dir, out)
"""


@pytest.mark.same_worker("best_reference")
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for private mounts")
def test_a_best_copy_that_runs_out_of_room_is_cleaned_and_the_rerun_continues(
        best_reference, tmp_path):
    """Issue 33.3 on a real full disk (a private tmpfs): the copy into best/ fails for
    want of room; it leaves no partial file and stops with ModelDirError, and once
    there is room again the rerun ends as the uninterrupted run (it left a truncated
    best/ckpt-*.data, and every rerun said 'model_dir is full' until it was deleted)."""
    from faults import child_env

    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -rm is not permitted here: {probe.stderr.decode().strip()}")
    config, reference, events, _, _ = best_reference
    # By name: the number of the first copy varies with the goodput record's timed writes.
    copies = [shlex.quote(what) for n, what in events if what.startswith("copy best/")]
    disk, fifo = tmp_path / "disk", tmp_path / "fifo"
    disk.mkdir()
    os.mkfifo(fifo)
    driver = tmp_path / "driver.py"
    driver.write_text(_FULL_DISK_DRIVER)
    command = [sys.executable, "-m", "tputrain.run", "--gin_import=faults",
               f"--gin_file={config}", "--gin_param=Trainer.actions = [@BestCheckpoint(), "
               "@EarlyStopping(), @Export()]", f"--model_dir={disk}/model", "--deterministic"]
    shell = (f"mount -t tmpfs -o size=64m tmpfs {disk} && exec {sys.executable} {driver} "
             f"{disk}/model {fifo} {copies[0]} {tmp_path}/out " + " ".join(
                 shlex.quote(c) for c in command))
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True,
                            text=True, env=child_env(cpus=2), timeout=1800)
    text = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, text
    assert "FIRST 1" in text, text
    assert "ran out of room" in text and "Traceback" not in text, text
    assert re.search(r"BEST FILES \['best\.json'\]|BEST FILES \[\]", text), text
    assert "RERUN 0" in text, text
    assert_same_outcome(run_outcome(tmp_path / "out"), run_outcome(reference), "full disk")
