"""Old module paths keep working after the rooms were grouped (issue 35): each is the
moved module itself, and importing it says where it went."""

import importlib
import sys
import warnings

import pytest

MOVED = {
    "tputrain.strategy": "tputrain.distribution.strategy",
    "tputrain.cluster": "tputrain.distribution.cluster",
    "tputrain.communication": "tputrain.distribution.communication",
    "tputrain.allreduce": "tputrain.distribution.allreduce",
    "tputrain.launch": "tputrain.distribution.launch",
    "tputrain.layer_precision": "tputrain.precision.layers",
    "tputrain.audit": "tputrain.precision.audit",
}


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_module_path_is_the_moved_module_and_warns(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{old} moved to {new}"]


def test_precision_names_users_import_stay_at_tputrain_precision():
    from tputrain.precision import (resolve_precision, set_precision_policy, to_float32,
                                    wrap_optimizer_for_policy)
    from tputrain.precision import policy

    assert (to_float32, set_precision_policy, resolve_precision, wrap_optimizer_for_policy) == (
        policy.to_float32, policy.set_precision_policy, policy.resolve_precision,
        policy.wrap_optimizer_for_policy)
