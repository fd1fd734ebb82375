"""Tests for tputrain/distribution/cluster.py: the one TF_CONFIG reader and the join watchdog's use of it."""

import json

import pytest

from tputrain.distribution import strategy as strategy_lib
from tputrain.distribution.cluster import ClusterSpec, TFConfigError, join_watchdog, read_tf_config

TWO_WORKERS = {"cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"]},
               "task": {"type": "worker", "index": 1}}


@pytest.fixture(autouse=True)
def no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def test_unset_or_empty_tf_config_is_none(monkeypatch):
    assert read_tf_config() is None
    monkeypatch.setenv("TF_CONFIG", "")
    assert read_tf_config() is None


def test_a_valid_tf_config_gives_the_tasks_this_index_and_the_count(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(TWO_WORKERS))
    spec = read_tf_config()
    assert spec == ClusterSpec(tasks=(("chief", 0, "c:1"), ("worker", 0, "w:1"),
                                      ("worker", 1, "w:2")),
                               task_type="worker", task_index=1)
    assert spec.num_tasks == 3
    assert spec.this_task == ("worker", 1) == spec.require_task()
    with pytest.raises(AttributeError):  # frozen: one parse, read by everyone
        spec.task_index = 0


def test_only_chief_and_workers_count():
    spec = read_tf_config(json.dumps({"cluster": {"worker": ["w:1"], "ps": ["p:1"]},
                                      "task": {"type": "evaluator", "index": 0}}))
    assert spec.num_tasks == 1
    assert spec.require_task() == ("evaluator", 0)  # not in the cluster, and need not be


@pytest.mark.parametrize("raw, message", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    ("[1, 2]", "TF_CONFIG must be a JSON object with 'cluster' and 'task'"),
    ('{"cluster": ["w:1"]}', "TF_CONFIG's cluster must be a JSON object"),
    ('{"cluster": {"worker": "w:1"}}', 'cluster "worker" must be a list of "host:port"'),
    ('{"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": "0"}}',
     "TF_CONFIG's task index must be an int, got '0'"),
])
def test_a_malformed_tf_config_is_one_clear_error(raw, message):
    with pytest.raises(TFConfigError, match=message) as caught:
        read_tf_config(raw)
    assert isinstance(caught.value, ValueError)  # the CLI reports it as bad input


def test_a_missing_or_unlisted_task_names_the_fix():
    no_task = read_tf_config(json.dumps({"cluster": TWO_WORKERS["cluster"]}))
    assert no_task.this_task is None
    with pytest.raises(TFConfigError, match='add "task": {"type": "worker", "index": N}'):
        no_task.require_task()
    unlisted = read_tf_config(json.dumps({**TWO_WORKERS, "task": {"type": "worker",
                                                                  "index": 2}}))
    with pytest.raises(TFConfigError, match=r"lists 2 worker task\(s\): use an index in \[0, 2\)"):
        unlisted.require_task()


def test_the_watchdog_and_the_resolver_read_tf_config_alike(monkeypatch):
    """Before, the watchdog ignored a malformed TF_CONFIG that the resolver refused."""
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(TFConfigError, match="TF_CONFIG is not valid JSON"):
        with join_watchdog(timeout=1):
            pass
    with pytest.raises(TFConfigError, match="TF_CONFIG is not valid JSON"):
        strategy_lib._decide(None, None)


def test_the_watchdog_is_a_no_op_for_one_task(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["w:1"]},
                                                "task": {"type": "worker", "index": 0}}))
    ran = []
    with join_watchdog(timeout=1):
        ran.append(True)
    assert ran == [True]
