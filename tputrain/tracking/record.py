"""What a tracker keeps in model_dir, and what it sends: the run's parameters.

`model_dir/tracking/<tracker>.json` holds the tracker's run id (written atomically
once the run exists), so a rerun, a resume after kill -9 and `tputrain eval`
continue that run instead of opening another.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import tensorflow as tf

from tputrain.actions.config_summary import run_hparams
from tputrain.runtime.context import ActionContext
from tputrain.checkpointing.atomic import write_atomically
from tputrain.checkpointing.run_directory import RunDirectory

TRACKING_DIR = RunDirectory.TRACKING


def record_path(model_dir: str, name: str) -> str:
    return RunDirectory(model_dir).tracking_record(name)


def read_record(model_dir: str, name: str) -> dict[str, Any] | None:
    """The tracker's record in model_dir, or None (none yet, or unreadable)."""
    path = record_path(model_dir, name)
    try:
        with tf.io.gfile.GFile(path) as f:
            record = json.loads(f.read())
    except (tf.errors.NotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("run_id") else None


def write_record(model_dir: str, name: str, record: Mapping[str, Any]) -> None:
    write_atomically(record_path(model_dir, name), json.dumps(dict(record), indent=1) + "\n")


def plan_params(context: ActionContext) -> dict[str, Any]:
    """The Trainer's resolved plan: what the strategy and the step's build decided."""
    plan, batch = context.plan, context.plan.batch
    return {"plan/strategy": type(context.strategy).__name__, "plan/replicas": batch.replicas,
            "plan/hosts": batch.num_hosts, "plan/global_batch_size": batch.global_batch_size,
            "plan/per_replica_batch": batch.per_replica,
            "plan/accumulation_steps": batch.accumulation_steps,
            "plan/precision": plan.precision, "plan/input_mode": plan.input_mode,
            "plan/jit_compile": plan.jit_compile, "plan/xla": plan.xla,
            "plan/steps_per_program": plan.steps_per_program}


def run_params(context: ActionContext) -> dict[str, str]:
    """The operative config's scalar bindings, the Trainer's options and the plan, as
    text (trackers keep parameters as strings)."""
    return {key: str(value) for key, value in {**run_hparams(context),
                                               **plan_params(context)}.items()}


def prefixed(prefix: str, logs: Mapping[str, float]) -> dict[str, float]:
    """`logs` as `<prefix>/<key>` floats (non-numbers left out)."""
    values = {}
    for key, value in logs.items():
        try:
            values[f"{prefix}/{key}"] = float(value)
        except (TypeError, ValueError):
            continue
    return values
