"""Goodput: the account arithmetic on hand-made records, the record a Trainer keeps,
and a digits run killed with SIGKILL and resumed (tputrain/observe/goodput.py)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

import tputrain
from events import scalar_points
from faults import Process, child_env
from tiny import TinyTask, strategy_for
from tputrain.observe import goodput


def record(run: int, start: float, updated: float, *, restored: int, last: int,
           startup: float = 2.0, seconds: dict | None = None, rate: float | None = 0.01,
           finished: bool = False, checkpoint: int | None = None) -> dict:
    """A run record as GoodputAction writes it (times in epoch seconds)."""
    buckets = dict.fromkeys(goodput.RUN_BUCKETS, 0.0)
    buckets.update(seconds or {})
    return {"version": 1, "run": run, "host": "elsewhere", "pid": 1, "start": start,
            "updated": updated, "finished": finished,
            "startup": {"import": startup / 2, "strategy": 0.0, "data": startup / 4,
                        "model": startup / 4},
            "seconds": buckets, "restored_step": restored, "last_step": last,
            "steps_trained": last - restored, "last_checkpoint_step": checkpoint,
            "seconds_per_step": rate}


def test_one_run_fractions_add_up_with_other():
    result = goodput.account_of([record(1, 1000.0, 1010.0, restored=0, last=500, finished=True,
                                        seconds={"compile": 1.0, "steps": 5.0, "input": 0.5,
                                                 "eval": 0.5, "checkpoint": 0.25})])
    assert result["wall"] == pytest.approx(10.0)
    assert result["seconds"]["startup"] == pytest.approx(2.0)
    assert result["seconds"]["other"] == pytest.approx(10.0 - 2.0 - 1.0 - 5.0 - 0.5 - 0.5 - 0.25)
    assert sum(result["fractions"].values()) == pytest.approx(1.0)
    assert result["goodput"] == pytest.approx(0.5)
    assert result["recomputed_steps"] == 0 and result["runs"][0]["status"] == "finished"


def test_a_restart_recomputes_the_steps_after_the_checkpoint_it_restored():
    killed = record(1, 1000.0, 1020.0, restored=0, last=350, checkpoint=200, rate=0.02,
                    seconds={"compile": 3.0, "steps": 7.0})
    resumed = record(2, 1023.0, 1043.0, restored=200, last=600, startup=4.0, finished=True,
                     checkpoint=600, seconds={"compile": 2.0, "steps": 8.0, "checkpoint": 1.0})
    result = goodput.account_of([killed, resumed], "/jobs/a")
    first, second = result["runs"]
    assert first["status"] == "stopped" and second["status"] == "finished"
    assert second["recomputed_steps"] == 150 and result["recomputed_steps"] == 150
    assert second["recomputed_seconds"] == pytest.approx(150 * 0.02)
    assert second["down"] == pytest.approx(3.0)
    totals = result["seconds"]
    assert totals["recomputed"] == pytest.approx(3.0)
    assert totals["steps"] == pytest.approx(7.0 + 8.0 - 3.0)  # lost work is not goodput
    assert totals["startup"] == pytest.approx(2.0) and totals["restart"] == pytest.approx(4.0)
    assert result["wall"] == pytest.approx(20.0 + 3.0 + 20.0)
    assert sum(result["fractions"].values()) == pytest.approx(1.0)
    assert totals["other"] == pytest.approx(43.0 - sum(v for k, v in totals.items()
                                                      if k != "other"))


def test_recomputed_time_is_capped_by_the_step_time_of_the_lost_run():
    killed = record(1, 0.0, 10.0, restored=100, last=150, rate=1.0, seconds={"steps": 2.0})
    resumed = record(2, 10.0, 20.0, restored=0, last=200, finished=True)  # restored older
    result = goodput.account_of([killed, resumed])
    assert result["recomputed_steps"] == 150
    assert result["seconds"]["recomputed"] == pytest.approx(2.0)
    assert result["seconds"]["steps"] == pytest.approx(0.0)


def loop_record(fallback: float | None = None) -> goodput.RunRecord:
    return goodput.RunRecord(None, goodput.StartupClock(), 0, 1, fallback)


def run_loop(rec: goodput.RunRecord, step: int, steps: int, seconds: float, **logs) -> None:
    rec.loop_started(steps, seconds)
    rec.loop_done(step, logs)


def test_compile_is_the_first_loop_beyond_its_steps_at_the_steady_rate():
    rec = loop_record()
    run_loop(rec, 10, 10, 5.0, **{"input/stall_fraction": 0.1})
    assert rec.data["seconds"]["compile"] == pytest.approx(4.5)  # no rate yet: all of it
    run_loop(rec, 20, 10, 1.0, **{"input/stall_fraction": 0.2, "comm/allreduce_fraction": 0.3})
    seconds = rec.data["seconds"]
    assert seconds["input"] == pytest.approx(0.5 + 0.2)
    assert seconds["communication"] == pytest.approx(0.3)
    assert rec.data["seconds_per_step"] == pytest.approx(0.05)  # 0.5 s of work / 10 steps
    assert seconds["compile"] == pytest.approx(4.5 - 10 * 0.05)
    assert seconds["steps"] == pytest.approx(0.5 + 10 * 0.05)
    assert rec.data["steps_trained"] == 20 and rec.data["last_step"] == 20


def test_the_record_keeps_the_process_cpu_seconds_at_train_begin_and_first_loop_end(monkeypatch):
    clock = iter([3.0, 7.5, 9.0])  # CPU seconds since the process started
    monkeypatch.setattr(goodput.time, "process_time", lambda: next(clock))
    rec = loop_record()
    assert rec.data["cpu"] == {"train_begin": 3.0, "first_loop_end": None}
    run_loop(rec, 10, 10, 5.0)
    run_loop(rec, 20, 10, 1.0)  # a later loop changes nothing
    assert rec.data["cpu"] == {"train_begin": 3.0, "first_loop_end": 7.5}


def test_one_loop_uses_the_previous_runs_rate():
    rec = loop_record(fallback=0.1)
    run_loop(rec, 10, 10, 3.0)
    assert rec.data["seconds"]["compile"] == pytest.approx(2.0)
    assert rec.data["seconds"]["steps"] == pytest.approx(1.0)


def test_format_lists_every_bucket_and_totals_100_percent(tmp_path):
    (tmp_path / "goodput").mkdir()
    killed = record(1, 1000.0, 1020.0, restored=0, last=350, checkpoint=200,
                    seconds={"steps": 7.0})
    resumed = record(2, 1023.0, 1043.0, restored=200, last=600, finished=True,
                     seconds={"steps": 8.0})
    for rec in (killed, resumed):
        (tmp_path / "goodput" / f"run-{rec['run']}.json").write_text(json.dumps(rec))
    (tmp_path / "goodput" / "run-3.json").write_text("{not json")  # skipped with a warning
    (tmp_path / "goodput" / "run-4.json").write_text("{}")  # as is a record of another kind
    result = goodput.account(str(tmp_path))
    assert [run["run"] for run in result["runs"]] == [1, 2]
    text = goodput.format_account(result)
    for bucket in goodput.BUCKETS:
        assert re.search(rf"^{bucket} +[0-9.]+ +[0-9.]+%", text, re.M), text
    assert re.search(r"^total +43\.00 +100\.0%", text, re.M), text
    assert "150 step(s) recomputed" in text
    assert "no goodput records" in goodput.format_account(goodput.account(str(tmp_path / "x")))


def test_a_pause_between_a_finished_run_and_the_next_is_between_runs_not_down():
    # A person continues a finished run 622 s later: not down time, and outside the wall.
    finished = record(1, 1000.0, 1010.0, restored=0, last=500, finished=True,
                      seconds={"steps": 5.0})
    resumed = record(2, 1632.0, 1642.0, restored=500, last=1000, finished=True,
                     seconds={"steps": 5.0})
    result = goodput.account_of([finished, resumed])
    assert result["seconds"]["down"] == 0.0 and result["runs"][1]["down"] == 0.0
    assert result["between_runs"] == pytest.approx(622.0)
    assert result["runs"][1]["between_runs"] == pytest.approx(622.0)
    assert result["wall"] == pytest.approx(20.0) and result["goodput"] == pytest.approx(0.5)
    assert sum(result["fractions"].values()) == pytest.approx(1.0)
    assert "between runs 622s (not counted)" in goodput.summary_line(result)
    assert re.search(r"^between runs +622\.00 +not counted", goodput.format_account(result),
                     re.M), goodput.format_account(result)
    # The same gap after a run that did not end cleanly (killed, crashed, preempted): down.
    killed = dict(finished, finished=False)
    result = goodput.account_of([killed, resumed])
    assert result["seconds"]["down"] == pytest.approx(622.0) and result["between_runs"] == 0.0
    assert result["wall"] == pytest.approx(642.0)


def test_no_bucket_is_negative_when_the_flop_count_runs_inside_the_first_xla_loop(
        tmp_path, monkeypatch):
    # With XLA, the plan of steps per program reads the ideal step time while the first
    # loop is built, so the deferred FLOP count (start-up `actions`) ran inside the loop's
    # stopwatch: counted twice, `other` went negative.
    from tputrain.actions import mfu

    counted = mfu.count_flops_per_step

    def slow_count(context):
        time.sleep(0.5)  # a count made slow on purpose: its time must be counted once
        return counted(context)
    monkeypatch.setattr(mfu, "count_flops_per_step", slow_count)
    make(tmp_path, report_mfu=True, jit_compile=True).train()
    rec = goodput.read_records(str(tmp_path / "run"))[0]
    assert rec["startup"]["actions"] >= 0.5
    result = goodput.account(str(tmp_path / "run"))
    assert {bucket: v for bucket, v in result["seconds"].items() if v < 0} == {}
    assert min(result["fractions"].values()) >= 0.0
    assert sum(result["fractions"].values()) == pytest.approx(1.0)


EXEC_SCRIPT = """
import json, sys
import tputrain
from tputrain import process_start
print(json.dumps(process_start.vouched()))
"""


def test_a_shells_work_before_it_execs_python_is_not_start_up(tmp_path):
    # `sh -c 'pip install ... && exec tputrain ...'`: the Python process inherits the
    # shell's PID and so its start time; the shell's work must not count as `import`.
    marks = tmp_path / "marks"
    busy = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"
    script = (f"date +%s.%N >> {marks}; {busy}; date +%s.%N >> {marks}; "
              f"exec {sys.executable} -c '{EXEC_SCRIPT}'")
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                          env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shell_start, shell_done = map(float, marks.read_text().split())
    vouched = json.loads(done.stdout.strip().splitlines()[-1])
    assert vouched["start"] >= shell_done  # start-up is counted from after the exec
    assert vouched["source"] == "import of tputrain"
    # The time before it is reported apart, and holds the shell's work.
    assert vouched["before"] >= shell_done - shell_start > 0
    assert vouched["process_start"] <= shell_start


def goodput_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tputrain.run", "goodput", *args],
                          capture_output=True, text=True, env=child_env(), timeout=300)


def test_the_goodput_command_prints_the_account_and_fails_without_records(tmp_path):
    (tmp_path / "goodput").mkdir()
    (tmp_path / "goodput" / "run-1.json").write_text(json.dumps(
        record(1, 1000.0, 1010.0, restored=0, last=500, finished=True, seconds={"steps": 5.0})))
    result = goodput_cli(f"--model_dir={tmp_path}", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    printed = json.loads(result.stdout)
    assert printed["goodput"] == pytest.approx(0.5) and len(printed["runs"]) == 1
    empty = goodput_cli(f"--model_dir={tmp_path / 'none'}")
    assert empty.returncode == 2 and "no goodput records" in empty.stderr


def test_process_start_is_before_now_and_after_boot():
    start, source = goodput.process_start_time()
    assert source == "/proc" and time.time() - 3600 * 24 * 30 < start <= time.time()


def make(tmp_path, **kwargs):
    options = dict(train_steps=12, steps_per_loop=3, global_batch_size=16, checkpoint_every=6,
                   eval_every=6, eval_steps=2, report_mfu=False)
    options.update(kwargs)
    return tputrain.Trainer(TinyTask(), str(tmp_path / "run"), strategy=strategy_for(1),
                            **options)


def scalar_tags(logdir) -> set[str]:
    return set(scalar_points(logdir))


def test_a_trainer_keeps_a_record_per_process_and_tensorboard_scalars(tmp_path):
    trainer = make(tmp_path)
    trainer.train(num_steps=6)
    trainer.train()  # the same process: the same record, resumed
    records = goodput.read_records(str(tmp_path / "run"))
    assert len(records) == 1
    rec = records[0]
    assert rec["finished"] and rec["restored_step"] == 0 and rec["last_step"] == 12
    assert rec["steps_trained"] == 12 and rec["last_checkpoint_step"] == 12
    assert set(rec["startup"]) == {"import", "strategy", "data", "model", "restore", "actions"}
    assert rec["seconds"]["compile"] > 0 and rec["seconds"]["steps"] > 0
    assert rec["seconds"]["eval"] > 0 and rec["seconds"]["checkpoint"] > 0
    assert {"goodput/steps", "goodput/compile", "goodput/other",
            "goodput/recomputed_steps"} <= scalar_tags(tmp_path / "run" / "train")

    again = make(tmp_path, train_steps=18)  # a restart: the next record
    again.train()
    result = goodput.account(str(tmp_path / "run"))
    assert [run["run"] for run in result["runs"]] == [1, 2]
    assert result["runs"][1]["restored_step"] == 12 and result["recomputed_steps"] == 0
    assert result["runs"][1]["startup_phases"]["import"] == 0.0  # not the process's first
    assert sum(result["fractions"].values()) == pytest.approx(1.0)


def test_the_export_at_the_end_is_its_own_bucket_not_other(tmp_path):
    # The Export action runs after the last loop's hooks: its seconds (a SavedModel
    # written, about a second on a small model) were left in `other`.
    trainer = make(tmp_path, actions=[tputrain.Export()])
    trainer.train()
    rec = goodput.read_records(str(tmp_path / "run"))[0]
    assert rec["seconds"]["export"] > 0
    result = goodput.account(str(tmp_path / "run"))
    assert result["seconds"]["export"] == pytest.approx(rec["seconds"]["export"])
    assert sum(result["fractions"].values()) == pytest.approx(1.0)
    assert "goodput/export" in scalar_tags(tmp_path / "run" / "train")
    assert re.search(r"^export +[0-9.]+ ", goodput.format_account(result), re.M)


def test_the_deferred_flop_count_is_start_up_not_other(tmp_path, monkeypatch):
    # The MFU action counts FLOPs (and probes the CPU's peak) after the first loop,
    # off the path to the first step: that is set-up, the start-up's `actions` phase.
    from tputrain.actions import mfu

    counted = mfu.count_flops_per_step

    def slow_count(context):
        time.sleep(0.5)  # a count made slow on purpose: its time must be accounted
        return counted(context)
    monkeypatch.setattr(mfu, "count_flops_per_step", slow_count)
    make(tmp_path, report_mfu=True).train()
    rec = goodput.read_records(str(tmp_path / "run"))[0]
    assert rec["startup"]["actions"] >= 0.5


# ------------------------------------------------------------ end to end


DIGITS = ["--gin_file=digits.gin", "--gin_import=faults", "--gin_param=Trainer.train_steps=400",
          "--gin_param=Trainer.steps_per_loop=25", "--gin_param=Trainer.steps_per_fetch=25",
          "--gin_param=Trainer.checkpoint_every=100", "--gin_param=Trainer.eval_every=None"]


@pytest.mark.slow
def test_digits_killed_and_resumed_accounts_the_recomputed_steps(tmp_path):
    command = [sys.executable, "-m", "tputrain.run", f"--model_dir={tmp_path / 'model'}", *DIGITS]
    env = {**child_env(), "TPUTRAIN_CACHE_DIR": str(tmp_path / "cache")}
    started = time.monotonic()
    killed = Process([*command, "--gin_param=Trainer.actions=[@PauseAtStep()]",
                      "--gin_param=PauseAtStep.step=275"], env)
    paused = int(killed.wait_for(r"tputrain-test: paused at step (\d+)").group(1))
    assert killed.kill() == -signal.SIGKILL
    saved = [int(s) for s in re.findall(r"saved checkpoint \S+ckpt-(\d+)", killed.text())]
    resumed = Process([*command, "--gin_param=Trainer.actions=[]"], env)  # the config's: none
    # The job's wall time: to the resumed run's last line. The interpreter's teardown after
    # its exit handlers (TensorFlow's final garbage collection, 1-3 s) is outside the account.
    resumed.wait_for(r"tputrain: done at step 400")
    wall = time.monotonic() - started
    assert resumed.finish() == 0, resumed.log()

    result = goodput.account(str(tmp_path / "model"))
    first, second = result["runs"]
    assert (first["status"], second["status"]) == ("stopped", "finished")
    assert first["last_step"] == paused and second["restored_step"] == saved[-1]
    assert result["recomputed_steps"] == paused - saved[-1] > 0
    for run in (first, second):  # both runs' start-up, by phase
        assert run["startup"] > 0 and run["startup_phases"]["import"] > 0
        assert {"strategy", "data", "model", "restore"} <= set(run["startup_phases"])
    assert result["seconds"]["restart"] == pytest.approx(second["startup"])
    named = sum(v for bucket, v in result["seconds"].items() if bucket != "other")
    assert abs(named - wall) <= 0.05 * wall, (named, wall, goodput.format_account(result))
    assert "tputrain: goodput" in resumed.text()
    printed = goodput_cli(f"--model_dir={tmp_path / 'model'}")
    assert printed.returncode == 0, printed.stderr[-3000:]
    assert f"{paused - saved[-1]} step(s) recomputed" in printed.stdout
    assert re.search(r"^total +[0-9.]+ +100\.0%", printed.stdout, re.M), printed.stdout


def test_the_closing_line_says_why_a_run_too_short_for_a_rate_has_no_goodput():
    # One loop: no steady rate prices the steps, so it all counts as compile.
    short = record(1, 1000.0, 1010.0, restored=0, last=100, finished=True, rate=None,
                   seconds={"compile": 6.0})
    line = goodput.summary_line(goodput.account_of([short]))
    assert "goodput 0.0%" not in line and "no loop after the first" in line, line
    assert " down " not in line and "restart" not in line, line  # zero shares left out
    assert "startup 20.0%" in line and "compile 60.0%" in line, line
    long = record(1, 1000.0, 1010.0, restored=0, last=500, finished=True,
                  seconds={"compile": 1.0, "steps": 5.0})
    assert goodput.summary_line(goodput.account_of([long])).startswith("goodput 50.0% of 10.0s")


def test_nested_timed_work_counts_once_and_no_bucket_goes_negative(monkeypatch):
    """The plan trial (compile) runs inside the first loop, and the MFU action's FLOP
    count inside the trial: its seconds counted for both made the loop's own time
    negative (a run's goodput line read "input -10%"). Each second counts once: the
    inner work in its bucket, the trial its own 5 s, the loop the 2 s left."""
    now = [100.0]
    monkeypatch.setattr(goodput.time, "perf_counter", lambda: now[0])
    rec = loop_record()
    rec.add_timed("actions", 102.0, 105.0)  # the FLOP count, inside the trial
    rec.add_timed("compile", 101.0, 109.0)  # the trial, inside the loop
    now[0] = 110.0
    run_loop(rec, 10, 10, 10.0, **{"input/stall_fraction": 0.5})
    assert rec.data["startup"]["actions"] == pytest.approx(3.0)
    assert rec.data["plan_trial"] == pytest.approx(5.0)
    seconds = rec.data["seconds"]
    assert min(seconds.values()) >= 0.0, seconds
    assert seconds["input"] == pytest.approx(2.0)  # the stall, within the loop's own 2 s
    assert seconds["compile"] == pytest.approx(5.0)


def test_a_rerun_whose_checkpoints_are_gone_says_it_starts_over(tmp_path, caplog):
    """The checkpoints folder deleted (or moved) after a run saved up to step 20: the
    rerun trained from step 0 without a word. Its earlier run records say what was
    saved, so the rerun warns, naming the step and the folder, and trains on."""
    make(tmp_path, train_steps=20).train()
    import shutil
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    with caplog.at_level("WARNING"):
        rerun = make(tmp_path, train_steps=20)
        rerun.train()
    said = [r.getMessage() for r in caplog.records if "starts from step 0" in r.getMessage()]
    assert len(said) == 1 and "step 20" in said[0] and "checkpoints" in said[0], said
    assert int(rerun.step.numpy()) == 20


def test_a_damaged_latest_record_is_kept_and_the_next_run_takes_a_free_number(tmp_path):
    """A damaged run-1.json was overwritten by the next run's record (numbered after the
    last readable one): the damaged file stays for a look, the next run is run-2."""
    make(tmp_path, train_steps=6).train()
    damaged = tmp_path / "run" / "goodput" / "run-1.json"
    damaged.write_bytes(damaged.read_bytes().replace(b'"', b"X", 1))
    kept = damaged.read_bytes()
    make(tmp_path, train_steps=12).train()
    assert damaged.read_bytes() == kept
    assert [r["run"] for r in goodput.read_records(str(tmp_path / "run"))] == [2]


def test_an_async_save_that_never_landed_is_not_in_the_record(tmp_path, monkeypatch, caplog):
    """An async save killed before its background write landed left the record saying
    `last_checkpoint_step` with no checkpoint on disk: the rerun warned, falsely, that
    the checkpoints folder was deleted or moved. A step is recorded once committed."""
    from tputrain.checkpointing.async_writer import AsyncWriter

    monkeypatch.setattr(AsyncWriter, "_write", lambda self, *args: None)  # never lands
    make(tmp_path, train_steps=6, checkpoint=tputrain.CheckpointOptions(async_save=True)).train()
    [first] = goodput.read_records(str(tmp_path / "run"))
    assert first["last_step"] == 6 and first["last_checkpoint_step"] is None
    monkeypatch.undo()
    with caplog.at_level("WARNING"):
        rerun = make(tmp_path, train_steps=6, checkpoint=tputrain.CheckpointOptions(async_save=True))
        rerun.train()
    assert not [r for r in caplog.records if "starts from step 0" in r.getMessage()]
    rerun.close()
    latest = goodput.read_records(str(tmp_path / "run"))[-1]
    assert latest["last_checkpoint_step"] == 6
