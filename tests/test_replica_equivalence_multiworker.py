"""1 process = 2 worker processes, with every optimizer option (issue: scale-out you can trust).

Two real processes on 127.0.0.1 (MultiWorkerMirrored, each with one replica and
its own half of every global batch) train a tiny model once per option; their
final weights must equal one process with one replica on the same global batch.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from faults import child_env
from processes import in_netns
from equivalence import OPTIONS
from tputrain.distribution.launch import tf_configs

pytestmark = [pytest.mark.slow, pytest.mark.start_early(0),
              pytest.mark.same_worker("replica_equivalence")]

WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tputrain
    from equivalence import OPTIONS, train

    strategy = tputrain.resolve_strategy()
    out, results = sys.argv[1], {}
    for option in OPTIONS:
        results[option] = [w.tolist() for w in train(option, f"{out}/{option}", strategy)]
    if strategy.extended.should_checkpoint:
        with open(f"{out}/weights.json", "w") as f:
            json.dump(results, f)
""")


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> dict[str, list]:
    """Final weights of every option, trained once by 2 worker processes."""
    tmp_path = tmp_path_factory.mktemp("two_workers")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    # Both workers in one private network namespace (each TF_CONFIG in a file).
    for index, config in enumerate(tf_configs(2)):
        (tmp_path / f"tf_config_{index}").write_text(config)
    worker = (f"TF_CONFIG=\"$(cat {tmp_path}/tf_config_$0)\" {shlex.quote(sys.executable)} "
              f"{script} {out} > {tmp_path}/log_$0 2>&1")
    both = ["bash", "-c", f"bash -c '{worker}' 1 & bash -c '{worker}' 0; code=$?; wait $!; "
            "exit $(( code | $? ))"]
    result = subprocess.run(in_netns(both), env=child_env(), timeout=600)
    logs = [(tmp_path / f"log_{i}").read_text()[-3000:] for i in (0, 1)]
    assert result.returncode == 0, "\n".join(logs)
    return json.loads((out / "weights.json").read_text())


@pytest.mark.parametrize("option", list(OPTIONS))
def test_two_worker_processes_equal_one_replica(two_workers, one_replica, option):
    """`one_replica` (conftest): each option trained by 1 process on 1 replica."""
    for got, want in zip(two_workers[option], one_replica[option]):
        np.testing.assert_allclose(np.array(got), want, atol=1e-5, err_msg=option)
