"""`MLflowTracker`: the run in MLflow (`pip install 'tputrain[mlflow]'`).

    Trainer.actions = [@Export(), @MLflowTracker()]
    MLflowTracker.tracking_uri = 'http://127.0.0.1:5000'
    MLflowTracker.experiment = 'digits'

What it sends, when, and how a resume continues the same run: `tputrain.tracking.base`.
`mlflow` is imported only when a run uses it. Its HTTP client retries a request
for minutes by default; unless set in the environment, the tracker asks it for no
retries and a 10 s timeout (`MLFLOW_HTTP_REQUEST_MAX_RETRIES`,
`MLFLOW_HTTP_REQUEST_TIMEOUT`): the sender retries on its own thread instead.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from typing import Any, Collection, Mapping

from absl import logging

from tputrain.tracking.base import Tracker

MAX_PARAM_LENGTH = 500  # what older MLflow servers accept (3.x: 6000)
BATCH = 100  # params or tags per log_batch (MLflow's limit); metrics: 1000
_BAD_KEY = re.compile(r"[^\w\-. :/]")


def _key(name: str) -> str:
    """A parameter, metric or tag name MLflow accepts."""
    return _BAD_KEY.sub("_", name)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


class MLflowTracker(Tracker):
    """Tracks the run in MLflow (chief only): `tputrain.tracking.base` says what.

    Args:
      tracking_uri: the MLflow tracking server or store (`http://host:5000`,
        `sqlite:///path/mlflow.db`, `databricks`); None: MLflow's own default
        (`$MLFLOW_TRACKING_URI`).
      experiment: the experiment's name (created when missing).
      run_name: the run's name; default: model_dir's folder name.
      flush_seconds: at the end of a run, how long to wait for the queued calls.
      max_queue: calls queued while the tracker is down before new ones are dropped.
    """

    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str = "tputrain",
                 run_name: str | None = None, flush_seconds: float = 30.0,
                 max_queue: int = 1000):
        super().__init__(flush_seconds=flush_seconds, max_queue=max_queue)
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self._mlflow_client: Any = None

    def client(self) -> Any:
        """MLflow's client for `tracking_uri` (imports mlflow)."""
        if self._mlflow_client is None:
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            try:
                from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
            except ImportError as error:
                raise ValueError("MLflowTracker needs the mlflow package: pip install "
                                 "'tputrain[mlflow]'") from error
            self._mlflow_client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._mlflow_client

    def check(self, model_dir: str, resuming: bool) -> None:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "MLflow's default"
        try:
            self.client().search_experiments(max_results=1)
        except ValueError:
            raise
        except Exception as error:  # pylint: disable=broad-except  (MLflow's, any store)
            if resuming:  # the run goes on; the sender retries
                logging.warning("tputrain: MLflowTracker: %s does not answer (%s): training "
                                "goes on; its metrics are queued and retried", uri,
                                first_line(error))
                return
            raise ValueError(f"MLflowTracker: tracking URI {uri} does not work "
                             f"({first_line(error)}): start the server, or fix "
                             "MLflowTracker.tracking_uri") from None

    def open_run(self, run_id: str | None, model_dir: str) -> str:
        client = self.client()
        if run_id is not None:
            try:
                if self.writing:  # `tputrain eval` adds evaluations, and leaves the status
                    client.update_run(run_id, status="RUNNING")
                else:
                    client.get_run(run_id)
                return run_id
            except Exception as error:  # pylint: disable=broad-except
                if getattr(error, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                    raise
                logging.warning("tputrain: MLflowTracker: run %s of %s is not on this tracking "
                                "server: starting a new run", run_id, model_dir)
        experiment = client.get_experiment_by_name(self.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(self.experiment))
        name = self.run_name or os.path.basename(os.path.normpath(model_dir))
        return client.create_run(experiment_id, run_name=name).info.run_id

    def logged_steps(self, keys: Collection[str] | None = None) -> dict[str, int]:
        client = self.client()
        steps = {}
        held = client.get_run(self.run_id).data.metrics
        for key in held if keys is None else [key for key in keys if key in held]:
            history = client.get_metric_history(self.run_id, key)
            steps[key] = max((metric.step for metric in history), default=-1)
        return steps

    def metric_key(self, name: str) -> str:
        return _key(name)

    def send_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param, RunTag  # pylint: disable=import-outside-toplevel
        client = self.client()
        held = client.get_run(self.run_id).data.params
        values = {_key(k): str(v)[:MAX_PARAM_LENGTH] for k, v in params.items()}
        new = [Param(k, v) for k, v in values.items() if k not in held]
        # A parameter cannot change in MLflow: a rerun's new value is a tag.
        changed = [RunTag(f"tputrain.changed/{k}", v) for k, v in values.items()
                   if k in held and held[k] != v]
        for start in range(0, max(len(new), len(changed)), BATCH):
            client.log_batch(self.run_id, params=new[start:start + BATCH],
                             tags=changed[start:start + BATCH])

    def send_metrics(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric  # pylint: disable=import-outside-toplevel
        now = int(time.time() * 1000)
        metrics = [Metric(_key(k), float(v), now, step) for k, v in values.items()]
        for start in range(0, len(metrics), 10 * BATCH):
            self.client().log_batch(self.run_id, metrics=metrics[start:start + 10 * BATCH])

    def send_artifact(self, name: str, text: str) -> None:
        with tempfile.TemporaryDirectory(prefix="tputrain-mlflow-") as folder:
            path = os.path.join(folder, name)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            self.client().log_artifact(self.run_id, path)

    def send_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag  # pylint: disable=import-outside-toplevel
        if tags:
            self.client().log_batch(self.run_id, tags=[RunTag(_key(k), str(v))
                                                       for k, v in tags.items()])

    def finish(self, status: str = "FINISHED") -> None:
        self.client().set_terminated(self.run_id, status)
