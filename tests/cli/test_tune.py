"""`tputrain tune` end to end: a study of digits.gin, killed mid-study and continued."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from faults import Process, child_env

optuna = pytest.importorskip("optuna", reason="the tune extra: pip install 'tputrain[tune]'")

SPEC = """\
metric: accuracy
goal: maximize
trials: 6
parallel: 2
params:
  build_optimizer.learning_rate: {min: 1.0e-4, max: 0.3, scale: log}
  DigitsTask.dropout: {min: 0.0, max: 0.6}
"""
DIGITS = ["--gin_file=digits.gin", "--gin_param=Trainer.train_steps=400",
          "--gin_param=Trainer.eval_every=100", "--gin_param=Trainer.checkpoint_every=100",
          "--gin_param=Trainer.actions=[]"]


def _tune(tmp_path, *args):
    (tmp_path / "spec.yaml").write_text(SPEC)
    return [sys.executable, "-m", "tputrain.cli", "tune", f"--spec={tmp_path / 'spec.yaml'}",
            f"--study_dir={tmp_path / 'study'}", *DIGITS, *args]


def _env(tmp_path):
    return dict(child_env(), TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"))


@pytest.mark.slow
def test_a_bad_spec_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "spec.yaml").write_text("metric: accuracy\nparams: {lr: {min: 0, max: 1}}\n")
    result = subprocess.run([sys.executable, "-m", "tputrain.cli", "tune",
                             f"--spec={tmp_path / 'spec.yaml'}", "--gin_file=digits.gin",
                             f"--study_dir={tmp_path / 'study'}"], capture_output=True,
                            text=True, env=_env(tmp_path), timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "tputrain: error: params: 'lr' is not a gin binding (write Configurable.parameter, "
        "e.g. build_optimizer.learning_rate)"]
    assert not (tmp_path / "study").exists()


@pytest.mark.slow
def test_a_study_killed_midway_continues_and_its_best_trial_reproduces(tmp_path):
    """Acceptance 4: 6 trials with pruning; killed mid-study and rerun, every trial runs
    once; the best trial's bindings alone give its metric."""
    first = Process(_tune(tmp_path), _env(tmp_path))
    first.wait_for(r"tputrain tune: trial 2 started", timeout=900)
    assert first.kill(signal.SIGKILL) == -signal.SIGKILL
    second = subprocess.run(_tune(tmp_path), capture_output=True, text=True,
                            env=_env(tmp_path), timeout=1500)
    assert second.returncode == 0, second.stderr[-3000:] + second.stdout[-3000:]

    study = optuna.load_study(study_name="tputrain",
                              storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}")
    assert [t.number for t in study.trials] == list(range(6))
    assert {t.state.name for t in study.trials} <= {"COMPLETE", "PRUNED"}
    for trial in study.trials:
        last = max(trial.intermediate_values)
        assert last == 400 if trial.state.name == "COMPLETE" else last < 400
    table = second.stdout[second.stdout.index("trial  state"):]
    assert len(table.splitlines()) >= 7 and "best trial" in table
    best = study.best_trial
    bindings = re.findall(r"^(\S+ = \S+)$", table.split("its bindings:")[1], re.M)
    assert len(bindings) == 2

    alone = subprocess.run([sys.executable, "-m", "tputrain.run", *DIGITS,
                            *(f"--gin_param={b}" for b in bindings),
                            f"--model_dir={tmp_path / 'alone'}"], capture_output=True,
                           text=True, timeout=600,
                           env=dict(_env(tmp_path), TPUTRAIN_TUNE_METRIC="accuracy",
                                    CLOUD_ML_HP_METRIC_FILE=str(tmp_path / "alone.metrics")))
    assert alone.returncode == 0, alone.stderr[-3000:]
    from tputrain.tuning.report import read_report
    assert read_report(str(tmp_path / "alone.metrics"), "accuracy")[400] == pytest.approx(
        best.value, abs=1e-6)


def test_tune_help_lists_only_the_flags_tune_takes():
    """Each trial has its own model_dir under --study_dir: --model_dir is no tune flag."""
    from tputrain.cli import help_text, main
    for text in (main.render_help("tune"), help_text.HELP["tune"]):
        assert "--study_dir" in text and "--gin_file" in text
        assert "--model_dir" not in text


def test_tune_with_model_dir_is_one_line_naming_study_dir(capsys):
    from tputrain.cli import tune
    with pytest.raises(SystemExit) as stop:
        tune.refuse_model_dir(["tputrain tune", "--spec=s.yaml", "--model_dir=/tmp/x"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "tputrain: error: each trial has its own model_dir under --study_dir: pass "
        "--study_dir, not --model_dir"]
    tune.refuse_model_dir(["tputrain tune", "--spec=s.yaml", "--study_dir=/tmp/s"])


@pytest.mark.slow
def test_ctrl_c_stops_the_study_in_one_line_and_exit_42_leaving_its_trial_to_resume(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) ended the tuner in a bare
    KeyboardInterrupt traceback; as `tputrain run`, it is one line and exit 42."""
    from faults import wait_for_file_line

    command = [*_tune(tmp_path), "--gin_import=faults",
               "--gin_param=Trainer.actions=[@PauseAtStep()]", "--gin_param=PauseAtStep.step=100"]
    command = [arg for arg in command if arg != "--gin_param=Trainer.actions=[]"]
    # (after _tune's spec) one trial, at once
    (tmp_path / "spec.yaml").write_text(SPEC.replace("trials: 6", "trials: 1"))
    tuner = subprocess.Popen(command, env=_env(tmp_path), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_file_line(tmp_path / "study" / "trial-0.log", r"tputrain-test: paused at step")
        os.killpg(tuner.pid, signal.SIGINT)
        out, err = tuner.communicate(timeout=300)
    finally:
        tuner.kill()
    assert tuner.returncode == 42, out[-2000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "tputrain tune: stopped (SIGINT): rerun the same command to resume trial 0 (exit code 42)")
    study = optuna.load_study(study_name="tputrain",
                              storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["RUNNING"]
