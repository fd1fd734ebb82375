"""tputrain/loop/xla_plan.py: the XLA decision is the run plan's, made once.

The plans each model and precision get are pinned by tests/loop/test_step.py,
test_random_draws.py and test_update.py through a Trainer; these check where the
decision lives: in the plan, before any step is built, and what a refusal leaves.
"""

import keras
import tensorflow as tf

import tputrain
from tiny import TinyTask, strategy_for
from tputrain.loop.xla_plan import XLA_OFF, XlaPlan, decide_xla


def _dense() -> tuple[keras.Model, keras.optimizers.Optimizer, tf.TensorSpec]:
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    return model, keras.optimizers.SGD(0.1), tf.TensorSpec([8, 4], tf.float32)


def test_what_jit_compile_asks_decides_on_one_replica():
    strategy = strategy_for(1)
    with strategy.scope():
        model, optimizer, spec = _dense()
    decide = lambda jit, custom=False: decide_xla(jit, "float32", custom, strategy, model,
                                                  optimizer, spec)
    assert decide(False) == XLA_OFF
    assert decide(True) == XlaPlan(True, False, "on (the whole step)")
    assert decide("auto") == XlaPlan(True, False, "auto: the whole step, if it compiles")
    # A Task's own train_step: no fused batch norms (tputrain's step is not used).
    assert not decide("auto", custom=True).fuse_batch_norm


def test_the_plan_holds_the_decision_before_a_step_is_built(tmp_path):
    trainer = tputrain.Trainer(TinyTask(), str(tmp_path), strategy=strategy_for(1),
                               train_steps=2, steps_per_loop=2, global_batch_size=8,
                               eval_steps=1)
    assert trainer.plan.xla_plan == XlaPlan(True, False, "auto: the whole step, if it compiles")
    assert trainer.plan.xla == trainer.plan.xla_plan.why  # the start-up line's words
    assert trainer._steps.plan() is trainer.plan.xla_plan  # the step reads it, no copy
    assert not trainer.plan.custom_train_step
    refused = trainer.plan.without_xla()  # what a step XLA refuses runs with
    assert (refused.jit_compile, refused.xla_plan) == (False, XLA_OFF)
