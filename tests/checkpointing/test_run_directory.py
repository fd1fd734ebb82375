"""RunDirectory: the one place that names a model_dir's paths, and its docstring the layout."""

from __future__ import annotations

import os

import tputrain
from tputrain.checkpointing.run_directory import RunDirectory


def test_its_docstring_shows_every_name_it_gives():
    """The docstring is the model_dir's layout: a name added without it is caught."""
    names = {value for key, value in vars(RunDirectory).items()
             if key.isupper() and isinstance(value, str)}
    assert {"checkpoints", "best", "export", "goodput", "eval", ".tputrain.lock",
            "operative_config.gin"} <= names
    assert [name for name in sorted(names) if name not in RunDirectory.__doc__] == []


def test_paths_are_those_the_writers_used(tmp_path):
    """The same strings the modules joined by hand (tests compare them)."""
    run = tputrain.RunDirectory(str(tmp_path))
    assert run.checkpoints == os.path.join(str(tmp_path), "checkpoints")
    assert run.early_stopping == os.path.join(str(tmp_path), "checkpoints", "early_stopping.json")
    assert run.export_version(8) == os.path.join(str(tmp_path), "export", "8")
    assert run.export_version(8, "int8") == os.path.join(str(tmp_path), "export_int8", "8")
    assert run.keras_file(8, "-int8") == os.path.join(str(tmp_path), "keras", "8-int8.keras")
    assert run.goodput_record(3) == os.path.join(str(tmp_path), "goodput", "run-3.json")
    assert run.eval_record == os.path.join(str(tmp_path), "eval", "evaluated_checkpoints.json")
    assert RunDirectory("gs://b/run/").written() == [
        "gs://b/run/", "gs://b/run/checkpoints", "gs://b/run/train", "gs://b/run/eval"]
