"""`tputrain eval`: what the command says and exits with (the evaluation itself, once or
as a side-car: tests/jobs/test_sidecar.py)."""

import json
import signal
import sys

import pytest

import tputrain
from faults import TINY_GIN
from tiny import strategy_for
from tputrain.jobs.sidecar import RECORD_FILE


@pytest.mark.parametrize("signum, said_as", [(signal.SIGINT, "Ctrl-C"),
                                             (signal.SIGTERM, "SIGTERM")])
def test_ctrl_c_on_a_side_car_is_one_line_and_leaves_its_record_whole(tmp_path, signum,
                                                                       said_as):
    """Ctrl-C on `tputrain eval --continuous` ended in a KeyboardInterrupt traceback, and
    SIGTERM (a side-car job preempted) killed it with no line (-15). Now, as `tputrain
    run`'s: one line saying where the evaluations so far are recorded and to rerun,
    exit 42, and the record holds every step evaluated."""
    from faults import FaultTask, Process, child_env

    config, model_dir = tmp_path / "tiny.gin", tmp_path / "model"
    config.write_text(TINY_GIN)
    tputrain.Trainer(FaultTask(dropout=0.0), str(model_dir), strategy=strategy_for(1),
                     train_steps=4, steps_per_loop=2, global_batch_size=16, checkpoint_every=2,
                     eval_steps=2, report_mfu=False).train()  # a run on its way to step 8
    side_car = Process([sys.executable, "-m", "tputrain.cli", "eval", "--gin_import=faults",
                        f"--gin_file={config}", f"--model_dir={model_dir}", "--continuous",
                        "--poll_seconds=0.1"], child_env())
    side_car.wait_for(r'^\{"step": 4, ')  # evaluated 2 and 4; now waiting for step 6
    side_car.process.send_signal(signum)
    assert side_car.finish() == 42, side_car.log()
    assert "Traceback" not in side_car.log() and "KeyboardInterrupt" not in side_car.log()
    said = [line for line in side_car.lines if "stopped by" in line]
    assert len(said) == 1 and said[0].startswith(f"tputrain: stopped by {said_as}"), \
        side_car.log()
    assert RECORD_FILE in said[0] and "rerun the same command" in said[0], said
    record = json.loads((model_dir / "eval" / RECORD_FILE).read_text())
    assert sorted(map(int, record["evaluated"])) == [2, 4] and record["skipped"] == {}
