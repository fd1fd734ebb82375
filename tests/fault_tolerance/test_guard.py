"""The non-finite guard: a NaN batch never reaches the weights; raise, skip or roll back."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import FaultTask
from tputrain.checkpoint import NonFiniteStateError
from tputrain.fault_tolerance.guard import NonFiniteError, NonFiniteGuard
from tiny import spy_calls, strategy_for, weights

# Two replicas take per-replica batches 2k and 2k+1 at step k+1: batch 5 is step 3.
NAN_BATCH, NAN_STEP = 5, 3


def make_trainer(tmp_path, name, policy, nan_at_batch=NAN_BATCH, **kwargs):
    options = dict(train_steps=8, steps_per_loop=4, global_batch_size=16, checkpoint_every=2,
                   eval_steps=1)
    options.update(kwargs)
    import gin

    gin.bind_parameter("NonFiniteGuard.policy", policy)
    task = FaultTask(dropout=0.0, nan_at_batch=nan_at_batch)
    return tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(2), **options)


def all_finite(trainer):
    return all(np.all(np.isfinite(w)) for w in weights(trainer))


def checkpoint_steps(trainer):
    return sorted(int(p.rsplit("-", 1)[1]) for p in trainer.checkpointer.manager.checkpoints)


def test_raise_names_the_step_and_checkpoints_nothing_non_finite(tmp_path):
    trainer = make_trainer(tmp_path, "raise", "raise")
    with pytest.raises(NonFiniteError, match=rf"at step {NAN_STEP}\b.*NonFiniteGuard.policy"):
        trainer.train()
    assert int(trainer.step.numpy()) == NAN_STEP  # stopped right after the bad step
    assert all_finite(trainer)  # the bad update was not applied
    assert checkpoint_steps(trainer) == [2]


def test_skip_counts_and_keeps_training(tmp_path):
    trainer = make_trainer(tmp_path, "skip", "skip")
    trainer.train()
    assert int(trainer.step.numpy()) == 8
    assert int(trainer.guard.nonfinite_steps.numpy()) == 1
    assert int(trainer.optimizer.iterations.numpy()) == 7  # one update skipped
    assert all_finite(trainer)
    # The skip count is saved: a resumed run keeps reporting it.
    reader = tf.train.load_checkpoint(trainer.checkpointer.latest)
    assert reader.get_tensor("nonfinite_steps/.ATTRIBUTES/VARIABLE_VALUE") == 1


def test_rollback_restores_the_last_checkpoint_and_continues(tmp_path):
    # Batch 7 is step 4: steps 1-2 are in ckpt-2, step 3 is applied, step 4 is not.
    trainer = make_trainer(tmp_path, "rollback", "rollback", nan_at_batch=7)
    trainer.train()
    assert trainer.guard.rollbacks == 1
    assert int(trainer.step.numpy()) == 8
    assert all_finite(trainer)
    # Back to ckpt-2 (2 updates; step 3's update is undone), then steps 5-8: 4 more.
    assert int(trainer.optimizer.iterations.numpy()) == 2 + 4


def test_rollback_without_a_checkpoint_says_so(tmp_path):
    trainer = make_trainer(tmp_path, "nockpt", "rollback", checkpoint_every=8)
    with pytest.raises(NonFiniteError, match="no checkpoint to roll back to"):
        trainer.train()


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="one of .*'raise', 'skip', 'rollback'"):
        NonFiniteGuard("ignore")


def test_a_non_finite_state_is_never_checkpointed(tmp_path):
    trainer = make_trainer(tmp_path, "nan_state", None, train_steps=2)
    trainer.train()
    kernel = trainer.model.trainable_variables[0]
    kernel.assign(tf.fill(kernel.shape, np.nan))
    trainer.step.assign(4)
    with pytest.raises(NonFiniteStateError, match="not saving step 4: NaN/Inf in .*kernel"):
        trainer.checkpointer.save()
    assert checkpoint_steps(trainer) == [2]


def one_replica_trainer(tmp_path, name, policy, nan_at_batch):
    """One replica, the whole step one XLA program: the step counter and the guard's
    observation run inside it (`StepBuilder.build(count=...)`). One batch a step:
    batch b is step b + 1. One step a launch (`steps_per_program=1`): since a loop
    shorter than the program also runs the program (issue 55), "auto" would run these
    loops as one launch of several steps, whose counter moves past every batch taken
    (`step.steps_program`; test_raise_stops_inside_a_fetch_of_several_steps covers it)."""
    import gin

    gin.bind_parameter("NonFiniteGuard.policy", policy)
    task = FaultTask(dropout=0.0, nan_at_batch=nan_at_batch)
    return tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(1),
                            train_steps=8, steps_per_loop=4, global_batch_size=16,
                            checkpoint_every=2, eval_steps=1, jit_compile=True,
                            steps_per_program=1)


def test_raise_with_the_count_inside_the_xla_step(tmp_path):
    trainer = one_replica_trainer(tmp_path, "raise1", "raise", nan_at_batch=2)
    with pytest.raises(NonFiniteError, match=r"at step 3\b"):
        trainer.train()
    assert trainer._steps.counted_in_step
    assert int(trainer.step.numpy()) == 3
    assert all_finite(trainer)
    assert checkpoint_steps(trainer) == [2]


def test_rollback_with_the_count_inside_the_xla_step(tmp_path):
    trainer = one_replica_trainer(tmp_path, "rollback1", "rollback", nan_at_batch=3)
    trainer.train()
    assert trainer._steps.counted_in_step
    assert trainer.guard.rollbacks == 1
    assert int(trainer.step.numpy()) == 8
    assert all_finite(trainer)
    assert int(trainer.optimizer.iterations.numpy()) == 2 + 4  # back to ckpt-2, then 5-8


@pytest.mark.parametrize("replicas, nan_at_batch, several", [
    pytest.param(1, 2, {"steps_per_fetch": 4}, marks=pytest.mark.slow),
    (2, NAN_BATCH, {"steps_per_fetch": 4}),
    (1, 2, {"steps_per_program": 4})])
def test_raise_stops_inside_a_fetch_of_several_steps(tmp_path, replicas, nan_at_batch, several):
    """steps_per_fetch=4 takes steps 1-4's batches at once (steps_per_program=4 also
    runs them in one XLA program); the bad step 3 still ends the run there: step 4 is
    not trained (its update is not applied), but its batch was taken, so the counter
    is at 4, where the data is."""
    import gin

    gin.bind_parameter("NonFiniteGuard.policy", "raise")
    task = FaultTask(dropout=0.0, nan_at_batch=nan_at_batch)
    trainer = tputrain.Trainer(task, str(tmp_path / f"fetch{replicas}"),
                               strategy=strategy_for(replicas), train_steps=8, steps_per_loop=4,
                               global_batch_size=16, checkpoint_every=4, eval_steps=1,
                               **several)
    with pytest.raises(NonFiniteError, match=r"at step 3\b"):
        trainer.train()
    name, = several
    assert getattr(trainer, name) == 4
    assert int(trainer.step.numpy()) == 4
    assert int(trainer.optimizer.iterations.numpy()) == 2  # steps 1-2; not 3, not 4
    assert all_finite(trainer)
    assert checkpoint_steps(trainer) == []


# ----------------------------------------------------------------- the scaled check

class OptimizerTask(FaultTask):
    """FaultTask (no NaN) with one of tputrain's optimizers and its options."""

    def __init__(self, optimizer: str = "adam", **options):
        super().__init__(dropout=0.0)
        self.optimizer, self.options = optimizer, options

    def build_optimizer(self):
        return tputrain.build_optimizer(self.optimizer, learning_rate=0.01, **self.options)


class OwnGradientsTask(OptimizerTask):
    """Overrides compute_gradients without `optimizer.scale_loss`."""

    def compute_gradients(self, batch, model, optimizer, global_batch_size, micro_batches=1):
        features, labels = batch
        with tf.GradientTape() as tape:
            outputs = model(features, training=True)
            loss = self.total_loss(labels, outputs, model, global_batch_size, micro_batches)
        return tape.gradient(loss, model.trainable_variables), loss, outputs


def train_state(tmp_path, name, task, guard, **kwargs):
    """(trainer, every model and optimizer variable after 5 steps) on one replica."""
    options = dict(train_steps=5, steps_per_loop=5, global_batch_size=16,
                   checkpoint_every=10**9, eval_steps=1, seed=0)
    options.update(kwargs)
    trainer = tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(1),
                               guard=guard, **options)
    trainer.train()
    variables = list(trainer.model.variables) + list(trainer.optimizer.variables)
    return trainer, [np.array(v.numpy()) for v in variables]


def spy_checks(monkeypatch) -> dict[str, int]:
    """Counts the traces of each gradient check."""
    from tputrain.fault_tolerance import guard as guard_module

    return spy_calls(monkeypatch, guard_module,
                     {"_scaled_gradients_finite": "scaled", "_gradients_finite": "exact"})


@pytest.mark.parametrize("optimizer, options, kwargs", [
    ("adam", {}, {}),
    pytest.param("adamw", {"weight_decay": 0.01}, {}, marks=pytest.mark.slow),
    pytest.param("sgd", {"momentum": 0.9}, {}, marks=pytest.mark.slow),
    pytest.param("lamb", {}, {}, marks=pytest.mark.slow),
    pytest.param("lars", {}, {}, marks=pytest.mark.slow),
    pytest.param("adam", {"clipnorm": 0.5, "use_ema": True, "ema_overwrite_frequency": None},
                 {}, marks=pytest.mark.slow),
    pytest.param("adam", {}, {"accumulation_steps": 2}, marks=pytest.mark.slow),
    ("adamw", {"weight_decay": 0.01}, {"precision": "mixed_bfloat16"}),  # the update alone in XLA
])
def test_the_scaled_check_updates_bit_for_bit_as_without_a_guard(tmp_path, monkeypatch,
                                                                 optimizer, options, kwargs):
    """The loss scaled (a power of two) and the gradients unscaled: every variable ends
    bit for bit as under the exact check, for these optimizer options; the scaled
    check ran.
    (Against no guard at all, an optimizer that takes norms can differ by a rounding
    under either check: XLA may order a sum differently in another program.)"""
    calls = spy_checks(monkeypatch)
    guarded, scaled = train_state(tmp_path, "scaled", OptimizerTask(optimizer, **options),
                                  NonFiniteGuard(policy="raise"), **kwargs)
    assert calls["scaled"] >= 1 and calls["exact"] == 0
    plan = guarded._steps.plan()
    assert plan.whole_step or plan.apply_only
    _, exact = train_state(tmp_path, "exact", OptimizerTask(optimizer, **options),
                           NonFiniteGuard(policy="raise", scaled_check=False), **kwargs)
    assert calls["exact"] >= 1
    _, unguarded = train_state(tmp_path, "plain", OptimizerTask(optimizer, **options),
                               NonFiniteGuard(policy=None), **kwargs)
    assert int(guarded.optimizer.iterations.numpy()) == 5
    for value, expected, plain in zip(scaled, exact, unguarded):
        np.testing.assert_array_equal(value, expected)
        np.testing.assert_allclose(value, plain, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("task, guard_options", [
    (OwnGradientsTask(), {}),  # its gradients are not of optimizer.scale_loss
    (OptimizerTask(), {"scaled_check": False}),
    (OptimizerTask(global_clipnorm=1.0), {}),  # clipping's norm gives the exact check free
])
def test_the_exact_check_where_the_loss_is_not_scaled(tmp_path, monkeypatch, task,
                                                      guard_options):
    calls = spy_checks(monkeypatch)
    guarded, with_guard = train_state(tmp_path, "guarded", task,
                                      NonFiniteGuard(policy="raise", **guard_options))
    _, without = train_state(tmp_path, "plain", task, NonFiniteGuard(policy=None))
    assert guarded._steps.plan().whole_step
    assert calls["exact"] >= 1 and calls["scaled"] == 0
    for value, expected in zip(with_guard, without):
        np.testing.assert_array_equal(value, expected)


@pytest.mark.parametrize("poison", [np.nan, 1e30])
def test_the_scaled_check_skips_a_nan_and_an_overflowing_square(tmp_path, monkeypatch, poison):
    """Features of 1e30: finite gradients whose squares overflow, caught as Inf once
    scaled. The step changes no variable, and later steps train."""
    class Poisoned(OptimizerTask):
        def __init__(self):
            super().__init__("adam")
            self.nan_at_batch, self.poison = 2, poison

    trainer = tputrain.Trainer(Poisoned(), str(tmp_path / "t"), strategy=strategy_for(1),
                               train_steps=4, steps_per_loop=1, global_batch_size=16,
                               checkpoint_every=10**9, eval_steps=1,
                               guard=NonFiniteGuard(policy="skip"))
    variables = list(trainer.model.variables) + list(trainer.optimizer.variables)
    calls = spy_checks(monkeypatch)
    trainer.train(num_steps=2)
    assert calls["scaled"] >= 1 and calls["exact"] == 0
    before = [np.array(v.numpy()) for v in variables]
    trainer.train(num_steps=1)
    assert int(trainer.guard.nonfinite_steps.numpy()) == 1
    for variable, value in zip(variables, before):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)
    trainer.train(num_steps=1)
    assert int(trainer.optimizer.iterations.numpy()) == 3
    assert all(np.all(np.isfinite(v.numpy())) for v in variables)


def test_scale_loss_outside_the_step_is_kerass_own(tmp_path):
    """Only the train step's trace scales: a user's action or the FLOP count calling
    `optimizer.scale_loss` (or `Task.compute_gradients`) later gets true values."""
    task = OptimizerTask()
    trainer, _ = train_state(tmp_path, "t", task, NonFiniteGuard(policy="raise"))
    assert float(trainer.optimizer.scale_loss(tf.constant(3.0))) == 3.0
    batch = next(iter(task.build_inputs("train", trainer.inputs.input_context())))
    gradients, _, _ = task.compute_gradients(batch, trainer.model, trainer.optimizer, 16)
    with tf.GradientTape() as tape:
        loss = task.total_loss(batch[1], trainer.model(batch[0], training=True),
                               trainer.model, 16, 1)
    expected = tape.gradient(loss, trainer.model.trainable_variables)
    for gradient, reference in zip(gradients, expected):
        np.testing.assert_allclose(gradient.numpy(), reference.numpy(), rtol=1e-6)


class PairTask(tputrain.Task):
    """A 2-output linear model on 8 features; the labels weight `o0 - o1` in the loss,
    so a label of K gives kernel gradients of +K and -K in one row."""

    def __init__(self, labels: np.ndarray, hidden_dtype: str | None = None):
        rng = np.random.RandomState(0)
        self.x = rng.randn(len(labels), 8).astype(np.float32)
        self.x[32:48] = 0.0
        self.x[32:48, 0] = 1.0
        self.y, self.hidden_dtype = labels.astype(np.float32), hidden_dtype

    def build_model(self):
        inputs = x = keras.Input((8,), name="x")
        if self.hidden_dtype:
            x = keras.layers.Dense(8, dtype=self.hidden_dtype)(x)
        outputs = keras.layers.Dense(2, use_bias=False, dtype="float32")(x)
        return keras.Model({"x": inputs}, outputs)

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        data = tf.data.Dataset.from_tensor_slices(({"x": self.x}, self.y))
        return (data.repeat() if split == "train" else data).batch(batch, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        outputs = tf.cast(outputs, tf.float32)
        return labels * (outputs[:, 0] - outputs[:, 1]) + 0.5 * tf.reduce_sum(outputs**2, -1)

    def build_optimizer(self):
        return tputrain.build_optimizer("sgd", learning_rate=0.01)


def test_the_scaled_check_skips_gradients_whose_squared_norm_overflows(tmp_path):
    """Gradients of +1.5e19 and -1.5e19: each square is finite, their sum is not
    (Adafactor's row means, LAMB's norms, clipping would be NaN). The scaled sums
    must not cancel them: the step is skipped as under the exact check."""
    labels = np.zeros(256)
    labels[32:48] = 1.5e19  # the third batch of 16
    for scaled in (True, False):
        trainer, _ = train_state(tmp_path, f"s{scaled}", PairTask(labels),
                                 NonFiniteGuard(policy="skip", scaled_check=scaled))
        assert int(trainer.guard.nonfinite_steps.numpy()) == 1, scaled
        assert np.all(np.abs(trainer.model.get_weights()[0]) < 10)


@pytest.mark.parametrize("hidden_dtype", [pytest.param("float16", marks=pytest.mark.slow),
                                         "mixed_float16"])
def test_a_model_computing_in_float16_keeps_the_exact_check(tmp_path, monkeypatch,
                                                            hidden_dtype):
    """A scaled backward pass would overflow float16: the exact check, and no skips."""
    calls = spy_checks(monkeypatch)
    labels = np.random.RandomState(1).randn(256)
    trainer, scaled = train_state(tmp_path, "on", PairTask(labels, hidden_dtype),
                                  NonFiniteGuard(policy="raise"))
    assert calls["scaled"] == 0 and calls["exact"] >= 1
    _, exact = train_state(tmp_path, "off", PairTask(labels, hidden_dtype),
                           NonFiniteGuard(policy="raise", scaled_check=False))
    assert int(trainer.optimizer.iterations.numpy()) == 5
    for value, expected in zip(scaled, exact):
        np.testing.assert_array_equal(value, expected)


def test_compute_gradients_replaced_on_the_instance_keeps_the_exact_check(tmp_path,
                                                                         monkeypatch):
    """`task.compute_gradients = fn` (no `scale_loss`) is not Task's own: its true
    gradients must not be divided by the scale."""
    calls = spy_checks(monkeypatch)

    def with_own_gradients():
        task = OptimizerTask("sgd")
        task.compute_gradients = OwnGradientsTask.compute_gradients.__get__(task)
        return task
    trainer, replaced = train_state(tmp_path, "on", with_own_gradients(),
                                    NonFiniteGuard(policy="raise"))
    assert calls["scaled"] == 0 and calls["exact"] >= 1
    _, exact = train_state(tmp_path, "off", with_own_gradients(),
                           NonFiniteGuard(policy="raise", scaled_check=False))
    for value, expected in zip(replaced, exact):
        np.testing.assert_array_equal(value, expected)



def _square_passes(function, *args) -> int:
    """Fusions of XLA's optimized program for `function(*args)` that square a value."""
    hlo = tf.function(function, jit_compile=True).experimental_get_compiler_ir(*args)(
        stage="optimized_hlo")
    entry = hlo[hlo.index("\nENTRY"):]
    return entry.count('op_type="Square"')


def test_under_clipping_the_check_adds_no_pass_over_a_sparse_gradient():
    """Under global-norm clipping the check is clipping's own norm, computed once by XLA,
    for an embedding's sparse gradient (IndexedSlices) too: the program that checks and
    clips squares as many values as the one that only clips."""
    from tputrain.fault_tolerance.guard import _gradients_finite

    optimizer = keras.optimizers.Adam(global_clipnorm=1.0)
    indices = tf.constant([3, 1, 3, 0, 2, 3, 1, 0])

    def gradients(values, kernel):
        return [tf.IndexedSlices(values, indices, tf.constant([4, 64])), kernel]

    def clipped(values, kernel):
        return [tf.convert_to_tensor(g) for g in optimizer._clip_gradients(gradients(values, kernel))]

    def checked_and_clipped(values, kernel):
        finite = _gradients_finite(gradients(values, kernel), in_xla=True, clipping=True)
        return [tf.where(finite, g, 0.0) for g in clipped(values, kernel)]

    args = (tf.ones([8, 64]), tf.ones([64, 32]))
    assert _square_passes(checked_and_clipped, *args) == _square_passes(clipped, *args)


class BatchNormTask(FaultTask):
    """FaultTask with BatchNormalization: its moving statistics are written by the
    forward pass, not by the optimizer the guard skips."""

    def build_model(self):
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(self.hidden, activation="relu")(inputs)
        h = keras.layers.BatchNormalization()(h)
        return keras.Model({"x": inputs}, keras.layers.Dense(2, dtype="float32")(h))


@pytest.mark.parametrize("replicas, jit_compile", [
    (1, "auto"), (1, False), (2, "auto"), pytest.param(2, False, marks=pytest.mark.slow)])
def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were(tmp_path, replicas,
                                                                 jit_compile):
    """A batch of NaN features: the step is skipped, and the moving statistics its
    forward pass computed from NaN are not kept (they made every later save fail)."""
    trainer = tputrain.Trainer(
        BatchNormTask(dropout=0.0, nan_at_batch=2 * replicas), str(tmp_path / "t"),  # step 2
        strategy=strategy_for(replicas), train_steps=4, steps_per_loop=1,
        global_batch_size=16, checkpoint_every=10**9, eval_steps=1, jit_compile=jit_compile,
        guard=NonFiniteGuard(policy="skip"))
    trainer.train(num_steps=2)
    statistics = list(trainer.model.non_trainable_variables)
    assert len(statistics) == 2
    before = [np.array(v.numpy()) for v in statistics]
    trainer.train(num_steps=1)  # the NaN batch; saves at the end
    assert int(trainer.guard.nonfinite_steps.numpy()) == 1
    for variable, value in zip(statistics, before):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)
    trainer.train(num_steps=1)
    assert all(np.isfinite(v.numpy()).all() for v in statistics)
