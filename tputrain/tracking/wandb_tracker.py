"""`WandbTracker`: the run in Weights & Biases (`pip install 'tputrain[wandb]'`).

    Trainer.actions = [@Export(), @WandbTracker()]
    WandbTracker.project = 'digits'
    WandbTracker.mode = 'offline'      # or 'online' (W&B's default: $WANDB_MODE)

What it sends, when, and how a resume continues the same run: `tputrain.tracking.base`.
W&B keeps its files in `model_dir/tracking/wandb/` (a local model_dir; else W&B's
default folder, or `dir`); they hold every step the run logged (wandb_files.py),
so a resumed run, offline as well, sends no step twice. `wandb` is imported only
when a run uses it. Parameters go to the run's config, references (export, best
checkpoint) to its summary, and the config and goodput account are saved as files.
"""

from __future__ import annotations

import os
from typing import Any, Collection, Mapping

from tputrain.fault_tolerance.preemption import PREEMPTED_EXIT_CODE
from tputrain.tracking.base import Tracker
from tputrain.tracking.record import TRACKING_DIR
from tputrain.tracking.wandb_files import logged_steps

MODES = (None, "online", "offline", "disabled")
EXIT_CODES = {"FINISHED": 0, "FAILED": 1, "KILLED": PREEMPTED_EXIT_CODE}


class WandbTracker(Tracker):
    """Tracks the run in W&B (chief only): `tputrain.tracking.base` says what.

    Args:
      project, entity: the W&B project and team (entity None: your default).
      mode: "online", "offline" (files only; `wandb sync` uploads them later) or
        None: W&B's default ($WANDB_MODE).
      run_name: the run's name; default: model_dir's folder name.
      dir: where W&B keeps its files; default model_dir/tracking (a local model_dir).
      flush_seconds, max_queue: as `MLflowTracker`'s.
    """

    name = "wandb"

    def __init__(self, project: str = "tputrain", entity: str | None = None,
                 mode: str | None = None, run_name: str | None = None,
                 dir: str | None = None, flush_seconds: float = 30.0,  # pylint: disable=redefined-builtin
                 max_queue: int = 1000):
        super().__init__(flush_seconds=flush_seconds, max_queue=max_queue)
        if mode not in MODES:
            raise ValueError(f"WandbTracker.mode must be one of {MODES}, got {mode!r}")
        self.project, self.entity, self.mode, self.run_name = project, entity, mode, run_name
        self.dir = dir
        self._run: Any = None

    def files_dir(self, model_dir: str) -> str | None:
        if self.dir is not None:
            return self.dir
        return None if "://" in model_dir else os.path.join(model_dir, TRACKING_DIR)

    def check(self, model_dir: str, resuming: bool) -> None:
        try:
            import wandb  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        except ImportError as error:
            raise ValueError("WandbTracker needs the wandb package: pip install "
                             "'tputrain[wandb]'") from error

    def open_run(self, run_id: str | None, model_dir: str) -> str:
        import wandb  # pylint: disable=import-outside-toplevel
        folder = self.files_dir(model_dir)
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
        self._folder = folder or os.getcwd()
        self._run = wandb.init(
            project=self.project, entity=self.entity, mode=self.mode, dir=folder,
            id=run_id, resume="allow",
            name=self.run_name or os.path.basename(os.path.normpath(model_dir)),
            settings=wandb.Settings(silent=True, console="off"))
        return self._run.id

    def logged_steps(self, keys: Collection[str] | None = None) -> dict[str, int]:
        steps = logged_steps(self._folder, self._run.id)
        resumed_at = self.first_step()
        steps = {**{key: resumed_at - 1 for key in steps}, **steps} if resumed_at else steps
        return steps if keys is None else {k: v for k, v in steps.items() if k in keys}

    def first_step(self) -> int:
        """A resumed online run's next step on the server (W&B drops a smaller one)."""
        return int(getattr(self._run, "starting_step", 0) or 0)

    def send_params(self, params: Mapping[str, str]) -> None:
        self._run.config.update(dict(params), allow_val_change=True)

    def send_metrics(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def send_artifact(self, name: str, text: str) -> None:
        path = os.path.join(self._run.dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        self._run.save(path, base_path=self._run.dir, policy="now")

    def send_tags(self, tags: Mapping[str, str]) -> None:
        self._run.summary.update(dict(tags))

    def finish(self, status: str = "FINISHED") -> None:
        self._run.finish(exit_code=EXIT_CODES[status])  # W&B: nonzero is a failed run
