"""`tputrain audit-precision`'s bad input: one line and exit 2, since its exit 1 means
"a metric moved" (tputrain/cli/audit_precision.py; the audit itself: precision/test_audit.py)."""

import subprocess
import sys

import pytest

from faults import child_env


def _refusal(capsys, **flags) -> str:
    """`check_flags(**flags)`'s one line; it must exit 2."""
    from tputrain.cli.audit_precision import check_flags

    arguments = {"policy": None, "checkpoint": None, "output": None, **flags}
    with pytest.raises(SystemExit) as caught:
        check_flags(**arguments)
    error = capsys.readouterr().err
    assert caught.value.code == 2 and error.count("\n") == 1, error
    assert error.startswith("tputrain: error: "), error
    return error


def test_an_unknown_policy_is_one_line_naming_the_choices(capsys):
    """It was a 34-line traceback (ValueError) and exit 1, after building the model."""
    error = _refusal(capsys, policy="mixed_bfloat17")
    assert "--policy='mixed_bfloat17'" in error and "mixed_bfloat16" in error


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    """It was a traceback (NotFoundError) and exit 1."""
    error = _refusal(capsys, checkpoint=str(tmp_path / "nonexistent"))
    assert f"--checkpoint={tmp_path / 'nonexistent'}" in error
    error = _refusal(capsys, checkpoint=str(tmp_path))  # a folder with no checkpoint
    assert f"no checkpoint in {tmp_path}" in error


def test_an_output_in_a_missing_folder_is_refused_before_the_audit(tmp_path, capsys):
    """The whole audit ran, then a traceback (NotFoundError) and exit 1."""
    error = _refusal(capsys, output=str(tmp_path / "nodir" / "r.json"))
    assert f"--output={tmp_path / 'nodir' / 'r.json'}" in error and "does not exist" in error


def test_good_flags_pass(tmp_path):
    from tputrain.cli.audit_precision import check_flags

    check_flags(policy="mixed_float16", checkpoint=None, output=str(tmp_path / "r.json"))


def test_an_error_inside_the_audit_is_one_line_and_exit_2(tmp_path):
    """A bad binding the flags cannot see (the policy bound in gin) raised from the audit:
    a traceback and exit 1, this command's code for "a metric moved"."""
    result = subprocess.run(
        [sys.executable, "-m", "tputrain.cli", "audit-precision", "--gin_file=digits.gin",
         "--gin_param=audit_precision.policy='mixed_bfloat17'"],
        capture_output=True, text=True, env=child_env(), timeout=300, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("tputrain: error:")]
    assert len(errors) == 1 and "mixed_bfloat17" in errors[0], result.stderr[-3000:]
