"""What a model_dir holds: every path tputrain reads or writes in it, named once."""

from __future__ import annotations

import os


class ModelDirError(OSError):
    """model_dir cannot hold the run's checkpoints and logs."""


class RunDirectory:
    """The layout of a model_dir (local or `gs://`); every module names its paths here.

        model_dir/
          .tputrain.lock             the chief's lock: one writer per model_dir (lock.py)
          operative_config.gin       the gin bindings the run used (the CLI writes it)
          plan.json                  the XLA plan the plan trial chose, by model and machine
          checkpoints/               ckpt-<step>.* (keep-N rotation) and `checkpoint`,
                                     TensorFlow's state file listing them
            damaged/                 unreadable checkpoints moved aside, never restored
            early_stopping.json      EarlyStopping's record
          best/                      BestCheckpoint: the best ckpt-<step>.* and best.json
          export/<step>/             SavedModels (Export, `tputrain export`)
          export_merged/<step>/      LoRA merged into the weights (export_for_serving)
          export_<mode>/<step>/      a quantized SavedModel (int8, ...)
          keras/<step>[-<mode>].keras  `.keras` files (export_for_serving)
          final.weights.h5           `tputrain.fit`: the weights it ended on (callbacks, `use_ema`)
          goodput/run-<n>.json       each run's wall-clock record (tputrain goodput)
          tracking/<tracker>.json    a tracker's run id (MLflowTracker), so a resume continues it
          tracking/<tracker>.spool.jsonl  the metrics it was asked to send (appended), so
                                     a resume sends those a kill -9 lost
          train/, eval/              TensorBoard events (or under $AIP_TENSORBOARD_LOG_DIR)
          eval/evaluated_checkpoints.json  the side-car evaluator's record

    Every file but the spools (appended a line at a time) is written whole
    (`tputrain.write_atomically`): a temp beside it, `<name>.tmp-<host>-<pid>-<random>`,
    renamed over it.
    """

    CHECKPOINTS = "checkpoints"
    DAMAGED = "damaged"
    BEST = "best"
    BEST_RECORD = "best.json"
    EARLY_STOPPING = "early_stopping.json"
    EXPORT = "export"
    KERAS = "keras"
    GOODPUT = "goodput"
    TRACKING = "tracking"
    TRAIN = "train"
    EVAL = "eval"
    EVAL_RECORD = "evaluated_checkpoints.json"
    LOCK = ".tputrain.lock"
    OPERATIVE_CONFIG = "operative_config.gin"
    PLAN_RECORD = "plan.json"
    FINAL_WEIGHTS = "final.weights.h5"
    # The folders a run writes into (the pre-flight checks each is writable).
    WRITTEN = (CHECKPOINTS, TRAIN, EVAL)

    def __init__(self, model_dir: str):
        self.model_dir = model_dir

    def _join(self, *parts: str) -> str:
        return os.path.join(self.model_dir, *parts)

    @property
    def checkpoints(self) -> str:
        return self._join(self.CHECKPOINTS)

    @property
    def damaged(self) -> str:
        return self._join(self.CHECKPOINTS, self.DAMAGED)

    @property
    def early_stopping(self) -> str:
        return self._join(self.CHECKPOINTS, self.EARLY_STOPPING)

    @property
    def best(self) -> str:
        return self._join(self.BEST)

    @property
    def export(self) -> str:
        return self._join(self.EXPORT)

    def export_version(self, step: int | str, mode: str | None = None) -> str:
        """`export/<step>` (`step="*"`: the glob of them); with `mode` ("merged", "int8", ...) `export_<mode>/<step>`."""
        folder = f"{self.EXPORT}_{mode}" if mode else self.EXPORT
        return self._join(folder, str(step))

    def keras_file(self, step: int, suffix: str = "") -> str:
        return self._join(self.KERAS, f"{step}{suffix}.keras")

    @property
    def goodput(self) -> str:
        return self._join(self.GOODPUT)

    def goodput_record(self, run: int | str) -> str:
        """`goodput/run-<run>.json` (`run="*"`: the glob of them all)."""
        return self._join(self.GOODPUT, f"run-{run}.json")

    def tracking_record(self, tracker: str) -> str:
        return self._join(self.TRACKING, f"{tracker}.json")

    def tracking_spool(self, tracker: str) -> str:
        return self._join(self.TRACKING, f"{tracker}.spool.jsonl")

    @property
    def eval(self) -> str:
        return self._join(self.EVAL)

    @property
    def eval_record(self) -> str:
        return self._join(self.EVAL, self.EVAL_RECORD)

    @property
    def lock(self) -> str:
        return self._join(self.LOCK)

    @property
    def operative_config(self) -> str:
        return self._join(self.OPERATIVE_CONFIG)

    @property
    def plan_record(self) -> str:
        """`plan.json`: the plan trial's choices (`tputrain.loop.plan_trial`)."""
        return self._join(self.PLAN_RECORD)

    @property
    def final_weights(self) -> str:
        return self._join(self.FINAL_WEIGHTS)

    def written(self) -> list[str]:
        """model_dir and the folders a run writes into."""
        return [self.model_dir] + [f"{self.model_dir.rstrip('/')}/{sub}" for sub in self.WRITTEN]
