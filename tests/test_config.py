"""Gin parsing: every misconfiguration fails before anything is built, with the fix."""

import gin
import pytest

import tputrain  # noqa: F401  (registers the configurables)
from tputrain.config import ConfigError, parse_gin, require_bound


def test_builtin_configs_parse():
    parse_gin(["digits.gin"])
    assert gin.query_parameter("Trainer.global_batch_size") == 64


def test_misspelled_configurable_names_the_nearest():
    with pytest.raises(ConfigError, match=r"No configurable matching 'Traner'.*did you mean 'Trainer'"):
        parse_gin(gin_params=["Traner.train_steps = 3"])


def test_misspelled_parameter_names_the_nearest():
    with pytest.raises(ConfigError, match=r"parameter named 'train_step'.*did you mean 'train_steps'"):
        parse_gin(gin_params=["Trainer.train_step = 3"])


def test_unknown_reference_suggests_registering():
    with pytest.raises(ConfigError, match=r"'@?MyTask.*--gin_import"):
        parse_gin(gin_params=["Trainer.task = @MyTask()"])


def test_missing_file_says_how_to_find_it():
    with pytest.raises(ConfigError, match="--gin_search_path"):
        parse_gin(["no_such_config.gin"])


def test_syntax_error_is_a_config_error():
    with pytest.raises(ConfigError, match="gin could not parse"):
        parse_gin(gin_params=["Trainer.train_steps = [1"])


def test_missing_required_binding():
    parse_gin(gin_params=["Trainer.train_steps = 3"])
    with pytest.raises(ConfigError, match=r"Trainer.task is not bound: add `Trainer.task = ...`"):
        require_bound("Trainer.task")


def test_user_module_import(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(
        "import gin\n@gin.configurable\ndef my_width(units=3):\n    return units\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    parse_gin(gin_params=["my_width.units = 7"], imports=["my_tasks"])
    assert gin.query_parameter("my_width.units") == 7


def test_bad_import_is_a_config_error():
    with pytest.raises(ConfigError, match="--gin_import=not_a_module_xyz"):
        parse_gin(gin_params=["Trainer.train_steps = 3"], imports=["not_a_module_xyz"])


def test_a_builtin_config_parses_without_error_lines(caplog):
    """gin's package reader logged `E ... Path not found: digits.gin` on every successful run."""
    import logging as std_logging

    with caplog.at_level(std_logging.INFO):
        parse_gin(["digits.gin"], finalize=False)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= std_logging.ERROR]
