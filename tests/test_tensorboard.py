"""What a real TensorBoard server (its default, fast-loading view) shows of a run: every
eval step after a rerun and an `eval --step` of an earlier checkpoint, the operative
config as text, and the run's hparams with its eval metrics (tputrain.observe.eval_events,
tputrain.actions.config_summary)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import gin
import pytest

import tputrain
from faults import TINY_GIN
from tiny import TinyTask, strategy_for
from tputrain.jobs.sidecar import ReadOnlyTrainer, evaluate_checkpoints

EVAL_STEPS = [2, 4, 6, 8]


def _cli(*args: str) -> subprocess.CompletedProcess:
    from faults import child_env

    done = subprocess.run([sys.executable, "-m", "tputrain.cli", *args], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _train_in_python(model_dir) -> None:
    """A run from Python without gin, then an evaluation of an earlier checkpoint."""
    gin.clear_config()
    options = dict(train_steps=8, steps_per_loop=2, global_batch_size=16, eval_every=2,
                   eval_steps=2, checkpoint_every=2, keep_checkpoints=10, report_mfu=False)
    tputrain.Trainer(TinyTask(), str(model_dir), strategy=strategy_for(1), **options).train()
    reader = ReadOnlyTrainer(TinyTask(), str(model_dir), strategy=strategy_for(1), **options)
    assert list(evaluate_checkpoints(reader, step=2)) == [2]


class TensorBoard:
    """`tensorboard --logdir=DIR` on 127.0.0.1 (a free port), with its defaults."""

    def __init__(self, logdir):
        from faults import Process, child_env

        self.process = Process([sys.executable, "-m", "tensorboard.main", f"--logdir={logdir}",
                                "--host=127.0.0.1", "--port=0"], child_env())
        self.url = self.process.wait_for(r"TensorBoard \S+ at (http://\S+?)/? ").group(1)

    def get(self, path: str, **query: str):
        url = f"{self.url}{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict):
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def loaded(self, run: str, tag: str, tries: int = 300):
        """The run's points of `tag` once the server has read them: it reads all of a
        run's event files before it shows any of its points."""
        for _ in range(tries):
            if run in self.get("/data/runs"):
                points = self.get("/data/plugin/scalars/scalars", run=run, tag=tag)
                if points:
                    return points
            time.sleep(0.1)  # poll interval of a bounded retry
        raise AssertionError(f"TensorBoard showed no {run}/{tag} after {tries} polls:\n"
                             f"{self.process.log()}")

    def close(self) -> None:
        self.process.kill()


def _session_groups(board) -> tuple[list[dict], dict[str, dict]]:
    """The HParams dashboard's session groups, and each by its run's folder name."""
    groups = board.post("/data/plugin/hparams/session_groups", {
        "experimentName": "", "startIndex": 0, "sliceSize": 100, "colParams": [],
        "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                            "STATUS_RUNNING"]})["sessionGroups"]
    return groups, {session["name"].rsplit("/", 1)[-1]: group
                    for group in groups for session in group["sessions"]}


@pytest.mark.slow  # three CLI processes and a TensorBoard server
def test_tensorboard_shows_every_eval_step_and_the_configuration(tmp_path):
    logdir = tmp_path / "sweep"
    config = tmp_path / "tiny.gin"
    config.write_text(TINY_GIN)
    common = ["--gin_import=faults", f"--gin_file={config}", f"--model_dir={logdir / 'cli'}"]
    _cli("run", *common)
    _cli("run", *common)  # a rerun of the finished run: evaluates step 8 again
    printed = json.loads(_cli("eval", *common, "--step=4").stdout.strip().splitlines()[-1])
    assert printed["step"] == 4
    _train_in_python(logdir / "py")

    board = TensorBoard(logdir)
    try:
        for run in ("cli", "py"):
            points = board.loaded(f"{run}/eval", "accuracy")
            assert [step for _, step, _ in points] == EVAL_STEPS, (run, points)
            assert [step for _, step, _ in board.loaded(f"{run}/eval", "loss")] == EVAL_STEPS
            text = board.get("/data/plugin/text/text", run=run, tag="operative_config")
            assert "Trainer.train_steps = 8" in text[-1]["text"], text
        assert "FaultTask.dropout = 0.0" in board.get(
            "/data/plugin/text/text", run="cli", tag="operative_config")[-1]["text"]
        experiment = board.post("/data/plugin/hparams/experiment", {"experimentName": ""})
        assert {"group": "eval", "tag": "accuracy"} in [m["name"]
                                                        for m in experiment["metricInfos"]]
        groups, sessions = _session_groups(board)
        assert sorted(sessions) == ["cli", "py"], groups
        accuracy = {run: board.loaded(f"{run}/eval", "accuracy")[-1] for run in sessions}
        for run, group in sessions.items():
            assert group["hparams"]["Trainer.train_steps"] == 8
            assert group["hparams"]["Trainer.eval_every"] == 2
            # The eval metric (train/ has an `accuracy` too: every scalar is a metric).
            value = {(m["name"]["group"], m["name"]["tag"]): m
                     for m in group["metricValues"]}[("eval", "accuracy")]
            assert (value["trainingStep"], value["value"]) == tuple(accuracy[run][1:]), run
    finally:
        board.close()


class TopOneTask(TinyTask):
    """Another task: its own metric, evaluated on two named eval sets."""

    def build_metrics(self):
        import keras

        return [keras.metrics.SparseTopKCategoricalAccuracy(k=1, name="top1")]


def _two_tasks(logdir) -> None:
    """Two model_dirs under one folder: a gin-configured FaultTask with the default eval
    set, and a TopOneTask with two named eval sets and other options."""
    from faults import FaultTask

    options = dict(steps_per_loop=2, global_batch_size=16, eval_every=2, eval_steps=2,
                   report_mfu=False)
    gin.clear_config()
    gin.bind_parameter("FaultTask.dropout", 0.0)
    tputrain.Trainer(FaultTask(), str(logdir / "fault"), strategy=strategy_for(1),
                     train_steps=4, **options).train()
    gin.clear_config()
    tputrain.Trainer(TopOneTask(), str(logdir / "topone"), strategy=strategy_for(1),
                     train_steps=6, eval_splits=("validation", "test"), **options).train()


@pytest.mark.slow  # two runs and a TensorBoard server
def test_hparams_over_a_parent_logdir_show_every_runs_hparams_and_metrics(tmp_path):
    logdir = tmp_path / "sweep"
    _two_tasks(logdir)
    board = TensorBoard(logdir)
    try:
        board.loaded("topone/eval/test", "top1")  # every run read
        board.loaded("fault/eval", "accuracy")
        experiment = board.post("/data/plugin/hparams/experiment", {"experimentName": ""})
        names = {info["name"] for info in experiment["hparamInfos"]}
        assert {"FaultTask.dropout", "Trainer.train_steps", "Trainer.eval_every"} <= names
        metrics = [m["name"] for m in experiment["metricInfos"]]
        for group, tag in [("eval", "accuracy"), ("eval", "loss"), ("eval/validation", "top1"),
                           ("eval/test", "top1"), ("eval/test", "loss")]:
            assert {"group": group, "tag": tag} in metrics, (group, tag, metrics)
        groups, sessions = _session_groups(board)
        assert sorted(sessions) == ["fault", "topone"], groups
        assert sessions["fault"]["hparams"]["FaultTask.dropout"] == 0.0
        assert sessions["fault"]["hparams"]["Trainer.train_steps"] == 4
        assert sessions["topone"]["hparams"]["Trainer.train_steps"] == 6
        values = {run: {(m["name"]["group"], m["name"]["tag"]): m["value"]
                        for m in group["metricValues"]} for run, group in sessions.items()}
        accuracy = board.loaded("fault/eval", "accuracy")[-1][2]
        assert values["fault"][("eval", "accuracy")] == pytest.approx(accuracy)
        top1 = board.loaded("topone/eval/validation", "top1")[-1][2]
        assert values["topone"][("eval/validation", "top1")] == pytest.approx(top1)
        assert ("eval/test", "loss") in values["topone"]
    finally:
        board.close()
