"""The study `tputrain tune` keeps (tputrain/tuning/study.py)."""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest

from tputrain.tuning.spec import parse_spec

optuna = pytest.importorskip("optuna", reason="the tune extra: pip install 'tputrain[tune]'")

SPEC = {"metric": "accuracy", "goal": "maximize", "trials": 6,
        "params": {"build_optimizer.learning_rate": {"min": 1e-4, "max": 0.3, "scale": "log"},
                   "DigitsTask.dropout": {"min": 0.0, "max": 0.6}}}


def _asked(study, spec) -> tuple:
    from tputrain.tuning.study import suggest

    trial = study.ask()
    values = tuple(suggest(trial, param) for param in spec.params)
    study.tell(trial, 0.5)
    return values


def test_a_continued_study_does_not_propose_the_points_it_already_tried(tmp_path):
    """A study killed and run again opens its sampler anew: seeded as the first run was,
    it proposed the first run's points again (trials 3-5 repeated 0-2's params)."""
    from tputrain.tuning.study import open_study

    spec = parse_spec(SPEC)
    first = [_asked(open_study(spec, str(tmp_path)), spec) for _ in range(3)]
    again = [_asked(open_study(spec, str(tmp_path)), spec) for _ in range(3)]
    assert not set(first) & set(again), (first, again)
    fresh = [_asked(open_study(spec, str(tmp_path / "other")), spec) for _ in range(3)]
    assert fresh[0] == first[0]  # the spec's seed still fixes a new study's first point


def test_a_trial_at_the_completed_trials_last_step_has_finished_and_is_not_pruned(tmp_path):
    """The median pruner judged a trial's last report too: one that trained to the end
    but below the median was told PRUNED at step 400, as if stopped early."""
    from tputrain.tuning.study import final_step, open_study

    study = open_study(parse_spec(SPEC), str(tmp_path))
    assert final_step(study) is None
    for value in (0.9, 0.8):
        trial = study.ask()
        for step in (100, 200):
            trial.report(value, step)
        study.tell(trial, value)
    assert final_step(study) == 200


DIGITS = ["--gin_file=digits.gin", "--gin_param=Trainer.eval_every=100",
          "--gin_param=Trainer.checkpoint_every=100", "--gin_param=Trainer.actions=[]"]
LEARNING_RATE = {"min": 1e-3, "max": 0.05, "scale": "log"}


def _one_trial(binding: str) -> dict:
    return {"metric": "accuracy", "goal": "maximize", "trials": 1, "pruner": "none",
            "params": {binding: LEARNING_RATE}}


@pytest.mark.slow
def test_a_trial_refused_for_its_config_does_not_use_up_the_trials(tmp_path):
    """A typo refused (exit 2) was told FAIL and counted: fixed and rerun, the study
    had its trials already and ran none ("no trial completed")."""
    from tputrain.tuning.study import StudyRunner, TrialConfigError

    run_args = [*DIGITS, "--gin_param=Trainer.train_steps=100"]
    with pytest.raises(TrialConfigError, match="learnin_rate") as refused:
        StudyRunner(parse_spec(_one_trial("build_optimizer.learnin_rate")), str(tmp_path),
                    run_args).run()
    study = StudyRunner(parse_spec(_one_trial("build_optimizer.learning_rate")), str(tmp_path),
                        run_args).run()
    assert [t.state.name for t in study.trials] == ["FAIL", "COMPLETE"]
    assert str(refused.value).startswith(  # the trial's own error line, without its prefix
        "trial 0 refused its config: build_optimizer: the 'adam' optimizer takes no argument "
        "'learnin_rate'")
    assert "not counted toward the study's trials" in str(refused.value)
    assert "learnin_rate" in study.trials[0].user_attrs["refused"]
    assert max(study.trials[1].intermediate_values) == 100


@pytest.mark.slow
def test_a_preempted_trial_is_left_to_the_rerun_which_resumes_it(tmp_path, monkeypatch):
    """A trial stopped by SIGTERM while the tuner lived (it saved and exited 42, "rerun
    to resume") was told FAIL and never resumed: the tuner now stops, leaving it to the
    rerun, which resumes it from its checkpoint under its number."""
    from faults import child_env, wait_for_file_line
    from tputrain.tuning.study import StudyRunner, StudyStopped

    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])  # the trials import faults
    spec = parse_spec(_one_trial("build_optimizer.learning_rate"))
    run_args = [*DIGITS, "--gin_param=Trainer.train_steps=200", "--gin_import=faults",
                "--gin_param=Trainer.steps_per_loop=10"]  # stops at 110, before its end
    paused = [*run_args, "--gin_param=Trainer.actions=[@PauseAtStep()]",
              "--gin_param=PauseAtStep.step=100"]
    runner = StudyRunner(spec, str(tmp_path), paused)

    def preempt() -> None:
        wait_for_file_line(tmp_path / "trial-0.log", r"tputrain-test: paused at step")
        os.kill(int((tmp_path / "trial-0.pid").read_text()), signal.SIGTERM)

    threading.Thread(target=preempt, daemon=True).start()
    with pytest.raises(StudyStopped, match="trial 0 was preempted.*rerun the same command"):
        runner.run()
    assert [t.state.name for t in runner.study.trials] == ["RUNNING"]

    study = StudyRunner(spec, str(tmp_path), run_args).run()
    assert [t.state.name for t in study.trials] == ["COMPLETE"]
    assert sorted(study.trials[0].intermediate_values) == [100, 200]
    assert re.search(r"restored .*ckpt-110 ", (tmp_path / "trial-0.log").read_text())
