"""Experiment trackers as actions: the run in MLflow or W&B, continued across resumes.

`tputrain.tracking.base` says what a tracker sends and when; each tracker's package
is an optional extra, imported only when a run uses it (`pip install
'tputrain[mlflow]'`). Importing this package imports neither.
"""

from tputrain.tracking.base import Tracker
from tputrain.tracking.mlflow_tracker import MLflowTracker
from tputrain.tracking.wandb_tracker import WandbTracker

__all__ = ["MLflowTracker", "Tracker", "WandbTracker"]
