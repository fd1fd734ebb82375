"""Tiny Keras-Hub LoRA runs shared by test_keras_hub_lm.py and test_keras_saving.py."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tputrain
from tiny import strategy_for
from tputrain.tasks.keras_hub_lm import KerasHubLMTask


def lora_trainer(model_dir, replicas: int = 1, steps: int = 8, ema_decay: float | None = 0.5,
                 actions=(), **task_args) -> tputrain.Trainer:
    """A 2-layer GPT-2 (hidden 16, vocabulary 100, 16 tokens) with LoRA rank 4, global
    batch 8, a checkpoint every 4 steps, EMA."""
    task = KerasHubLMTask(**{"lora_rank": 4, "learning_rate": 0.01, "train_rows": 64,
                             "eval_rows": 16, **task_args})
    return tputrain.Trainer(task, str(model_dir), strategy=strategy_for(replicas),
                            train_steps=steps, steps_per_loop=4, checkpoint_every=4,
                            global_batch_size=8, eval_every=steps, ema_decay=ema_decay,
                            jit_compile=False, report_mfu=False, actions=actions)


def latest_values(model_dir) -> dict[str, np.ndarray]:
    """Every tensor of model_dir's latest checkpoint, by key (not the input iterator's
    state, a variant, nor the object graph)."""
    path = tf.train.latest_checkpoint(f"{model_dir}/checkpoints")
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name)
            for name, dtype in reader.get_variable_to_dtype_map().items()
            if dtype not in (tf.variant, tf.string)}


def token_batch(rows: int = 3, seed: int = 5) -> dict[str, np.ndarray]:
    """A request for the tiny model: random tokens, no padding."""
    tokens = np.random.default_rng(seed).integers(0, 100, (rows, 16)).astype(np.int32)
    return {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}


def lora_after_build_run(model_dir: str, pause_at: int | None = None) -> None:
    """A script's run: the Trainer built without LoRA, LoRA enabled on its model in the
    strategy's scope, 8 steps (a checkpoint every 2), op determinism on; `pause_at`:
    waits after that step's loop (faults.PauseAtStep)."""
    from faults import PauseAtStep

    tf.config.experimental.enable_op_determinism()
    task = KerasHubLMTask(lora_rank=None, learning_rate=0.01, train_rows=64, eval_rows=16)
    trainer = tputrain.Trainer(task, model_dir, strategy=strategy_for(1), train_steps=8,
                               steps_per_loop=2, checkpoint_every=2, global_batch_size=8,
                               eval_every=8, ema_decay=0.5, jit_compile=False,
                               report_mfu=False,
                               actions=[PauseAtStep(pause_at)] if pause_at else [])
    with trainer.strategy.scope():
        trainer.model.backbone.enable_lora(4)
    trainer.train()
    trainer.close()
