"""Every optimizer option trained the same way on any number of replicas or workers:
the cases of tests/test_replica_equivalence.py and its multi-worker twin."""

from __future__ import annotations

import keras
import numpy as np

import tputrain
from tiny import TinyTask, strategy_for

# name -> (build_optimizer keyword arguments or "user", Trainer keyword arguments).
# Thresholds are small enough that clipping fires on this model's gradients
# (`test_clipping_fires` checks it).
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
UNCLIPPED = {"global_clipnorm": "sgd", "clipnorm": "sgd", "clipvalue": "sgd",
             "user_global_clipnorm": "user_unclipped"}


class OptionTask(TinyTask):
    """TinyTask with the optimizer of one OPTIONS entry."""

    def __init__(self, option: str):
        super().__init__()
        self.option = option

    def build_optimizer(self):
        if self.option == "user_unclipped":
            return keras.optimizers.Adam(0.01)
        if self.option == "sgd":
            return tputrain.build_optimizer(name="sgd", learning_rate=0.05)
        kwargs, _ = OPTIONS[self.option]
        if kwargs == "user":
            return keras.optimizers.Adam(0.01, global_clipnorm=0.02)
        return tputrain.build_optimizer(**{"learning_rate": 0.05, **kwargs})


def train(option: str, model_dir: str, strategy=None) -> list[np.ndarray]:
    """Final weights after 4 steps of global batch 16 (3 checkpoints-free loops)."""
    _, trainer_kwargs = OPTIONS.get(option, ({}, {}))
    with tputrain.Trainer(OptionTask(option), model_dir, strategy=strategy, train_steps=4,
                          steps_per_loop=2, global_batch_size=16, checkpoint_every=4,
                          eval_steps=1, report_mfu=False, **trainer_kwargs) as trainer:
        trainer.train()  # closed at once: many Trainers in one test (conftest._close_trainers)
        return [np.asarray(w) for w in trainer.model.get_weights()]


def train_one_replica(root) -> dict[str, list[np.ndarray]]:
    """The reference: final weights of every option (and its unclipped twin) on 1 replica.

    Computed once per session by conftest's `one_replica` fixture:
    test_replica_equivalence.py and test_replica_equivalence_multiworker.py (one
    worker: one `same_worker` group) compare against it.
    """
    names = list(OPTIONS) + sorted(set(UNCLIPPED.values()))
    return {name: train(name, str(root / name), strategy_for(1)) for name in names}
