"""Trainer: replica equivalence, host loops, resume, eval, errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from events import scalar_points
from tiny import TinyTask, strategy_for, weights


def make_trainer(tmp_path, replicas=1, name="run", **kwargs):
    options = dict(train_steps=6, steps_per_loop=3, global_batch_size=16, checkpoint_every=3)
    options.update(kwargs)
    task = options.pop("task", None) or TinyTask()
    return tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(replicas), **options)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    """make_trainer's default run on 1 device, trained once for both replica counts
    below (one `same_worker` group keeps them on one worker): (weights, final eval logs)."""
    single = make_trainer(tmp_path_factory.mktemp("single_device"), 1, "one")
    single_logs = single.train()
    return weights(single), single_logs


@pytest.mark.same_worker("single_device")
@pytest.mark.parametrize("replicas", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_replicas_match_single_device(tmp_path, single_device, replicas):
    """Same global batch, regularisation included: loss and weights agree to 1e-5."""
    single_weights, single_logs = single_device
    multi = make_trainer(tmp_path, replicas, f"many{replicas}")
    multi_logs = multi.train()
    assert multi.strategy.num_replicas_in_sync == replicas
    assert multi.model.losses, "the test model must carry a regularisation loss"
    for a, b in zip(single_weights, weights(multi)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert multi_logs["loss"] == pytest.approx(single_logs["loss"], rel=1e-5, abs=1e-6)
    assert multi_logs["accuracy"] == pytest.approx(single_logs["accuracy"])


def test_steps_per_loop_matches_single_steps(tmp_path):
    looped = make_trainer(tmp_path, 2, "looped", train_steps=8, steps_per_loop=8, checkpoint_every=8)
    looped.train()
    single = make_trainer(tmp_path, 2, "single", train_steps=8, steps_per_loop=1, checkpoint_every=8)
    single.train()
    assert int(looped.step.numpy()) == int(single.step.numpy()) == 8
    for a, b in zip(weights(looped), weights(single)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.start_early(4)
def test_resume_continues_and_matches_uninterrupted(tmp_path):
    """Stopping at step 4 and continuing to 8 equals training to 8 directly (dropout on)."""
    task = lambda: TinyTask(dropout=0.3)  # noqa: E731
    full = make_trainer(tmp_path, 2, "full", task=task(), train_steps=8, checkpoint_every=4)
    full.train()
    first = make_trainer(tmp_path, 2, "split", task=task(), train_steps=4, checkpoint_every=4)
    first.train()
    second = make_trainer(tmp_path, 2, "split", task=task(), train_steps=8, checkpoint_every=4)
    second.train()
    assert int(second.step.numpy()) == 8
    for a, b in zip(weights(full), weights(second)):
        np.testing.assert_array_equal(a, b)


def test_rerun_after_finish_does_not_train(tmp_path):
    first = make_trainer(tmp_path, 1, "done", train_steps=4)
    first.train()
    again = make_trainer(tmp_path, 1, "done", train_steps=4)
    before = weights(again)  # freshly initialised
    logs = again.train()
    assert int(again.step.numpy()) == 4
    assert "accuracy" in logs
    for a, b in zip(weights(first), weights(again)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(before, weights(again)))


def test_train_twice_on_one_trainer_continues(tmp_path):
    """A notebook calls train() again after raising train_steps: same as one longer run."""
    once = make_trainer(tmp_path, 2, "once", train_steps=8, checkpoint_every=4)
    once.train()
    twice = make_trainer(tmp_path, 2, "twice", train_steps=4, checkpoint_every=4)
    twice.train()
    twice.train_steps = 8
    twice.train()
    assert int(twice.step.numpy()) == 8
    for a, b in zip(weights(once), weights(twice)):
        np.testing.assert_array_equal(a, b)


class OddEvalTask(TinyTask):
    """Eval split of 100 examples: no global batch of 16 divides it."""

    def build_inputs(self, split, input_context):
        if split == "train":
            return super().build_inputs(split, input_context)
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": self.x[:100]}, self.y[:100]))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return dataset.batch(batch).map(lambda *b: tputrain.data.pad_to_batch(b, batch))


@pytest.mark.start_early(2)
@pytest.mark.parametrize("replicas,input_mode", [
    (1, "host"), pytest.param(4, "host", marks=pytest.mark.slow), (2, "distributed")])
def test_padded_eval_counts_every_example_once(tmp_path, replicas, input_mode):
    """100 examples in per-replica batches of 16/replicas: the padding counts for nothing."""
    trainer = make_trainer(tmp_path, replicas, f"odd{replicas}", task=OddEvalTask(l2=1e-2),
                           input_mode=input_mode, train_steps=3)
    logs = trainer.train()
    task = trainer.task
    outputs = trainer.model({"x": task.x[:100]}, training=False)
    per_example = keras.losses.sparse_categorical_crossentropy(task.y[:100], outputs,
                                                               from_logits=True)
    expected_loss = float(np.mean(per_example) + sum(float(l) for l in trainer.model.losses))
    expected_accuracy = float(np.mean(np.argmax(outputs, -1) == task.y[:100]))
    assert logs["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert logs["accuracy"] == pytest.approx(expected_accuracy)
    assert 0.0 < expected_accuracy < 1.0  # a real check: some right, some wrong


def test_keep_checkpoints(tmp_path):
    trainer = make_trainer(tmp_path, 1, "keep", train_steps=10, steps_per_loop=2,
                           checkpoint_every=2, keep_checkpoints=2)
    trainer.train()
    kept = sorted(tf.io.gfile.glob(str(tmp_path / "keep" / "checkpoints" / "ckpt-*.index")))
    assert [p.rsplit("-", 1)[-1] for p in kept] == ["10.index", "8.index"]


def test_finite_train_data_stops_cleanly(tmp_path, caplog):
    """256 examples / 16 = 16 steps; asking for 40 stops at 16, no step applied twice,
    and the warning says the run is short of train_steps and how to train them all
    (it said only "train input ended at step 16")."""
    trainer = make_trainer(tmp_path, 2, "finite", task=TinyTask(finite_train=True),
                           train_steps=40, steps_per_loop=5, checkpoint_every=40)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert int(trainer.step.numpy()) == 16
    said = [r.getMessage() for r in caplog.records if "train input ended" in r.getMessage()]
    assert len(said) == 1 and "step 16 of 40" in said[0] and "repeat()" in said[0], said


def test_distributed_input_mode_matches_host_mode(tmp_path):
    host = make_trainer(tmp_path, 2, "host", input_mode="host")
    host.train()
    dist = make_trainer(tmp_path, 2, "dist", input_mode="distributed")
    dist.train()
    for a, b in zip(weights(host), weights(dist)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_summaries_written(tmp_path):
    trainer = make_trainer(tmp_path, 1, "tb", train_steps=4, steps_per_loop=2)
    trainer.train()
    tags = set(scalar_points(tmp_path / "tb" / "train"))
    assert {"loss", "accuracy", "learning_rate", "examples_per_second"} <= tags


def test_indivisible_global_batch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not divisible by 4 replicas: use a multiple of 4"):
        make_trainer(tmp_path, 4, "bad", global_batch_size=18)


def test_dynamic_shapes_rejected_before_anything_is_written(tmp_path):
    class Ragged(TinyTask):
        def build_inputs(self, split, input_context):
            return super().build_inputs(split, input_context).unbatch().batch(16)

    with pytest.raises(ValueError, match="static shapes"):
        make_trainer(tmp_path, 1, "dyn", task=Ragged())
    assert not (tmp_path / "dyn").exists()


def test_mixed_bfloat16_trains_on_two_replicas(tmp_path):
    trainer = make_trainer(tmp_path, 2, "bf16", precision="mixed_bfloat16", train_steps=6)
    logs = trainer.train()
    assert trainer.precision == "mixed_bfloat16"
    assert all(v.dtype == "float32" for v in trainer.model.trainable_variables)
    assert np.isfinite(logs["loss"])


# ------------------------------------------- compiled steps: accumulation, XLA, MFU, profiling


def test_gradient_accumulation_matches_one_large_batch(tmp_path):
    """4 micro-batches of 4 (on 2 replicas) give the update of one batch of 16."""
    large = make_trainer(tmp_path, 2, "large", train_steps=4, steps_per_loop=2)
    large_logs = large.train()
    micro = make_trainer(tmp_path, 2, "micro", train_steps=4, steps_per_loop=2,
                         accumulation_steps=4)
    micro_logs = micro.train()
    assert int(micro.step.numpy()) == int(micro.optimizer.iterations.numpy()) == 4
    for a, b in zip(weights(large), weights(micro)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert micro_logs["loss"] == pytest.approx(large_logs["loss"], rel=1e-5)


def test_accumulation_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="use a multiple of 8"):
        make_trainer(tmp_path, 2, "odd", global_batch_size=12, accumulation_steps=4)

    class CustomStep(TinyTask):
        def train_step(self, *args):
            return super().train_step(*args)

    with pytest.raises(ValueError, match="override Task.compute_gradients"):
        make_trainer(tmp_path, 1, "custom", task=CustomStep(), accumulation_steps=2)
    with pytest.raises(ValueError, match="override compute_gradients"):
        make_trainer(tmp_path, 2, "custom2", task=CustomStep(), jit_compile=True)


@pytest.mark.parametrize("replicas", [1, 2])
def test_jit_compile_matches_uncompiled(tmp_path, replicas):
    """One replica compiles the whole step; two compile forward/backward only."""
    plain = make_trainer(tmp_path, replicas, "plain", task=TinyTask(dropout=0.0),
                         jit_compile=False)
    plain.train()
    compiled = make_trainer(tmp_path, replicas, "xla", task=TinyTask(dropout=0.0),
                            jit_compile=True, accumulation_steps=2)
    compiled.train()
    for a, b in zip(weights(plain), weights(compiled)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


class PyFunctionLoss(TinyTask):
    """A loss through tf.py_function: no XLA kernel, so the step cannot compile."""

    def compute_loss(self, labels, outputs):
        loss = super().compute_loss(labels, outputs)
        return tf.py_function(lambda x: x, [loss], tf.float32)


def test_jit_compile_auto_compiles_one_replica_and_falls_back(tmp_path, caplog):
    """The default compiles the whole step where XLA can lower it; where it cannot,
    the run goes on uncompiled and says why, with the same weights."""
    auto = make_trainer(tmp_path, 1, "auto")
    assert auto.jit_compile == "auto"
    auto.train()
    assert auto.jit_compile == "auto"
    # With the guard on: one XLA program, the guard's selects inside the update, and
    # the step counter and the guard's observation inside it too.
    assert auto.guard._select
    assert auto._steps.counted_in_step and int(auto.step.numpy()) == auto.train_steps
    plain = make_trainer(tmp_path, 1, "plain", jit_compile=False)
    plain.train()
    for a, b in zip(weights(auto), weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    fallback = make_trainer(tmp_path, 1, "py", task=PyFunctionLoss())
    with caplog.at_level("WARNING"):
        fallback.train()
    assert fallback.jit_compile is False
    assert not fallback.guard._select  # uncompiled: the guard's conditional again
    assert not fallback._steps.counted_in_step  # the host loop counts
    assert int(fallback.step.numpy()) == fallback.train_steps
    assert any("does not compile with XLA" in r.getMessage() and "EagerPyFunc" in r.getMessage()
               for r in caplog.records)
    for a, b in zip(weights(fallback), weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_jit_compile_rejects_other_values(tmp_path):
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        make_trainer(tmp_path, 1, "bad", jit_compile="yes")


def test_mfu_and_throughput_in_logs_and_tensorboard(tmp_path, caplog):
    import gin

    gin.bind_parameter("peak_flops.peak_flops_per_device", 1e9)  # no probe in this test
    trainer = make_trainer(tmp_path, 1, "mfu", train_steps=4, steps_per_loop=2)
    with caplog.at_level("INFO"):
        trainer.train()
    # Dense 8->16->2 on 16 examples: forward 2*16*(8*16+16*2), the same again for the
    # weight gradients, and the input gradient of the second layer only.
    assert trainer.flops_per_step == 2 * 16 * (8 * 16 + 16 * 2) * 2 + 2 * 16 * 16 * 2
    assert any("MFU" in r.getMessage() and "examples/s" in r.getMessage() for r in caplog.records)
    scalars = {tag: dict(points)
               for tag, points in scalar_points(tmp_path / "mfu" / "train").items()}
    assert {"mfu", "examples_per_second", "steps_per_second"} <= set(scalars)
    assert scalars["mfu"][4] == pytest.approx(
        trainer.flops_per_step * scalars["steps_per_second"][4] / 1e9, rel=1e-5)


def test_mfu_flops_are_counted_after_the_first_loop_not_before_its_first_step(tmp_path):
    """The count traces the step once more: it runs after the first loop (off the path
    to the first trained step), so every later loop shows MFU. (Here no XLA: with it,
    "auto" steps per program read the ideal step time and the count runs before.)"""
    import gin

    gin.bind_parameter("peak_flops.peak_flops_per_device", 1e9)  # no probe in this test
    seen = []

    class Watch(tputrain.Action):  # user actions run after the built-in MFU action
        def loop_metrics(self, context, step, steps, seconds):
            seen.append(("loop", step, context.flops_per_step))
            return {}

        def on_loop_end(self, context, step, logs):
            seen.append(("end", step, context.flops_per_step))

    trainer = make_trainer(tmp_path, 1, "mfu_later", train_steps=4, steps_per_loop=2,
                           jit_compile=False, actions=[Watch()])
    trainer.train()
    flops = 2 * 16 * (8 * 16 + 16 * 2) * 2 + 2 * 16 * 16 * 2
    assert seen[0] == ("loop", 2, None)  # loops end at 2, 3 (checkpoint_every) and 4
    assert seen[1:] == [(hook, step, flops) for step in (2, 3, 4) for hook in ("loop", "end")][1:]


def test_profile_steps_write_a_trace(tmp_path):
    trainer = make_trainer(tmp_path, 1, "prof", train_steps=6, steps_per_loop=6, report_mfu=False,
                           profile_steps=(2, 4))
    trainer.train()
    traces = tf.io.gfile.glob(str(tmp_path / "prof" / "train" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1
    with pytest.raises(ValueError, match="start < stop"):
        make_trainer(tmp_path, 1, "prof2", profile_steps=(4, 2))


def test_mixed_float16_wraps_any_optimizer_and_recovers_from_overflow(tmp_path):
    """TinyTask builds a plain SGD: the Trainer adds Keras 3 loss scaling under fp16.
    The first batch overflows float16 gradients; that step is skipped, the scale
    halves, and the following steps train."""

    class Spiky(TinyTask):
        def build_inputs(self, split, input_context):
            dataset = super().build_inputs(split, input_context)
            if split != "train":
                return dataset
            spike = lambda i, batch: ({"x": tf.where(i == 0, batch[0]["x"] * 1e3, batch[0]["x"])},  # noqa: E731
                                      batch[1])
            return dataset.enumerate().map(spike)

    trainer = make_trainer(tmp_path, 1, "fp16", task=Spiky(), precision="mixed_float16",
                           train_steps=1, steps_per_loop=1, report_mfu=False)
    assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
    scale = float(trainer.optimizer.dynamic_scale.numpy())
    before = weights(trainer)
    trainer.train()
    assert float(trainer.optimizer.dynamic_scale.numpy()) == scale / 2
    for a, b in zip(before, weights(trainer)):
        np.testing.assert_array_equal(a, b)
    resumed = make_trainer(tmp_path, 1, "fp16", task=Spiky(), precision="mixed_float16",
                           train_steps=4, steps_per_loop=1, report_mfu=False)
    logs = resumed.train()  # continues after the skipped step, with the halved scale
    assert float(resumed.optimizer.dynamic_scale.numpy()) == scale / 2
    assert np.isfinite(logs["loss"])
    assert any(not np.array_equal(a, b) for a, b in zip(before, weights(resumed)))


def test_evaluate_restores_the_latest_checkpoint(tmp_path, caplog):
    """A new Trainer on a trained model_dir evaluates the trained weights, not new ones."""
    trained = make_trainer(tmp_path, 1, "run", eval_steps=4)
    final = trained.train()
    fresh = make_trainer(tmp_path, 1, "run", eval_steps=4)
    assert fresh.current_step == 0
    assert fresh.evaluate() == pytest.approx(final)
    assert fresh.current_step == 6

    empty = make_trainer(tmp_path, 1, "empty", eval_steps=4)
    with caplog.at_level("WARNING"):
        empty.evaluate()
    assert any("no checkpoint" in r.getMessage() and "untrained" in r.getMessage()
               for r in caplog.records)


def test_jit_compile_auto_compiles_a_dropout_step_on_cpu(tmp_path):
    """Keras's draws made a compiled Dropout step 19x slower; its masks are drawn with
    ThreeFry in XLA now (issue 55, tputrain/loop/xla_dropout.py): auto compiles it."""
    trainer = make_trainer(tmp_path, 1, "dropout", task=TinyTask(dropout=0.5))
    assert trainer._steps.xla_plan() == (True, False, "auto: the whole step, if it compiles")
    assert make_trainer(tmp_path, 1, "plain")._steps.xla_plan()[0] is True


def test_the_default_strategy_trains_like_one_device(tmp_path):
    """`strategy=tf.distribute.get_strategy()` (a script with no strategy of its own)
    trains, saves and resumes, with the weights of the resolved one-device run."""
    kwargs = dict(train_steps=6, steps_per_loop=3, global_batch_size=16, checkpoint_every=3,
                  seed=0)
    default = tputrain.Trainer(TinyTask(), str(tmp_path / "default"),
                               strategy=tf.distribute.get_strategy(), **{**kwargs,
                                                                         "train_steps": 3})
    default.train()
    resumed = tputrain.Trainer(TinyTask(), str(tmp_path / "default"),
                               strategy=tf.distribute.get_strategy(), **kwargs)
    resumed.train()
    assert int(resumed.step.numpy()) == 6
    one = make_trainer(tmp_path, 1, "one", seed=0)
    one.train()
    for a, b in zip(weights(one), weights(resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_mirrored_strategy_on_one_device_trains(tmp_path, caplog):
    """MirroredStrategy over one device (one replica, mirrored variables): XLA "auto"
    cannot hold its optimizer's merge_call, so the step runs uncompiled, and says why."""
    trainer = tputrain.Trainer(TinyTask(), str(tmp_path), train_steps=4, steps_per_loop=2,
                               strategy=tf.distribute.MirroredStrategy(["/cpu:0"]),
                               global_batch_size=16, eval_steps=1)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert any("does not compile with XLA (RuntimeError: `merge_call`" in r.getMessage()
               for r in caplog.records)
    assert int(trainer.step.numpy()) == 4
    assert trainer.jit_compile is False and not trainer._steps.counted_in_step


def batched_keras_task(batch: int) -> tputrain.KerasTask:
    """A KerasTask on a dataset batched in `batch` (its global batch)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(batch)
    return tputrain.KerasTask(model, data, shuffle=False)


def test_a_keras_tasks_global_batch_is_the_default(tmp_path):
    """No global_batch_size given: the KerasTask's batch (its data's), not 64."""
    trainer = tputrain.Trainer(batched_keras_task(16), str(tmp_path), strategy=strategy_for(1),
                               train_steps=1, steps_per_loop=1)
    assert trainer.global_batch_size == 16
    assert tf.nest.flatten(trainer.train_dataset.element_spec)[0].shape[0] == 16


def test_a_global_batch_other_than_the_keras_tasks_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^Trainer.global_batch_size=32 .*KerasTask.global_batch_size=16"):
        tputrain.Trainer(batched_keras_task(16), str(tmp_path), strategy=strategy_for(1),
                         global_batch_size=32)


def test_the_default_global_batch_stays_64_for_a_task_without_one(tmp_path):
    trainer = tputrain.Trainer(TinyTask(), str(tmp_path), strategy=strategy_for(1),
                               train_steps=1, steps_per_loop=1)
    assert trainer.global_batch_size == 64


def test_a_precision_leaves_the_users_global_policy_as_it_was(tmp_path):
    """The run's model computes in bfloat16; the user's next Keras model in float32, as
    the global policy was before the Trainer (it is the run's only while it builds)."""
    trainer = make_trainer(tmp_path, precision="mixed_bfloat16", train_steps=1, steps_per_loop=1)
    assert keras.mixed_precision.global_policy().name == "float32"
    assert {layer.compute_dtype for layer in trainer.model.layers
            if isinstance(layer, keras.layers.Dense)} >= {"bfloat16"}
    assert keras.layers.Dense(1).compute_dtype == "float32"


def test_a_continue_from_a_step_off_the_fetch_is_a_checkpoint_mismatch(tmp_path):
    """A run of 43 steps (its fetch shrunk to divide them), continued to 50 with fetches
    of 10: the refusal was a plain ValueError, which `tputrain run` printed as a
    20-line traceback with exit 1 (a bad configuration found before any step exits 2
    with one line: the CLI maps CheckpointMismatchError to that)."""
    common = dict(steps_per_loop=10, checkpoint_every=10, global_batch_size=8)
    make_trainer(tmp_path, train_steps=43, steps_per_fetch=10, **common).train()
    trainer = make_trainer(tmp_path, train_steps=50, steps_per_fetch=10, **common)
    with pytest.raises(tputrain.CheckpointMismatchError, match="steps_per_fetch=10.*e.g. 1"):
        trainer.train()


def _corrupt_eval_data(tmp_path) -> tuple[str, tputrain.Task]:
    """Train data (2 shards) and one eval shard of 64 examples, its record ~48 damaged:
    past the first batch of 16, which the start-up probe reads. (file, RecordsTask)"""
    from faults import RecordsTask, write_records

    write_records(tmp_path / "train")
    x = np.random.RandomState(1).randn(64, 8).astype(np.float32)
    [eval_file] = tputrain.data.write_tfrecords(
        {"x": x, "label": (x[:, 0] > 0).astype(np.int64)}, str(tmp_path / "eval" / "e"),
        num_shards=1)
    data = bytearray(open(eval_file, "rb").read())
    middle = len(data) * 3 // 4
    data[middle:middle + 64] = b"\xff" * 64
    open(eval_file, "wb").write(bytes(data))
    return eval_file, RecordsTask(str(tmp_path / "train" / "train-*"),
                                  str(tmp_path / "eval" / "e-*"))


def test_a_corrupt_eval_record_past_the_first_batch_fails_before_training(tmp_path):
    """The eval set is counted to its end before the first step (the count its first
    evaluation needs anyway): a record past its first batch was a DataLossError
    traceback at the first evaluation, naming no file, the steps since the last
    checkpoint lost. Building the Trainer reads no eval set to its end: diagnose,
    predict and export, which evaluate nothing, do not pay for the count."""
    eval_file, task = _corrupt_eval_data(tmp_path)
    trainer = make_trainer(tmp_path, task=task)  # reads one eval batch, not the rest
    with pytest.raises(tputrain.data.CorruptRecordError) as caught:
        trainer.train()
    message = str(caught.value).splitlines()[0]
    assert eval_file in message and "skip_corrupt=True" in message, message
    assert trainer.current_step == 0
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_corrupt_eval_record_read_by_an_evaluation_is_one_line(tmp_path):
    """With eval_steps, only the batches an evaluation reads are read: a corrupt one
    there is the CorruptRecordError naming the file (it was TF's DataLossError)."""
    eval_file, task = _corrupt_eval_data(tmp_path)
    trainer = make_trainer(tmp_path, task=task, eval_steps=4)  # the whole split
    with pytest.raises(tputrain.data.CorruptRecordError, match="skip_corrupt=True") as caught:
        trainer.evaluate()
    assert eval_file in str(caught.value)
