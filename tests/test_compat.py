"""Old module paths keep working after the modules moved into wings (issues 35, 53):
each is the moved module itself, and importing it says once where it went."""

import importlib
import json
import subprocess
import sys

import pytest

from tputrain import _compat

pytestmark = pytest.mark.same_worker("compat")  # `probed` runs once, on one worker

# Every old path imported once in a fresh interpreter (so nothing imported it before):
# the messages of its DeprecationWarnings, and whether it is the new module object.
_PROBE = """
import importlib, json, sys, warnings
import tputrain
from tputrain import _compat
results = {}
for old, new in _compat.MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    results[old] = {"same": module is importlib.import_module(new)
                    and sys.modules[old] is sys.modules[new],
                    "spec": module.__spec__.name,
                    "warnings": [str(w.message) for w in caught
                                 if w.category is DeprecationWarning]}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def probed():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("old, new", sorted(_compat.MOVED.items()))
def test_an_old_module_path_is_the_moved_module_and_warns(probed, old, new):
    result = probed[old]
    assert result["same"]
    assert result["spec"] == new  # the module keeps its own spec
    assert result["warnings"] == [
        f"{old} moved to {new}; the old name will be removed in {_compat.REMOVED_IN}"]


@pytest.mark.parametrize("old, new", sorted(_compat.MOVED_NAMES.items()))
def test_a_name_moved_to_another_module_still_imports_from_its_old_one_and_warns(old, new):
    module, _, name = old.rpartition(".")
    with pytest.warns(DeprecationWarning) as caught:
        found = getattr(importlib.import_module(module), name)
    assert found is getattr(importlib.import_module(new), name)
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{old} moved to {new}.{name}; the old name will be removed in {_compat.REMOVED_IN}"]


def test_a_name_that_never_moved_is_still_an_attribute_error():
    from tputrain.serving import export

    with pytest.raises(AttributeError, match="has no attribute 'Exporter'"):
        export.Exporter  # noqa: B018


def test_monkeypatching_through_the_old_path_patches_the_one_module(monkeypatch):
    from tputrain.optim import schedules

    with pytest.warns(DeprecationWarning, match="tputrain.schedules moved"):
        monkeypatch.delitem(sys.modules, "tputrain.schedules", raising=False)
        monkeypatch.setattr("tputrain.schedules.scale_learning_rate", "patched")
    assert schedules.scale_learning_rate == "patched"


def test_the_checkpoint_shim_names_stay_importable():
    from tputrain.checkpointing.files import CheckpointList
    from tputrain.checkpointing.manager import Checkpointer

    with pytest.warns(DeprecationWarning):
        sys.modules.pop("tputrain.checkpoint", None)
        from tputrain.checkpoint import (UNREADABLE_ERRORS, CheckpointList as Old,  # noqa: F401
                                         Checkpointer as OldCheckpointer, read_newest)
    assert (Old, OldCheckpointer) == (CheckpointList, Checkpointer)


def test_python_m_an_old_entry_point_runs_the_moved_module(tmp_path):
    import numpy as np

    np.savez(tmp_path / "a.npz", x=np.zeros((4, 2), "float32"), y=np.arange(4))
    result = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m",
                             "tputrain.write_tfrecords_cli", f"--input={tmp_path / 'a.npz'}",
                             f"--output_prefix={tmp_path / 'out' / 'train'}"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "tputrain.write_tfrecords_cli moved to tputrain.data.arrays" in result.stderr
    assert (tmp_path / "out" / "train-00000-of-00001.tfrecord").exists()


def test_config_names_users_import_stay_at_tputrain_config():
    from tputrain.config import ConfigError, parse_gin
    from tputrain.config import parsing

    assert (parse_gin, ConfigError) == (parsing.parse_gin, parsing.ConfigError)


def test_precision_names_users_import_stay_at_tputrain_precision():
    from tputrain.precision import (resolve_precision, set_precision_policy, to_float32,
                                    wrap_optimizer_for_policy)
    from tputrain.precision import policy

    assert (to_float32, set_precision_policy, resolve_precision, wrap_optimizer_for_policy) == (
        policy.to_float32, policy.set_precision_policy, policy.resolve_precision,
        policy.wrap_optimizer_for_policy)
