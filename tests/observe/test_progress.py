"""Tests for tputrain/observe/progress.py: the per-loop rates, MFU by the one formula."""

import pytest
import tensorflow as tf

from tputrain.observe import flops, progress
from tputrain.observe.progress import Progress


def test_mfu_is_reported_only_with_flops_and_a_peak():
    p = Progress(None, train_steps=100, global_batch_size=32)
    rates = p.train_loop_done(step=10, steps=10, seconds=2.0, logs={"loss": 1.0}, input_wait=0.5)
    assert rates["steps_per_second"] == pytest.approx(5.0)
    assert rates["examples_per_second"] == pytest.approx(160.0)
    assert rates["input/stall_fraction"] == pytest.approx(0.25)
    assert "mfu" not in rates
    p.set_flops(flops_per_step=2e9, peak_flops=40e9)
    rates = p.train_loop_done(step=20, steps=10, seconds=1.0, logs={"loss": 1.0})
    assert rates["mfu"] == pytest.approx(flops.model_flops_utilization(2e9, 10.0, 40e9)) == 0.5


def test_progress_uses_the_flops_formula(monkeypatch):
    """One formula: a change to tputrain.observe.flops.model_flops_utilization reaches the log."""
    calls = []

    def recording(flops_per_step, steps_per_second, peak):
        calls.append((flops_per_step, steps_per_second, peak))
        return 0.125

    monkeypatch.setattr(progress, "model_flops_utilization", recording)
    p = Progress(None, train_steps=100, global_batch_size=8)
    p.set_flops(3e9, 60e9)
    assert p.train_loop_done(step=4, steps=4, seconds=2.0, logs={})["mfu"] == 0.125
    assert calls == [(3e9, 2.0, 60e9)]


def test_vertex_tensorboard_dir_gets_the_events(tmp_path, monkeypatch):
    """On Vertex AI ($AIP_TENSORBOARD_LOG_DIR set) train/ and eval/ events go there,
    where the job's TensorBoard integration uploads from; checkpoints stay in model_dir."""
    import tensorflow as tf

    import tputrain
    from tiny import TinyTask, strategy_for

    monkeypatch.setenv("AIP_TENSORBOARD_LOG_DIR", str(tmp_path / "logs"))
    trainer = tputrain.Trainer(TinyTask(), str(tmp_path / "model"), strategy=strategy_for(1),
                               train_steps=4, steps_per_loop=2, global_batch_size=16,
                               eval_steps=1, report_mfu=False)
    trainer.train()
    for split in ("train", "eval"):
        assert tf.io.gfile.glob(str(tmp_path / "logs" / split / "events.*")), split
        assert not (tmp_path / "model" / split).exists()
    assert trainer.checkpointer.latest.startswith(str(tmp_path / "model" / "checkpoints"))


def test_scalars_are_what_tensorboard_reads_as_scalars(tmp_path):
    """The events carry TensorBoard's scalar plugin data: its reader lists each tag
    under "scalars" with the step and value written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    p = Progress(str(tmp_path), train_steps=100, global_batch_size=8)
    p.write_scalars("train", 3, {"loss": 0.25, "input/stall_fraction": 0.5})
    p.write_scalars("train", 6, {"loss": 0.125, "input/stall_fraction": 0.0})
    p.close()
    events = EventAccumulator(str(tmp_path / "train"), size_guidance={"tensors": 0})
    events.Reload()
    assert sorted(events.Tags()["tensors"]) == ["input/stall_fraction", "loss"]
    loss = [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors("loss")]
    assert loss == [(3, 0.25), (6, 0.125)]
    plugin = events.SummaryMetadata("loss").plugin_data.plugin_name
    assert plugin == "scalars"


@pytest.mark.slow
def test_train_num_steps_beyond_train_steps_reports_its_own_target(tmp_path, caplog):
    """`train(num_steps=N)` past `train_steps` (fine-tuning more, benchmarks): the
    progress line counts to the run's own end, and the ETA is never negative."""
    import logging

    import tputrain
    from tiny import TinyTask, strategy_for

    trainer = tputrain.Trainer(TinyTask(), str(tmp_path), strategy=strategy_for(1),
                               train_steps=2, steps_per_loop=2, global_batch_size=16,
                               eval_steps=1, report_mfu=False)
    trainer.train()
    with caplog.at_level(logging.INFO):
        trainer.train(num_steps=4)
    steps = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("tputrain: step ")]
    assert [line.split(" | ")[0] for line in steps] == ["tputrain: step 4/6",
                                                        "tputrain: step 6/6"]
    assert all("ETA -" not in line for line in steps), steps
    assert steps[-1].endswith("ETA 0s")


def test_eta_is_never_negative(caplog):
    import logging

    p = Progress(None, train_steps=10, global_batch_size=8)
    with caplog.at_level(logging.INFO):
        p.train_loop_done(step=12, steps=2, seconds=1.0, logs={})  # past the target
    assert caplog.records[-1].getMessage().endswith("ETA 0s")


def test_scalars_of_any_number_type_and_none_at_all(tmp_path):
    """NaN, inf, ints, bools and numpy scalars are written as float scalars; an empty
    dict writes nothing and creates no events file."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    p = Progress(str(tmp_path), train_steps=100, global_batch_size=8)
    p.write_scalars("eval", 1, {})
    p.write_scalars("train", 2, {"nan": float("nan"), "inf": float("inf"), "int": 3,
                                 "bool": True, "numpy": np.float64(0.5)})
    p.close()
    assert not (tmp_path / "eval").exists()
    events = EventAccumulator(str(tmp_path / "train"), size_guidance={"tensors": 0})
    events.Reload()
    values = {tag: float(tf.make_ndarray(events.Tensors(tag)[0].tensor_proto))
              for tag in events.Tags()["tensors"]}
    assert values["int"] == 3.0 and values["bool"] == 1.0 and values["numpy"] == 0.5
    assert np.isnan(values["nan"]) and values["inf"] == float("inf")
    assert all(events.Tensors(tag)[0].step == 2 for tag in values)


def test_the_first_loop_says_it_compiles_and_the_next_prices_the_compilation(caplog):
    """The first loop holds tracing and compiling (and the input's start-up): an ETA
    from its rate would mislead, so its line says so before its rates and gives no
    ETA; the next line shows the rest of that loop's time beyond its steps at the
    steady rate as `compile`, and an ETA from then on."""
    import logging

    p = Progress(None, train_steps=30, global_batch_size=8)
    with caplog.at_level(logging.INFO):
        first_rates = p.train_loop_done(step=10, steps=10, seconds=20.0, logs={"loss": 1.0},
                                        input_wait=5.0)
        p.train_loop_done(step=20, steps=10, seconds=1.0, logs={"loss": 0.5}, input_wait=0.01)
    first, second = [r.getMessage() for r in caplog.records]
    assert first == ("tputrain: step 10/30 | loss 1 | with compiling: 4 examples/s | "
                     "0.50 steps/s | input stall 25.0% | ETA next loop")
    assert second == ("tputrain: step 20/30 | loss 0.5 | 80 examples/s | 10.00 steps/s | "
                      "input stall 1.0% | compile 19s | ETA 1s")
    assert first_rates["input/stall_fraction"] == pytest.approx(0.25)  # TensorBoard's


def test_sequence_runs_show_real_tokens_per_second_and_padding_and_mfu_counts_real_tokens(
        caplog):
    """A step logging `real_tokens` and `padding` (Task.loss_denominator): the line
    and TensorBoard show real tokens/s and the padding share, and MFU counts only the
    real tokens' FLOPs."""
    p = Progress(None, train_steps=100, global_batch_size=8)
    p.set_flops(flops_per_step=2e9, peak_flops=40e9)
    with caplog.at_level("INFO"):
        rates = p.train_loop_done(step=10, steps=10, seconds=1.0,
                                  logs={"loss": 1.0, "real_tokens": 300.0, "padding": 0.25})
    assert rates["real_tokens_per_second"] == pytest.approx(3000.0)
    assert rates["mfu"] == pytest.approx(0.5 * 0.75)
    line = caplog.records[-1].getMessage()
    assert "3000 real tokens/s" in line and "padding 25.0%" in line
    assert "real_tokens 300" not in line  # shown as a rate, not a raw log


def test_a_deferred_flops_count_runs_once_when_the_ideal_step_time_is_first_read():
    """The MFU action defers its FLOP count (a trace of the step) off the path to the
    first step; a plan that needs the ideal step time makes it count right then."""
    p = Progress(None, train_steps=100, global_batch_size=8)
    calls = []

    def count():
        calls.append(1)
        p.set_flops(3e9, 60e9)
    p.count_flops_later(count)
    assert calls == []
    assert p.ideal_step_seconds == pytest.approx(3e9 / 60e9)
    assert p.ideal_step_seconds == pytest.approx(3e9 / 60e9)
    p.count_pending_flops()
    assert calls == [1]


def test_a_loop_faster_than_a_measured_peak_raises_the_peak_and_mfu_stays_at_most_1(caplog):
    """A CPU peak probed while other work ran reads low for good; a loop that runs
    more FLOP/s than it shows the peak was higher (MFU above 100% read here)."""
    raised = []
    p = Progress(None, train_steps=100, global_batch_size=8)
    p.set_flops(2e9, peak_flops=10e9, raise_peak=raised.append)
    with caplog.at_level("INFO"):
        rates = p.train_loop_done(step=10, steps=10, seconds=1.0, logs={})  # 20e9 FLOP/s
    assert rates["mfu"] == pytest.approx(1.0)
    assert raised == [pytest.approx(20e9)]
    assert "above the measured peak" in caplog.text
    assert p.train_loop_done(step=20, steps=10, seconds=2.0, logs={})["mfu"] == pytest.approx(0.5)
    assert p.train_loop_done(step=30, steps=10, seconds=1.0, logs={})["mfu"] == pytest.approx(1.0)
    assert len(raised) == 1  # not above the raised peak


def test_a_table_peak_is_never_raised():
    p = Progress(None, train_steps=100, global_batch_size=8)
    p.set_flops(2e9, peak_flops=10e9)  # an accelerator's table peak: a count error shows
    assert p.train_loop_done(step=10, steps=10, seconds=1.0, logs={})["mfu"] == pytest.approx(2.0)


ONE_REPLICA = {"loss": 0.141, "accuracy": 0.9625, "learning_rate": 0.001,
               "comm/gradient_bytes": 0.0, "comm/allreduce_fraction": 0.0}


def step_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("tputrain: step")]


def test_the_line_leaves_out_communication_on_one_replica_and_tensorboard_keeps_it(
        tmp_path, caplog):
    import logging

    from events import scalar_points

    p = Progress(str(tmp_path), train_steps=1200, global_batch_size=64)
    with caplog.at_level(logging.INFO):
        p.train_loop_done(step=100, steps=100, seconds=14.0, logs=dict(ONE_REPLICA))
        p.train_loop_done(step=200, steps=100, seconds=0.5, logs=dict(ONE_REPLICA))
        p.train_loop_done(step=300, steps=100, seconds=0.5,
                          logs={**ONE_REPLICA, "comm/gradient_bytes": 2.0e5,
                                "comm/allreduce_fraction": 0.12})
    p.close()
    first, second, third = step_lines(caplog)
    assert "comm/" not in first and "comm/" not in second, second
    assert "comm/gradient_bytes 2e+05 | comm/allreduce_fraction 0.12" in third
    # One terminal line (with room for a logger's prefix) on one replica, the first too.
    assert max(len(first), len(second)) <= 150, (first, second)
    tags = scalar_points(tmp_path / "train")  # TensorBoard's tags are unchanged
    assert [v for _, v in tags["comm/gradient_bytes"]] == [0.0, 0.0, 2.0e5]
    assert [s for s, _ in tags["comm/allreduce_fraction"]] == [100, 200, 300]


def _stall_advice(caplog, loops, steps_per_fetch: int = 1) -> list[str]:
    """The stall explanations a Progress logs over `loops` of 100 steps, each
    (seconds, input_wait); the first holds compiling."""
    import logging

    progress = Progress(None, train_steps=1000, global_batch_size=64,
                        steps_per_fetch=steps_per_fetch)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for i, (seconds, wait) in enumerate(loops, 1):
            progress.train_loop_done(step=100 * i, steps=100, seconds=seconds, logs={},
                                     input_wait=wait)
    return [r.getMessage() for r in caplog.records if "tputrain diagnose" in r.getMessage()]


def test_an_input_stall_of_fast_steps_is_explained_once_with_the_knob(caplog):
    advice = _stall_advice(caplog, [(10.0, 5.0), (0.1, 0.03), (0.1, 0.04)])
    assert len(advice) == 1, advice  # once, after the first loop (which holds compiling)
    assert "in-memory" in advice[0] and "steps_per_fetch" in advice[0], advice
    # The knob is in use: the input advice instead.
    advice = _stall_advice(caplog, [(10.0, 0.0), (0.1, 0.03)], steps_per_fetch=100)
    assert len(advice) == 1 and "steps_per_fetch" not in advice[0], advice


def test_a_slow_input_gets_the_input_advice_not_the_fetch_knob(caplog):
    advice = _stall_advice(caplog, [(10.0, 0.0), (10.0, 5.0)])
    assert len(advice) == 1 and "steps_per_fetch" not in advice[0], advice


def test_a_quiet_loop_gives_no_advice(caplog):
    assert _stall_advice(caplog, [(10.0, 9.0), (1.0, 0.01)]) == []


class FullDisk:
    """A disk that fills on demand (`full`), deterministic and without root: the
    summary writers (TensorFlow's and the eval run's) raise TensorFlow's no-space
    error as a full local disk does, and the save's room check sees no free bytes."""

    def __init__(self, monkeypatch):
        import shutil

        from tputrain.observe import eval_events

        self.full = False
        disk, real_writer = self, tf.summary.create_file_writer
        real_events, real_usage = eval_events.EventFileWriter, shutil.disk_usage

        class Writer:  # tf.summary's writer: a write fails at its flush or close
            def __init__(self, logdir, *args, **kwargs):
                disk.check(logdir)
                self._writer = real_writer(logdir, *args, **kwargs)
                self.logdir = logdir

            def as_default(self, step=None):
                disk.check(self.logdir)
                return self._writer.as_default(step=step)

            def flush(self):
                disk.check(self.logdir)
                self._writer.flush()

            def close(self):
                disk.check(self.logdir)
                self._writer.close()

        class Events(real_events):  # the eval run's writer: its file's header is a write
            def __init__(self, logdir, *args, **kwargs):
                disk.check(logdir)
                self.logdir = logdir
                super().__init__(logdir, *args, **kwargs)

            def add_event(self, event):
                disk.check(self.logdir)
                super().add_event(event)

        def disk_usage(path):
            usage = real_usage(path)
            return usage._replace(free=0) if disk.full else usage

        monkeypatch.setattr(tf.summary, "create_file_writer", Writer)
        monkeypatch.setattr(eval_events, "EventFileWriter", Events)
        monkeypatch.setattr(shutil, "disk_usage", disk_usage)

    def check(self, path: str) -> None:
        if self.full:
            raise tf.errors.ResourceExhaustedError(
                None, None, f"{path}/events.out.tfevents.1; No space left on device")


def test_a_full_disk_at_a_summary_write_warns_once_and_the_summaries_come_back(
        tmp_path, monkeypatch, caplog):
    """The tryout's 82-line ResourceExhaustedError at the eval sets' summary: summaries
    are diagnostics (a train loop's, the eval sets', goodput's, the close), so each
    write that finds no space is skipped with one warning a run, and once there is room
    again they are written (in a new event file)."""
    import logging

    from events import scalar_points

    disk = FullDisk(monkeypatch)
    p = Progress(str(tmp_path), train_steps=100, global_batch_size=8)
    p.write_scalars("train", 2, {"loss": 1.0})
    disk.full = True
    with caplog.at_level(logging.INFO):
        p.train_loop_done(step=4, steps=2, seconds=1.0, logs={"loss": 0.5})
        p.eval_sets_done(4, {"eval": ({"loss": 0.4}, 2), "test": ({"loss": 0.3}, 2)}, 1.0)
        p.eval_done(4, {"loss": 0.4}, 1.0)
        p.write_scalars("train", 4, {"goodput/goodput": 0.9})  # goodput's scalars
        p.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith("tputrain: TensorBoard summaries are not written: no space "
                                  f"left on {tmp_path}"), warnings
    assert "training goes on" in warnings[0] and "checkpoint" in warnings[0]
    disk.full = False
    p.write_scalars("train", 6, {"loss": 0.25})
    p.eval_sets_done(6, {"eval": ({"loss": 0.375}, 2), "test": ({"loss": 0.125}, 2)}, 1.0)
    p.close()
    # both points written (in two event files, whose order on disk is not the point)
    assert sorted(scalar_points(tmp_path / "train")["loss"]) == [(2, 1.0), (6, 0.25)]
    for name, value in (("eval", 0.375), ("test", 0.125)):
        assert scalar_points(tmp_path / "eval" / name)["loss"] == [(6, value)]


def test_an_error_other_than_a_full_disk_at_a_summary_write_is_raised(tmp_path, monkeypatch):
    """Only a full disk is skipped: another write error is the run's to see."""
    from tputrain.observe import eval_events

    def unwritable(logdir, *args, **kwargs):
        raise tf.errors.PermissionDeniedError(None, None, f"{logdir}: Permission denied")

    monkeypatch.setattr(eval_events, "EventFileWriter", unwritable)
    p = Progress(str(tmp_path), train_steps=100, global_batch_size=8)
    with pytest.raises(tf.errors.PermissionDeniedError):
        p.eval_done(4, {"loss": 0.4}, 1.0)


def test_a_disk_that_fills_between_saves_ends_at_the_next_save_in_one_line_and_resumes_bitwise(
        tmp_path, monkeypatch, capsys, caplog):
    """docs/fault_tolerance.md's "a full disk mid-run loses nothing" when the disk fills
    after a save: the summaries of the next loop and evaluation (eval sets) warn once
    and training goes on; the next save, on a disk still full, is the one-line error
    naming the intact last good checkpoint (exit 1, no traceback); with room again the
    rerun resumes from it and ends bitwise where an uninterrupted run does."""
    import logging

    import numpy as np

    import tputrain
    from tputrain.cli.run import _train
    from tiny import TinyTask, strategy_for, weights

    disk = FullDisk(monkeypatch)

    class FillsAfterSave(tputrain.Action):
        def on_save(self, context, step, path):
            disk.full = step == 4

    def trainer(model_dir, actions=()):
        return tputrain.Trainer(TinyTask(), str(model_dir), strategy=strategy_for(1),
                                train_steps=12, steps_per_loop=2, checkpoint_every=4,
                                eval_every=2, eval_steps=2, eval_splits=("eval", "test"),
                                global_batch_size=16, report_mfu=False, actions=list(actions))

    expected = trainer(tmp_path / "whole")
    expected.train()
    capsys.readouterr()
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as caught:
        _train(trainer(tmp_path / "run", [FillsAfterSave()]))
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if line.startswith("tputrain: error:")]
    assert caught.value.code == 1 and len(lines) == 1 and "Traceback" not in error, error
    assert "not saving step 8" in lines[0] and "ckpt-4 is intact" in lines[0], lines
    summary = [r.getMessage() for r in caplog.records if "TensorBoard summaries" in r.getMessage()]
    assert len(summary) == 1 and "Traceback" not in caplog.text, caplog.text
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.index")) == [
        "ckpt-4.index"]
    disk.full = False
    resumed = trainer(tmp_path / "run")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        resumed.train()
    trained = [r.getMessage().split(" | ")[0] for r in caplog.records
               if r.getMessage().startswith("tputrain: step ")]
    assert trained == ["tputrain: step 6/12", "tputrain: step 8/12", "tputrain: step 10/12",
                       "tputrain: step 12/12"], trained  # from ckpt-4
    for got, want in zip(weights(resumed), weights(expected)):
        np.testing.assert_array_equal(got, want)
