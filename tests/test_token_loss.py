"""A per-token loss normalised by the global batch's real tokens (Task.loss_denominator).

Sequence rows carry padding (0 loss weight). The loss a run optimises must be
the mean over the real tokens of the whole global batch, whatever the replica
count and micro-batches: rows with many real tokens on one replica and few on
another must not be averaged per replica or per row.
"""

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import TOKEN_BATCH as BATCH
from faults import TOKEN_LENGTH as LENGTH
from faults import TokenTask
from tiny import strategy_for


def _train(tmp_path, name, replicas, steps=3, **kwargs):
    kwargs.setdefault("jit_compile", False)
    trainer = tputrain.Trainer(TokenTask(), str(tmp_path / name), strategy=strategy_for(replicas),
                               train_steps=steps, steps_per_loop=steps, global_batch_size=BATCH,
                               checkpoint_every=10**6, eval_steps=1, **kwargs)
    logs = trainer.run_loop(steps)[0]
    return trainer, logs


def _reference(steps=3):
    """Plain TensorFlow on one device: SGD on the mean loss over real tokens."""
    task = TokenTask()
    model = task.build_model()
    tokens, targets, weights = task.data
    losses = []
    for step in range(steps):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        with tf.GradientTape() as tape:
            per_token = task.compute_loss(targets[rows], model({"tokens": tokens[rows]}))
            loss = tf.reduce_sum(per_token * weights[rows]) / weights[rows].sum()
        grads = tape.gradient(loss, model.trainable_variables)
        for variable, grad in zip(model.trainable_variables, grads):
            variable.assign_sub(0.5 * tf.convert_to_tensor(grad))
        losses.append(float(loss))
    return [np.asarray(w) for w in model.get_weights()], losses


@pytest.mark.parametrize("replicas,jit_compile", [
    pytest.param(1, False, marks=pytest.mark.slow), (1, "auto"),
    pytest.param(2, False, marks=pytest.mark.slow), (2, "auto"), (4, False)])
def test_the_loss_is_the_mean_over_the_global_batchs_real_tokens(tmp_path, replicas,
                                                                 jit_compile):
    """Host input splits each global batch over the replicas, so every run sees the
    reference's rows; "auto" compiles the whole step (1) or the update (2) with XLA."""
    trainer, logs = _train(tmp_path, "run", replicas, jit_compile=jit_compile)
    expected_weights, losses = _reference()
    assert logs["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    for got, want in zip(trainer.model.get_weights(), expected_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_per_token_normalisation_is_the_same_on_1_2_and_4_replicas_and_with_micro_batches(tmp_path):
    """Per-replica normalisation would differ here: the replicas' rows hold different
    numbers of real tokens."""
    runs = {n: _train(tmp_path, f"r{n}", n)[0] for n in (1, 2, 4)}
    runs["accumulated"] = _train(tmp_path, "acc", 2, accumulation_steps=2)[0]
    reference = [np.asarray(w) for w in runs[1].model.get_weights()]
    for name, trainer in runs.items():
        for got, want in zip(trainer.model.get_weights(), reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(name))


def test_without_a_denominator_the_loss_is_per_row_as_before(tmp_path):
    """The default (None) keeps dividing by the global batch (rows), so the runs
    differ: the test above is not vacuous."""
    task = TokenTask(normalise_by_tokens=False)
    trainer = tputrain.Trainer(task, str(tmp_path / "rows"), strategy=strategy_for(1),
                               train_steps=3, steps_per_loop=3, global_batch_size=BATCH,
                               checkpoint_every=10**6, eval_steps=1, jit_compile=False)
    trainer.run_loop(3)
    expected_weights, _ = _reference()
    assert not all(np.allclose(got, want, rtol=1e-5)
                   for got, want in zip(trainer.model.get_weights(), expected_weights))


def test_the_step_reports_real_tokens_and_the_padding_share(tmp_path):
    _, logs = _train(tmp_path, "tokens", 2)
    _, _, weights = TokenTask().data
    per_step = [weights[i * BATCH:(i + 1) * BATCH].sum() for i in range(3)]
    assert logs["real_tokens"] == pytest.approx(np.mean(per_step))
    assert logs["padding"] == pytest.approx(1 - np.mean(per_step) / (BATCH * LENGTH))


TOKEN_CONFIG = """
Trainer.task = @TokenTask()
Trainer.train_steps = 4
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 8
Trainer.checkpoint_every = 4
Trainer.eval_steps = 1
Trainer.report_mfu = False
Trainer.jit_compile = False
"""


@pytest.mark.slow
def test_two_worker_processes_normalise_by_the_global_batchs_real_tokens(tmp_path):
    """Each worker reads every other row (its shard): the real-token count is summed
    across the workers, so 2 processes end with the one-process run's weights."""
    import sys

    from faults import Process, child_env, final_weights
    from processes import Launch

    config = tmp_path / "tokens.gin"
    config.write_text(TOKEN_CONFIG)
    one = Process([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                   f"--gin_file={config}", f"--model_dir={tmp_path / 'one'}"], child_env())
    assert one.finish() == 0, one.log()
    two = Launch(["--workers", "2", "--gin_import=faults", f"--gin_file={config}",
                  f"--model_dir={tmp_path / 'two'}"])
    assert two.finish(timeout=300) == 0, two.text()[-4000:]
    expected, actual = final_weights(str(tmp_path / "one")), final_weights(str(tmp_path / "two"))
    # The model's weights, as the checkpoint's object graph reaches them first.
    model = [key for key in expected if "_trainable_variables" in key]
    assert len(model) == 5 and expected.keys() == actual.keys()
    for key in model:
        np.testing.assert_allclose(actual[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)
