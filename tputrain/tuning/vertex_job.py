"""A tuning spec as a Vertex AI HyperparameterTuningJob (`tputrain vertex-spec --tune`).

The trials run the CustomJob `tputrain vertex-spec` would write, less its
`--model_dir` (each trial trains in its own `$AIP_CHECKPOINT_DIR`, under the
job's output folder and the trial's id), with `$TPUTRAIN_TUNE_METRIC` set so the
run reports the spec's metric at each evaluation where the service reads it
(`tputrain.tuning.report`). The service passes a trial's values as
`--<parameterId>=<value>`: a parameter's id is its gin binding with `.` as `__`
(`build_optimizer__learning_rate`), and `tputrain run` turns such arguments back
into `--gin_param`s (`hyperparameter_args`). A choice's values are its gin text.
The median pruner becomes the service's median automated stopping.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Sequence

from tputrain.tuning.report import METRIC_ENV
from tputrain.tuning.spec import Param, TuningSpec, gin_literal
from tputrain.jobs.vertex import SpecError as VertexSpecError, job_service

_ARG = re.compile(r"^--([A-Za-z_]\w*__\w+)=(.*)$", re.S)
SCOPE = "___"  # a gin scope's "/" in a parameter id


def parameter_id(binding: str) -> str:
    """`scope/Configurable.parameter` -> `scope___Configurable__parameter`."""
    return binding.replace("/", SCOPE).replace(".", "__")


def binding_of(identifier: str) -> str:
    return identifier.replace(SCOPE, "/").replace("__", ".")


def parameter_spec(param: Param) -> dict[str, Any]:
    """One `StudySpec.ParameterSpec` (REST JSON)."""
    body: dict[str, Any] = {"parameterId": parameter_id(param.binding)}
    if param.kind == "choice":
        body["categoricalValueSpec"] = {"values": [gin_literal(v) for v in param.values]}
        return body
    if param.kind == "int":
        body["integerValueSpec"] = {"minValue": str(param.low), "maxValue": str(param.high)}
    else:
        body["doubleValueSpec"] = {"minValue": param.low, "maxValue": param.high}
    body["scaleType"] = "UNIT_LOG_SCALE" if param.log else "UNIT_LINEAR_SCALE"
    return body


def _trial_pool(pool: dict[str, Any], metric: str) -> dict[str, Any]:
    """A worker pool of the trial job: no fixed model_dir, the tuning metric named."""
    pool = copy.deepcopy(pool)
    container = pool["containerSpec"]
    container["args"] = [a for a in container["args"] if not a.startswith("--model_dir=")]
    container["env"] = [*container.get("env", []), {"name": METRIC_ENV, "value": metric}]
    return pool


def build_tuning_job(spec: TuningSpec, custom_job: dict[str, Any]) -> dict[str, Any]:
    """The HyperparameterTuningJob REST body whose trials run `custom_job`."""
    job_spec = copy.deepcopy(custom_job["jobSpec"])
    job_spec["workerPoolSpecs"] = [_trial_pool(pool, spec.metric)
                                   for pool in job_spec["workerPoolSpecs"]]
    study: dict[str, Any] = {
        "metrics": [{"metricId": spec.metric, "goal": spec.goal.upper()}],
        "parameters": [parameter_spec(param) for param in spec.params]}
    if spec.pruner == "median":
        study["medianAutomatedStoppingSpec"] = {"useElapsedDuration": False}
    return {"displayName": custom_job["displayName"], "studySpec": study,
            "maxTrialCount": spec.trials, "parallelTrialCount": spec.parallel,
            "trialJobSpec": job_spec}


def hyperparameter_args(argv: Sequence[str]) -> list[str]:
    """argv with the tuning service's `--<parameterId>=<value>` as `--gin_param`s (other
    flags unchanged: no tputrain flag has `__` in its name)."""
    args = []
    for arg in argv:
        match = _ARG.match(arg)
        args.append(f"--gin_param={binding_of(match.group(1))} = {match.group(2)}"
                    if match else arg)
    return args


def submit_tuning_job(job: dict[str, Any], project: str, region: str) -> str:
    """Creates the job with google-cloud-aiplatform; returns its resource name."""
    aiplatform_v1, client = job_service(project, region, guide="docs/tracking.md")
    created = client.create_hyperparameter_tuning_job(
        parent=f"projects/{project}/locations/{region}",
        hyperparameter_tuning_job=aiplatform_v1.HyperparameterTuningJob.from_json(
            json.dumps(job)))
    return created.name
