"""tputrain/loop/step.py: what jit_compile="auto" compiles, and that it keeps the maths.

Under mixed_bfloat16 on a CPU the matmuls stay on oneDNN and only the optimizer's
update and the GELUs are XLA programs; these tests pin that plan and check the step
against the uncompiled one.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import FaultTask
from tiny import strategy_for, weights
from tputrain.loop import step as step_module
from tputrain.loop.step import ElementwiseFusion, XlaPlan, exact_gelu, layer_norm
from tputrain.precision import to_float32
from tputrain.tasks import SyntheticLMTask


class SmallLM(SyntheticLMTask):
    """A one-block LM (layer norms and a GELU) trained with SGD: without Adam's
    division by the gradient's size, bf16 rounding differences stay rounding-sized."""

    def __init__(self):
        super().__init__(vocab_size=64, sequence_length=16, width=32, num_layers=1,
                         num_heads=2)

    def build_optimizer(self):
        return tputrain.build_optimizer("sgd", learning_rate=0.1)


def make_trainer(tmp_path, name, precision="mixed_bfloat16", task=None, replicas=1, **kwargs):
    options = dict(train_steps=6, steps_per_loop=3, global_batch_size=8,
                   checkpoint_every=10**9, eval_steps=1, precision=precision, seed=0)
    options.update(kwargs)
    return tputrain.Trainer(task or SmallLM(), str(tmp_path / name),
                            strategy=strategy_for(replicas), **options)


def test_auto_plan_for_mixed_bfloat16_on_cpu_compiles_update_and_elementwise_only(tmp_path):
    steps = make_trainer(tmp_path, "bf16")._steps
    plan = steps.plan()
    assert plan == XlaPlan(
        whole_step=False, gradients_only=False,
        why="auto: for mixed_bfloat16 on CPU the optimizer update and GELUs only (matmuls "
            "stay on oneDNN)", apply_only=True, fuse_elementwise=True, fuse_batch_norm=True)
    assert steps.xla_plan() == (False, False, plan.why)  # what the start-up line logs


# Where "auto" leaves the forward pass to TensorFlow's kernels, batch norms run fused
# (loop/batch_norm.py); "off" swaps nothing.
@pytest.mark.parametrize("precision, kwargs, expected", [
    ("float32", {}, XlaPlan(True, False, "auto: the whole step, if it compiles")),
    ("mixed_bfloat16", {"jit_compile": False}, XlaPlan(False, False, "off")),
    # N replicas: the optimizer update is one XLA program a device (loop/update.py).
    ("mixed_bfloat16", {"replicas": 2}, XlaPlan(
        False, False, "auto: the optimizer update on each of 2 replicas' devices",
        apply_per_replica=True, fuse_batch_norm=True)),
    ("mixed_float16", {"replicas": 2}, XlaPlan(
        False, False, "auto: off on 2 replicas (precision mixed_float16)",
        fuse_batch_norm=True)),
    ("mixed_float16", {}, XlaPlan(False, False, "auto: off for mixed_float16 on CPU",
                                  fuse_batch_norm=True)),
])
def test_other_plans_are_unchanged(tmp_path, precision, kwargs, expected):
    trainer = make_trainer(tmp_path, "t", precision, global_batch_size=8, **kwargs)
    assert trainer._steps.plan() == expected


def _distance(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((x.astype(np.float64) - y) ** 2) for x, y in zip(a, b))))


@pytest.mark.parametrize("policy", ["raise", pytest.param(None, marks=pytest.mark.slow)])
def test_bf16_auto_step_matches_the_uncompiled_step(tmp_path, policy):
    """After 6 steps the weights are as close to jit_compile=False's as bf16 rounding
    allows (measured: 1.2% of the update apart, while bf16 itself is 1.5% from
    float32), and no further from float32's; the layers are back to their own
    methods after the step traced (eval and export see them)."""
    guard = lambda: tputrain.NonFiniteGuard(policy=policy)  # noqa: E731
    initial = weights(make_trainer(tmp_path, "initial", jit_compile=False))
    auto = make_trainer(tmp_path, "auto", guard=guard())
    auto_logs = auto.train()
    plain = make_trainer(tmp_path, "plain", jit_compile=False, guard=guard())
    plain_logs = plain.train()
    reference = make_trainer(tmp_path, "fp32", "float32", jit_compile=False)
    reference.train()
    update = _distance(weights(reference), initial)
    assert auto_logs["loss"] == pytest.approx(plain_logs["loss"], rel=1e-2)
    assert _distance(weights(auto), weights(plain)) < 0.03 * update
    bf16_error = _distance(weights(plain), weights(reference))
    assert _distance(weights(auto), weights(reference)) < 1.25 * bf16_error
    if policy:
        assert auto.guard._select  # the update's XLA program holds the guard's select
    fused = tf.types.experimental.PolymorphicFunction
    for layer in auto.model._flatten_layers(include_self=False, recursive=True):
        assert "call" not in vars(layer)
        assert not isinstance(getattr(layer, "activation", None), fused)


def _gradients(policy: str, fuse: bool) -> tuple[list[np.ndarray], int]:
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    task = SyntheticLMTask(vocab_size=64, sequence_length=16, width=32, num_layers=2,
                           num_heads=2)
    model = task.build_model()
    tokens = tf.random.stateless_uniform([4, 16], [1, 2], 0, 64, tf.int32)
    labels = tf.random.stateless_uniform([4, 16], [3, 4], 0, 64, tf.int32)
    fusion = ElementwiseFusion(model)

    @tf.function
    def gradients():
        with fusion.active() if fuse else contextlib.nullcontext():
            with tf.GradientTape() as tape:
                outputs = to_float32(model({"tokens": tokens}, training=True))
                loss = tf.reduce_mean(task.compute_loss(labels, outputs))
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]

    graph = str(gradients.get_concrete_function().graph.as_graph_def())
    assert ("_XlaMustCompile" in graph) == fuse
    return [g.numpy() for g in gradients()], len(fusion.swaps)

@pytest.mark.slow

def test_fused_elementwise_layers_are_as_close_to_float32_as_unfused():
    reference, _ = _gradients("float32", fuse=False)
    plain, swaps = _gradients("mixed_bfloat16", fuse=False)
    fused, _ = _gradients("mixed_bfloat16", fuse=True)
    assert swaps == 7  # per block, the MLP's GELU and two layer norms; the final norm

    def error(values):  # relative error of each gradient, ignoring ~0 ones (key biases)
        return [np.linalg.norm(v - r) / np.linalg.norm(r) for v, r in zip(values, reference)
                if np.linalg.norm(r) > 1e-3 * max(np.linalg.norm(x) for x in reference)]
    assert np.median(error(fused)) < 0.05
    assert np.median(error(fused)) < 1.5 * np.median(error(plain))


def test_guard_skips_a_nan_step_under_the_bf16_plan(tmp_path):
    """The update alone is an XLA program; the guard's verdict still keeps a NaN out."""
    trainer = make_trainer(tmp_path, "nan", task=FaultTask(dropout=0.0, nan_at_batch=3),
                           global_batch_size=16, train_steps=6,
                           guard=tputrain.NonFiniteGuard(policy="skip"))
    assert trainer._steps.plan().apply_only
    trainer.train()
    assert int(trainer.guard.nonfinite_steps.numpy()) == 1
    assert int(trainer.optimizer.iterations.numpy()) == 5
    assert all(np.all(np.isfinite(w)) for w in weights(trainer))


class OptimizerFaultTask(FaultTask):
    """FaultTask with one of tputrain's optimizers, weight decay and clipping: slots,
    decay and a global norm that a NaN would poison if any part of the update ran."""

    def __init__(self, optimizer: str, poison: float = np.nan, replicas: int = 1, **kwargs):
        # Replicas take per-replica batches r*k .. r*k+r-1 at step k+1: the third step.
        super().__init__(dropout=0.0, nan_at_batch=2 * replicas, poison=poison)
        self.optimizer, self.options = optimizer, kwargs

    def build_optimizer(self):
        options = {"weight_decay": 0.01, "global_clipnorm": 1.0, **self.options}
        return tputrain.build_optimizer(self.optimizer, learning_rate=0.01, **options)


@pytest.mark.parametrize("precision, optimizer, options", [
    ("float32", "adamw", {}), ("float32", "adam", {}), ("float32", "sgd", {}),
    ("float32", "lamb", {}), ("float32", "lars", {}),
    ("float32", "adam", {"use_ema": True, "ema_overwrite_frequency": None}),
    ("float32", "adam", {"global_clipnorm": None}),  # the check without clipping's norm
    ("mixed_bfloat16", "adamw", {})])
def test_a_guarded_nan_step_under_xla_changes_no_variable(tmp_path, precision, optimizer,
                                                         options):
    """With the update inside an XLA program (the whole step in float32, the update
    alone in bf16), a NaN step leaves every model and optimizer variable bit for bit,
    for every optimizer (an EMA is written directly, not through `optimizer.assign`)."""
    trainer = make_trainer(tmp_path, precision, precision, global_batch_size=16,
                           task=OptimizerFaultTask(optimizer, **options), steps_per_loop=1,
                           train_steps=4, guard=tputrain.NonFiniteGuard(policy="skip"))
    plan = trainer._steps.plan()
    assert plan.whole_step or plan.apply_only
    variables = list(trainer.model.variables) + list(trainer.optimizer.variables)
    trainer.train(num_steps=2)
    before = [v.numpy().copy() for v in variables]
    trainer.train(num_steps=1)  # batch 2: NaN features
    assert int(trainer.guard.nonfinite_steps.numpy()) == 1
    for variable, value in zip(variables, before):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)
    trainer.train(num_steps=1)  # a good step updates again
    assert int(trainer.optimizer.iterations.numpy()) == 3
    assert any(not np.array_equal(v.numpy(), b) for v, b in zip(variables, before))
    assert all(np.all(np.isfinite(v.numpy())) for v in variables)


@pytest.mark.parametrize("replicas, jit_compile, options", [
    (1, "auto", {}), (1, False, {}), pytest.param(2, "auto", {}, marks=pytest.mark.slow),
    (1, "auto", {"global_clipnorm": None, "weight_decay": None})])
def test_a_finite_gradient_whose_square_overflows_is_a_nonfinite_step(
        tmp_path, replicas, jit_compile, options):
    """Features of 1e30 give a finite loss and finite gradients (~1e30) whose squares
    overflow float32: global-norm clipping would scale every gradient by NaN, and
    Adam's second moment would become inf for good. The guard must skip that step,
    on every path (one XLA program, no XLA, a conditional on 2 replicas)."""
    task = OptimizerFaultTask("adam" if options else "adamw", poison=1e30, replicas=replicas,
                              **options)
    trainer = make_trainer(tmp_path, "t", "float32", task=task, replicas=replicas,
                           global_batch_size=16, steps_per_loop=1, train_steps=4,
                           jit_compile=jit_compile, guard=tputrain.NonFiniteGuard(policy="skip"))
    variables = list(trainer.model.variables) + list(trainer.optimizer.variables)
    trainer.train(num_steps=2)
    before = [np.array(v.numpy()) for v in variables]
    trainer.train(num_steps=1)  # the third step: features of 1e30
    assert int(trainer.guard.nonfinite_steps.numpy()) == 1
    for variable, value in zip(variables, before):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)
    trainer.train(num_steps=1)
    assert all(np.all(np.isfinite(v.numpy())) for v in variables)


def _gelu_and_gradient(fn, x: tf.Tensor) -> tuple[np.ndarray, np.ndarray]:
    upstream = tf.cast(tf.linspace(-2.0, 3.0, int(tf.size(x))), x.dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    gradient = tape.gradient(y, x, output_gradients=upstream)
    return (tf.cast(y, tf.float64).numpy(), tf.cast(gradient, tf.float64).numpy())


def test_exact_gelu_is_keras_gelu_and_its_gradient():
    """In float32 the same function and derivative as Keras's exact GELU (autodiff),
    over the range where GELU bends, the tails and zero."""
    x = tf.concat([tf.linspace(-12.0, 12.0, 4001), [0.0, -1e-30, 1e-30, 40.0, -40.0]], 0)
    value, gradient = _gelu_and_gradient(exact_gelu, x)
    keras_value, keras_gradient = _gelu_and_gradient(keras.activations.gelu, x)
    np.testing.assert_allclose(value, keras_value, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(gradient, keras_gradient, rtol=2e-5, atol=1e-6)


def test_exact_gelu_in_bf16_is_within_a_rounding_of_the_float32_gelu():
    """In bf16 it computes in float32 and rounds once: within half a bf16 step of the
    exact value (Keras's bf16 GELU, rounding at every op, is not)."""
    x32 = tf.linspace(-6.0, 6.0, 2001)
    x16 = tf.cast(x32, tf.bfloat16)
    exact, exact_gradient = _gelu_and_gradient(keras.activations.gelu, tf.cast(x16, tf.float32))
    value, gradient = _gelu_and_gradient(exact_gelu, x16)
    assert exact_gelu(x16).dtype == tf.bfloat16
    half_step = np.abs(exact) * 2.0 ** -8 + 1e-30  # bf16 keeps 8 significant bits
    assert np.all(np.abs(value - exact) <= half_step)
    assert np.all(np.abs(gradient - exact_gradient) <= np.abs(exact_gradient) * 2.0 ** -7 + 1e-6)


class _Scaled:
    """An activation that is a callable object compared by value: unhashable."""

    def __init__(self, factor: float):
        self.factor = factor

    def __eq__(self, other):
        return isinstance(other, _Scaled) and other.factor == self.factor

    def __call__(self, x):
        return x * self.factor


def test_fusion_swaps_only_the_gelu_and_accepts_any_activation():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="gelu")(inputs)
    hidden = keras.layers.Dense(8, activation=_Scaled(0.5))(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="relu")(hidden))
    fusion = ElementwiseFusion(model)
    assert [(layer.name, name, fn) for layer, name, fn in fusion.swaps] == [
        (model.layers[1].name, "activation", exact_gelu)]
    x = tf.random.stateless_normal([3, 4], [5, 6])
    with fusion.active():
        fused = model(x)
    np.testing.assert_allclose(fused, model(x), rtol=1e-5, atol=1e-6)
    assert model.layers[1].activation is keras.activations.gelu  # swapped back


def _layer_norm_and_gradients(layer: keras.layers.LayerNormalization, x: tf.Tensor,
                              fn=None) -> list[np.ndarray]:
    upstream = tf.cast(tf.reshape(tf.linspace(-2.0, 3.0, int(tf.size(x))), x.shape), x.dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x) if fn is None else fn(x)
    grads = tape.gradient(y, [x, layer.gamma, layer.beta], output_gradients=upstream)
    return [tf.cast(t, tf.float64).numpy() for t in [y, *grads]]


@pytest.mark.parametrize("shape", [(4, 6, 32), (5, 16)])
def test_layer_norm_is_keras_layer_norm_and_its_gradient(shape):
    """In float32 the same values and gradients (input, scale, offset) as Keras's
    LayerNormalization with TensorFlow's automatic gradient."""
    keras.mixed_precision.set_global_policy("float32")
    layer = keras.layers.LayerNormalization(epsilon=1e-5)
    layer.build(shape)
    layer.gamma.assign(tf.random.stateless_normal(shape[-1:], [1, 2]) + 1.0)
    layer.beta.assign(tf.random.stateless_normal(shape[-1:], [3, 4]))
    x = tf.random.stateless_normal(shape, [5, 6]) * 3.0 + 1.0
    expected = _layer_norm_and_gradients(layer, x)
    ours = _layer_norm_and_gradients(
        layer, x, lambda v: layer_norm(v, layer.gamma.value, layer.beta.value, 1e-5))
    for got, want in zip(ours, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_layer_norm_swap_covers_the_last_axis_in_bf16_and_leaves_other_axes_to_keras(
        monkeypatch):
    """Swapped in while a bf16 step traces: output in the layer's compute dtype, within
    a bf16 rounding of Keras's; a norm over another axis runs Keras's own call."""
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return layer_norm(*args)
    monkeypatch.setattr(step_module, "layer_norm", counted)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        inputs = keras.Input((6, 32))
        last = keras.layers.LayerNormalization()
        first = keras.layers.LayerNormalization(axis=1)
        model = keras.Model(inputs, first(last(inputs)))
        fusion = ElementwiseFusion(model)
        assert [(layer, name) for layer, name, _ in fusion.swaps] == [(last, "call"),
                                                                    (first, "call")]
        x = tf.random.stateless_normal([3, 6, 32], [7, 8]) * 2.0
        plain = _layer_norm_and_gradients(last, tf.cast(x, tf.bfloat16))
        with fusion.active():
            swapped = _layer_norm_and_gradients(last, tf.cast(x, tf.bfloat16))
            assert last(x).dtype == tf.bfloat16
            np.testing.assert_array_equal(model(x), _then_keras_axis_1(model, x))
        assert "call" not in vars(last)  # swapped back
        assert len(calls) == 4  # the last-axis norm's three calls and the model's; not axis 1
        half_step = np.abs(plain[0]) * 2.0 ** -8 + 1e-6
        assert np.all(np.abs(swapped[0] - plain[0]) <= 2 * half_step)
        for got, want in zip(swapped[1:], plain[1:]):
            assert np.linalg.norm(got - want) < 0.02 * np.linalg.norm(want)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _then_keras_axis_1(model: keras.Model, x: tf.Tensor) -> np.ndarray:
    """The model's first norm (swapped while active), then Keras's own `call` of the
    axis-1 norm: what the model must give if the swap leaves that layer to Keras."""
    last, first = model.layers[1], model.layers[2]
    return type(first).call(first, tf.cast(last(x), first.compute_dtype)).numpy()


# ------------------------------------------- several steps in one XLA program launch

def program_trainer(tmp_path, name, task=None, **kwargs):
    """One replica, the whole step in XLA: `steps_per_program` applies."""
    options = dict(train_steps=12, steps_per_loop=4, global_batch_size=16,
                   checkpoint_every=10**6, eval_steps=1, jit_compile=True)
    options.update(kwargs)
    from tiny import TinyTask
    return tputrain.Trainer(task or TinyTask(), str(tmp_path / name), strategy=strategy_for(1),
                            **options)


def test_steps_per_program_trains_bitwise_as_one_step_a_launch(tmp_path):
    """4 steps a launch, and 4 a launch with loops of 8 then 6 (the 6 runs one step a
    launch): the same weights, optimizer slots and step as one step a launch."""
    def trained(name, **kwargs):
        trainer = program_trainer(tmp_path, name, **kwargs)
        trainer.train()
        return trainer

    def same(a, b):
        return (all(np.array_equal(x, y) for x, y in zip(weights(a), weights(b)))
                and all(np.array_equal(x.numpy(), y.numpy())
                        for x, y in zip(a.optimizer.variables, b.optimizer.variables)))

    one, four = trained("one", steps_per_program=1), trained("four", steps_per_program=4)
    assert (one.steps_per_program, four.steps_per_program) == (1, 4)
    assert int(four.step.numpy()) == 12 and same(one, four)
    mixed = trained("mixed", steps_per_program=4, steps_per_loop=8, train_steps=14)
    assert int(mixed.step.numpy()) == 14
    assert same(trained("one14", steps_per_program=1, train_steps=14), mixed)

def test_a_program_of_several_steps_traces_the_step_once(tmp_path):
    """The program's while loop sums the step's logs from zeros shaped by a trace of
    the step; that same trace runs in the loop (a second trace cost every run's
    start-up as much again)."""
    from tiny import TraceCountingTask

    task = TraceCountingTask()
    trainer = program_trainer(tmp_path, "counted", task=task, steps_per_program=4,
                              train_steps=8, report_mfu=False)
    trainer.train()
    assert trainer.steps_per_program == 4 and int(trainer.step.numpy()) == 8
    assert task.traces == 1


@pytest.mark.slow
def test_a_resume_between_programs_is_bitwise(tmp_path):
    """Stopped at step 4 and resumed to 12 (4 a launch) = 12 uninterrupted steps."""
    first = program_trainer(tmp_path, "resumed", steps_per_program=4, train_steps=4)
    first.train()
    resumed = program_trainer(tmp_path, "resumed", steps_per_program=4)
    resumed.train()
    straight = program_trainer(tmp_path, "straight", steps_per_program=1)
    straight.train()
    assert all(np.array_equal(a, b) for a, b in zip(weights(resumed), weights(straight)))


def test_input_ending_inside_a_program_trains_every_batch(tmp_path):
    """10 batches, 4 steps a launch: the third launch has 2 real batches; both train,
    the run stops at step 10 as one step a launch does."""
    from tiny import TinyTask
    ends = {}
    for k in (1, 4):
        trainer = program_trainer(tmp_path, f"end{k}", task=TinyTask(num_examples=160,
                                                                      finite_train=True),
                                  steps_per_program=k, train_steps=20)
        trainer.train()
        ends[k] = trainer
        assert int(trainer.step.numpy()) == 10
    assert all(np.array_equal(a, b) for a, b in zip(weights(ends[1]), weights(ends[4])))


def test_steps_per_program_auto_and_where_it_applies(tmp_path):
    from tputrain.options import TrainerOptions, program_steps
    assert program_steps(TrainerOptions(), batch_bytes=1 << 20) == 25  # steps_per_loop 100
    assert program_steps(TrainerOptions(steps_per_loop=64), batch_bytes=1 << 20) == 32
    assert program_steps(TrainerOptions(), batch_bytes=16 << 20) == 4  # 4 x 16 MiB
    assert program_steps(TrainerOptions(), batch_bytes=100 << 20) == 1
    assert program_steps(TrainerOptions(steps_per_program=7), batch_bytes=1 << 30) == 7
    # Steps of 0.1 s at peak FLOP/s: 2 a launch (a SIGTERM waits for at most 0.25 s
    # of ideal compute); 1 s: one.
    assert program_steps(TrainerOptions(), 1 << 20, ideal_step_seconds=0.1) == 2
    assert program_steps(TrainerOptions(), 1 << 20, ideal_step_seconds=1.0) == 1
    assert program_steps(TrainerOptions(), 1 << 20, ideal_step_seconds=0.001) == 25
    auto = program_trainer(tmp_path, "auto", train_steps=4)
    auto.train()
    assert auto.steps_per_program == 4
    two = tputrain.Trainer(auto.task, str(tmp_path / "two"), strategy=strategy_for(2),
                           train_steps=4, steps_per_loop=4, global_batch_size=16,
                           checkpoint_every=10**6, eval_steps=1)
    two.train()
    assert two.steps_per_program == 1  # several replicas: the step is not one program


def test_a_program_xla_cannot_lower_falls_back_to_one_step_a_launch(tmp_path, monkeypatch,
                                                                    caplog):
    """Should the several-step program not lower (here: a py_function added to it),
    the run goes on one step a launch, says why, and trains every step."""
    import tputrain.loop.host_loop as host_loop

    real = host_loop.steps_program

    def unlowerable(*args, **kwargs):
        program = real(*args, **kwargs)

        @tf.function(jit_compile=True)
        def run(batches, n):
            n = tf.py_function(lambda n: n, [n], tf.int32)
            return program.python_function(batches, tf.reshape(n, []))
        return run
    monkeypatch.setattr(host_loop, "steps_program", unlowerable)
    trainer = program_trainer(tmp_path, "py", steps_per_program=4)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.steps_per_program == 1
    assert int(trainer.step.numpy()) == 12
    assert any("steps per XLA program do not compile" in r.getMessage()
               and "EagerPyFunc" in r.getMessage() for r in caplog.records)


# ------------------------------------- a user's error in the step is not XLA's refusal

from tiny import TinyTask  # noqa: E402


class UserErrorTask(TinyTask):
    """TinyTask whose compute_loss has a bug of the user's: a wrong key, a wrong
    argument, or shapes that do not match."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def compute_loss(self, labels, outputs):
        if self.kind == "key":
            return {"logits": outputs}["logit"]
        if self.kind == "type":
            return keras.losses.sparse_categorical_crossentropy(labels, outputs,
                                                                from_logit=True)
        return outputs + tf.zeros([3, 5])  # "value": a shape mismatch


class OwnTrainStepError(TinyTask):
    """A Task's own train_step (as a ported Keras `train_step`) reading a feature its
    batch does not have."""

    def train_step(self, batch, model, optimizer, metrics, global_batch_size):
        features, labels = batch
        return super().train_step(({"x": features["inputs"]}, labels), model, optimizer,
                                  metrics, global_batch_size)


USER_ERRORS = {"key": (KeyError, "logit"), "type": (TypeError, "from_logit"),
               "value": (ValueError, "Dimensions must be equal"),
               "train_step": (KeyError, "inputs")}
_XLA_LINES = ("does not compile with XLA", "do not compile", "runs without XLA")


def _says_xla_refused(records) -> list[str]:
    return [r.getMessage() for r in records if any(s in r.getMessage() for s in _XLA_LINES)]


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("kind", sorted(USER_ERRORS))
def test_a_user_error_in_the_step_is_raised_as_itself_without_an_xla_line(
        tmp_path, caplog, kind, replicas):
    """jit_compile="auto": an error the step also raises without XLA is the user's: it
    is raised with its own type and message, no line says XLA refused the step, and the
    plan stays as it was (one step a launch, or several: both lower the step)."""
    error, message = USER_ERRORS[kind]
    task = OwnTrainStepError() if kind == "train_step" else UserErrorTask(kind)
    trainer = make_trainer(tmp_path, kind, "float32", task=task,
                           replicas=replicas, global_batch_size=16, report_mfu=False)
    plan = trainer._steps.plan()
    with caplog.at_level("INFO"), pytest.raises(error, match=message):
        trainer.train()
    assert _says_xla_refused(caplog.records) == []
    assert trainer._steps.plan() == plan and trainer.jit_compile == "auto"


class TrainingOnlyBug(keras.Model):
    """A subclassed Keras model whose training branch reads a key its input lacks: the
    build (not training) passes, the train step fails."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, inputs, training=False):
        return self.dense(inputs["features"] if training else inputs["x"])


def _training_only_bug() -> keras.Model:
    model = TrainingOnlyBug()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_a_keras_model_whose_call_raises_through_fit_raises_that_error(tmp_path, caplog):
    rng = np.random.default_rng(0)
    train = ({"x": rng.normal(size=(64, 8)).astype(np.float32)},
             rng.integers(0, 2, size=64))
    with caplog.at_level("INFO"), pytest.raises(KeyError, match="features"):
        tputrain.fit(_training_only_bug, train, model_dir=str(tmp_path / "fit"), steps=4, batch_size=16,
                     strategy=strategy_for(1), report_mfu=False)
    assert _says_xla_refused(caplog.records) == []


def test_a_refused_step_is_not_traced_again_to_tell_a_user_error(tmp_path, caplog):
    """A step XLA refuses at lowering (a py_function) runs without XLA after one log
    line; telling a user's error needs no trace without XLA there (an error while
    lowering is XLA's): the step traces once with XLA, once without."""
    from tiny import TraceCountingTask

    class PyFunctionCounted(TraceCountingTask):
        def compute_loss(self, labels, outputs):
            loss = super().compute_loss(labels, outputs)
            return tf.py_function(lambda x: x, [loss], tf.float32)

    task = PyFunctionCounted()
    trainer = program_trainer(tmp_path, "py", task=task, jit_compile="auto",
                              steps_per_program=1, train_steps=4, report_mfu=False)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.jit_compile is False and int(trainer.step.numpy()) == 4
    assert len([m for m in _says_xla_refused(caplog.records) if "EagerPyFunc" in m]) == 1
    assert task.traces == 2


def test_a_user_error_with_mfu_reported_is_not_first_told_as_mfu_not_reported(tmp_path, caplog):
    """report_mfu=True (the default) counts FLOPs by tracing the step before the loop:
    a user's error there is the step's, raised as itself, not first logged as a reason
    MFU is not reported."""
    trainer = make_trainer(tmp_path, "mfu", "float32", task=UserErrorTask("key"),
                           replicas=1, global_batch_size=16, report_mfu=True)
    with caplog.at_level("INFO"), pytest.raises(KeyError, match="logit"):
        trainer.train()
    assert [r.getMessage() for r in caplog.records if "MFU" in r.getMessage()] == []
    assert _says_xla_refused(caplog.records) == []
