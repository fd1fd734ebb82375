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
from pathlib import Path

import keras
import numpy as np
import pytest

import tputrain
from faults import child_env
from test_launch import in_netns
from tiny import TinyTask, strategy_for
from tputrain.launch import tf_configs

pytestmark = pytest.mark.slow

# name -> (build_optimizer keyword arguments or "user", Trainer keyword arguments).
# Thresholds are small enough that clipping fires on this model's gradients.
OPTIONS = {
    "global_clipnorm": ({"name": "sgd", "global_clipnorm": 0.02}, {}),
    "clipnorm": ({"name": "sgd", "clipnorm": 0.01}, {}),
    "clipvalue": ({"name": "sgd", "clipvalue": 0.002}, {}),
    "weight_decay": ({"name": "adamw", "weight_decay": 0.1}, {}),
    "lars": ({"name": "lars", "learning_rate": 0.1}, {}),
    "lamb": ({"name": "lamb"}, {}),
    "accumulation": ({"name": "adam"}, {"accumulation_steps": 2}),
    "user_global_clipnorm": ("user", {}),
}


class OptionTask(TinyTask):
    """TinyTask with the optimizer of one OPTIONS entry."""

    def __init__(self, option: str):
        super().__init__()
        self.option = option

    def build_optimizer(self):
        kwargs, _ = OPTIONS[self.option]
        if kwargs == "user":
            return keras.optimizers.Adam(0.01, global_clipnorm=0.02)
        return tputrain.build_optimizer(**{"learning_rate": 0.05, **kwargs})


def train(option: str, model_dir: str, strategy=None) -> list[np.ndarray]:
    _, trainer_kwargs = OPTIONS[option]
    trainer = tputrain.Trainer(OptionTask(option), model_dir, strategy=strategy, train_steps=4,
                               steps_per_loop=2, global_batch_size=16, checkpoint_every=4,
                               eval_steps=1, report_mfu=False, **trainer_kwargs)
    trainer.train()
    return [np.asarray(w) for w in trainer.model.get_weights()]


WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tputrain
    from test_replica_equivalence_multiworker import OPTIONS, train

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


# Keras 3 clips inside `apply`, before the cross-replica sum: each worker clips its own
# partial gradient (FINDINGS). Strict: the day clipping sees the all-reduced gradient,
# these start passing and the marks must go.
_PER_REPLICA_CLIPPING = pytest.mark.xfail(
    strict=True, reason="known: clipping is applied per replica, before the all-reduce")


@pytest.mark.parametrize("option", [
    pytest.param(o, marks=_PER_REPLICA_CLIPPING) if "clip" in o else o for o in OPTIONS])
def test_two_worker_processes_equal_one_replica(two_workers, tmp_path, option):
    expected = train(option, str(tmp_path / option), strategy_for(1))
    for got, want in zip(two_workers[option], expected):
        np.testing.assert_allclose(np.array(got), want, atol=1e-5, err_msg=option)
