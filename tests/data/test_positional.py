"""Tests for tputrain.data.positional: a host's records as a function of its position."""

import collections
import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from tputrain.data import read_manifest, write_tfrecords
from tputrain.data.blocks import block_table
from tputrain.data.positional import PositionalRecords

RECORDS = 1000
pytestmark = pytest.mark.same_worker("positional")  # the module-scoped table
K, C = 16, 4  # small blocks and windows: many of both in a small data set


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("positional") / "train")
    write_tfrecords({"id": np.arange(RECORDS, dtype=np.int64)}, prefix, num_shards=3)
    manifest = read_manifest(prefix + ".manifest.json")
    return block_table(manifest.files(), [manifest], block_records=K)


def _ids(dataset: tf.data.Dataset, count: int) -> list[int]:
    parsed = dataset.take(count).batch(256).map(lambda r: tf.io.parse_example(
        r, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"])
    return [int(i) for batch in parsed.as_numpy_iterator() for i in batch]


def _stream(table, hosts: int = 1, host: int = 0, **kwargs) -> PositionalRecords:
    return PositionalRecords(table, num_hosts=hosts, host=host, seed=7, window_blocks=C, **kwargs)


def _pass_records(stream: PositionalRecords) -> int:
    """The host's records of epoch 0: its windows h, h + H, ... of the epoch."""
    windows = stream.windows.per_epoch
    return stream.ledger().fresh_records(stream.host, -(-(windows - stream.host) // stream.num_hosts))


@pytest.mark.parametrize("hosts", [1, 2, 3])
def test_a_rebuild_at_any_position_reads_what_an_uninterrupted_stream_reads(table, hosts):
    for host in range(hosts) if hosts < 3 else [2]:  # 3 hosts: the last one (time)
        stream = _stream(table, hosts, host)
        epoch, window = _pass_records(stream), stream.window_records
        whole = _ids(stream.dataset(), 3 * epoch + 50)
        assert stream.locate(0).k == stream.locate(0).skip == 0
        for position in (0, 5, window - 1, window, epoch - 1, epoch, 3 * epoch):
            rebuilt = PositionalRecords(table, num_hosts=hosts, host=host, seed=7,
                                        window_blocks=C).dataset(position)
            assert _ids(rebuilt, 50) == whole[position:position + 50], (host, position)


def test_every_record_of_an_epoch_once_over_the_hosts_and_epochs_differ(table):
    for hosts in (1, 2, 3):
        seen = collections.Counter()
        for host in range(hosts):
            stream = _stream(table, hosts, host)
            one_pass = _ids(stream.dataset(repeat=False), RECORDS)
            assert one_pass == _ids(stream.dataset(), _pass_records(stream))
            seen.update(one_pass)
        assert seen == collections.Counter(range(RECORDS)), hosts
    whole = _ids(_stream(table).dataset(), 2 * RECORDS)
    first, second = whole[:RECORDS], whole[RECORDS:]
    assert sorted(first) == sorted(second) and first != second


def test_one_pass_in_file_order_without_shuffle(table):
    stream = _stream(table, shuffle=False)
    assert _ids(stream.dataset(repeat=False), RECORDS + 1) == list(range(RECORDS))
    assert _ids(stream.dataset(300, repeat=False), RECORDS) == list(range(300, RECORDS))


def test_one_pass_in_file_order_with_parallel_reads(table):
    """Without a shuffle a window's blocks are read one after another (cycle 1): more
    read threads (what TFRecordInput gives on a multi-core host) failed in tf.data."""
    stream = _stream(table, shuffle=False, read_parallelism=4)
    assert _ids(stream.dataset(repeat=False), RECORDS + 1) == list(range(RECORDS))
    assert _ids(stream.dataset(300, repeat=False), RECORDS) == list(range(300, RECORDS))


def test_compressed_shards_read_by_record_index(tmp_path):
    prefix = str(tmp_path / "train")
    write_tfrecords({"id": np.arange(100, dtype=np.int64)}, prefix, num_shards=2,
                    compression_type="ZLIB")
    manifest = read_manifest(prefix + ".manifest.json")
    blocks = block_table(manifest.files(), [manifest], block_records=8, compression="ZLIB")
    stream = PositionalRecords(blocks, seed=1, window_blocks=2, compression="ZLIB")
    whole = _ids(stream.dataset(), 130)
    assert sorted(whole[:100]) == list(range(100))
    assert _ids(PositionalRecords(blocks, seed=1, window_blocks=2, compression="ZLIB")
                .dataset(37), 60) == whole[37:97]


def test_the_window_shuffle_spreads_records_as_far_as_a_buffer_of_its_size(table):
    """Mean displacement from the file order, over one epoch: the window shuffle's at
    least the displacement of a shuffle buffer holding as many records as a window."""
    stream = _stream(table)
    positional = np.array(_ids(stream.dataset(), RECORDS))
    files = tf.data.Dataset.from_tensor_slices(list(table.files)).interleave(
        tf.data.TFRecordDataset, cycle_length=len(table.files))
    buffered = np.array(_ids(files.shuffle(C * K, seed=7), RECORDS))

    def displacement(order):
        return np.abs(np.argsort(order) - np.arange(RECORDS)).mean()
    assert displacement(positional) >= displacement(buffered)
    # The first tenth of an epoch already draws from most of the data (not one region).
    assert len(set(positional[:RECORDS // 10] * 10 // RECORDS)) >= 6


def test_a_top_level_tfrecorddatasetv2_still_fails_in_tf(tmp_path):
    """TF 2.21 drops `byte_offsets` when it serializes a top-level TFRecordDatasetV2, so
    tputrain builds it inside interleave. When this test fails, TF has fixed it: the
    workaround (tputrain.data.positional's `_piece` inside interleave) can go."""
    path = str(tmp_path / "r.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(3):
            writer.write(b"%d" % i)
    variant = tf.raw_ops.TFRecordDatasetV2(
        filenames=[path], compression_type="", buffer_size=tf.constant(1024, tf.int64),
        byte_offsets=tf.constant([0], tf.int64))
    top_level = tf.data.experimental.from_variant(variant, tf.TensorSpec([], tf.string))
    with pytest.raises(tf.errors.InternalError, match="3 inputs specified of 4 inputs"):
        next(iter(top_level))


def test_a_host_with_no_block_is_refused_naming_the_fix(table):
    from tputrain.data.empty_input import EmptyInputError
    with pytest.raises(EmptyInputError, match="write more data, or smaller blocks"):
        PositionalRecords(table, num_hosts=len(table.counts) + 1, host=len(table.counts))


# TFRecordInput(positional=True): the position through InputContext.

def _write_ids(directory, records: int = RECORDS, payload: int = 0) -> str:
    prefix = str(directory / "ids")
    rng = np.random.default_rng(0)
    columns = {"id": np.arange(records, dtype=np.int64)}
    if payload:
        columns["payload"] = rng.standard_normal((records, payload)).astype(np.float32)
    write_tfrecords(columns, prefix, num_shards=3)
    return prefix + ".manifest.json"


def _input(manifest: str, **kwargs):
    from tputrain.data import TFRecordInput
    options = dict(manifest=manifest, positional=True, seed=5, window_blocks=2)
    options.update(kwargs)
    return TFRecordInput(**options)


def _batch_ids(dataset: tf.data.Dataset, batches: int) -> list[list[int]]:
    return [batch["id"].tolist() for batch in dataset.take(batches).as_numpy_iterator()]


@pytest.mark.parametrize("hosts", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_tfrecordinput_starts_at_the_examples_consumed(tmp_path, hosts):
    """Steps of a global batch of 32 (16 a host with 2; 48 with 3, a batch the 3
    replicas divide): rebuilt at step 0, mid-window, at a window boundary (512
    records: 2 blocks of 256), an epoch boundary (with 3 hosts: 2016 examples) and
    three epochs in, each host's batches are the uninterrupted ones from there."""
    from tputrain.data import InputContext
    manifest = _write_ids(tmp_path, 2048)
    batch = 48 if hosts == 3 else 32
    for host in range(hosts):
        def context(consumed):
            return InputContext(hosts, host, hosts, global_batch_size=batch,
                                examples_consumed=consumed)
        whole = _batch_ids(_input(manifest)(context(0)), 3 * 2048 // batch + 4)
        epoch_steps = 2048 // batch
        for step in (0, 3, 512 * hosts // batch, epoch_steps, 3 * epoch_steps):
            started = context(step * batch)
            dataset = _input(manifest)(started)
            assert started.position_honoured is (step > 0)
            assert _batch_ids(dataset, 3) == whole[step:step + 3], (host, step)


def test_a_positional_iterator_checkpoint_holds_no_buffer(tmp_path):
    """Records of 1 KB: the shuffle buffer's checkpoint holds them, the positional
    pipeline's, checkpointed symbolically, positions only (under 64 KB); both restore
    exactly."""
    from tputrain.data import InputContext, InputOptions
    manifest = _write_ids(tmp_path, 3000, payload=256)
    sizes = {}
    for positional in (True, False):
        options = InputOptions(symbolic_checkpoint=positional)
        dataset = _input(manifest, positional=positional, shuffle_buffer=2000,
                         options=options)(InputContext(global_batch_size=8))
        iterator = iter(dataset)
        for _ in range(5):
            next(iterator)
        checkpoint = tf.train.Checkpoint(iterator=iterator)
        path = checkpoint.save(str(tmp_path / f"ckpt-{positional}"))
        sizes[positional] = sum(f.stat().st_size for f in tmp_path.glob(f"ckpt-{positional}*"))
        expected = [next(iterator)["id"].numpy().tolist() for _ in range(4)]
        checkpoint.restore(path)
        assert [next(iterator)["id"].numpy().tolist() for _ in range(4)] == expected
    assert sizes[True] < 64 * 1024 < 2 * 2**20 < sizes[False], sizes


def test_positional_and_a_file_cache_are_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match="drop cache, or set positional=False"):
        _input(_write_ids(tmp_path, 100), cache=str(tmp_path / "cache"))


@pytest.mark.slow  # three Trainers on 2 replicas
@pytest.mark.parametrize("input_mode", ["distributed", "host"])
def test_a_resume_starts_the_input_at_its_position(tmp_path, input_mode):
    """2 replicas: a resume in either input mode builds the input at the examples
    consumed (no batch re-read; host mode saves no iterator for it) and trains to the
    uninterrupted weights."""
    import tputrain
    from tiny import TinyTask, strategy_for, weights

    prefix = str(tmp_path / "xy")
    task_data = TinyTask()
    write_tfrecords({"x": task_data.x, "y": task_data.y}, prefix, num_shards=2)

    class Positional(TinyTask):
        contexts = []

        def build_inputs(self, split, input_context):
            if split != "train":
                return super().build_inputs(split, input_context)
            type(self).contexts.append(input_context.examples_consumed)
            dataset = tputrain.data.TFRecordInput(
                manifest=prefix + ".manifest.json", label_key="y", positional=True, seed=3,
                window_blocks=1)(input_context)
            return dataset.map(lambda x, y: (x, y))  # a task's own stage after the input

    def trainer(name):
        return tputrain.Trainer(Positional(), str(tmp_path / name), strategy=strategy_for(2),
                                input_mode=input_mode, train_steps=6, steps_per_loop=3,
                                global_batch_size=16, checkpoint_every=3)
    whole = trainer("whole")
    whole.train()
    first = trainer("resumed")
    first.train(num_steps=3)
    first.close()
    Positional.contexts.clear()
    second = trainer("resumed")
    second.train()
    assert 3 * 16 in Positional.contexts, Positional.contexts
    for a, b in zip(weights(whole), weights(second)):
        np.testing.assert_array_equal(a, b)


KILL_CONFIG = """
Trainer.task = @PositionalRecordsTask()
PositionalRecordsTask.manifest = '{manifest}'
Trainer.train_steps = 24
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.checkpoint_every = 4
Trainer.eval_steps = 1
Trainer.input_mode = 'distributed'
Trainer.report_mfu = False
resolve_strategy.strategy = 'mirrored'
"""


@pytest.mark.slow  # three CLI processes
def test_a_kill_9_in_distributed_mode_resumes_bitwise(tmp_path):
    """Issue 54 acceptance 1: a positional input, distributed input mode, 2 replicas,
    dropout: SIGKILL after step 10 (checkpoint 8: 128 examples, mid-window), rerun;
    the resume builds the input at its position (no re-read) and the final weights
    equal an uninterrupted run's bitwise, past the window boundary at step 16."""
    import signal
    import sys
    from faults import Process, child_env, final_weights, write_labelled_records

    config = tmp_path / "kill.gin"
    config.write_text(KILL_CONFIG.format(manifest=write_labelled_records(tmp_path, 600)))

    def child(name: str, *params: str) -> Process:
        return Process([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                        f"--gin_file={config}", f"--model_dir={tmp_path / name}",
                        "--deterministic", *params], child_env(cpus=2))
    reference = child("reference")
    killed = child("model", "--gin_param=Trainer.actions=[@PauseAtStep()]",
                   "--gin_param=PauseAtStep.step=10")
    killed.wait_for(r"tputrain-test: paused at step 10")
    assert killed.kill() == -signal.SIGKILL
    resumed = child("model")
    assert resumed.finish() == 0, resumed.log()
    assert reference.finish() == 0, reference.log()
    assert "ckpt-8 (step 8)" in resumed.text(), resumed.log()
    assert "not positional" not in resumed.text(), resumed.log()
    expected, actual = final_weights(str(tmp_path / "reference")), final_weights(
        str(tmp_path / "model"))
    assert expected.keys() == actual.keys() and any(k.startswith("seeds/") for k in expected)
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


# Layout changes: the hosts' places through InputContext.layout_history.

def _host_steps(manifest: str, history, hosts: int, batch: int, consumed: int,
                steps: int) -> list[list[int]]:
    """Each host's ids over `steps` steps of a global batch `batch`, from `consumed`."""
    from tputrain.data import InputContext
    return [[i for step in _batch_ids(_input(manifest, window_blocks=1)(InputContext(
        hosts, host, hosts, global_batch_size=batch, examples_consumed=consumed,
        layout_history=history)), steps) for i in step] for host in range(hosts)]


def test_every_record_of_an_epoch_once_through_2_3_1_hosts_and_batches_64_48_96(tmp_path):
    """2400 records in 5 shards (blocks of 256 and 224: windows span blocks; the epoch's
    last window holds 96): 3 steps of 64 on 2 hosts (each host mid-window), 4 steps of
    48 on 3 hosts (carried windows beside fresh ones), then 1 host with 96 to the end
    of the epoch: every record once."""
    prefix = str(tmp_path / "ids")
    write_tfrecords({"id": np.arange(2400, dtype=np.int64)}, prefix, num_shards=5)
    manifest = prefix + ".manifest.json"
    seen = collections.Counter()
    history = [(0, 2)]
    for hosts, batch, steps in ((2, 64, 3), (3, 48, 4), (1, 96, 21)):
        consumed = sum(seen.values())
        if history[-1][1] != hosts:
            history.append((consumed, hosts))
        for ids in _host_steps(manifest, history, hosts, batch, consumed, steps):
            assert len(ids) == steps * batch // hosts
            seen.update(ids)
    assert seen == collections.Counter(range(2400))


@pytest.mark.parametrize("changes", [[(120, 3)], [(120, 3), (240, 1)]])
def test_a_host_change_reads_this_epochs_records_before_the_next_epochs(tmp_path, changes):
    """600 records, 3 windows of 200, global batch 24 on 2 hosts, then 3 (then 1): the new
    host started the next epoch's window while this epoch's last waited behind another
    host's, so the first 480 examples trained 111 records twice. Now each once."""
    manifest = _write_ids(tmp_path, 600)  # 3 shards of 200: one block, one window each
    seen, history, consumed = collections.Counter(), [(0, 2)], 0
    for end, hosts in [*changes, (480, None)]:
        for ids in _host_steps(manifest, history, history[-1][1], 24, consumed,
                               (end - consumed) // 24):
            seen.update(ids)
        consumed = end
        if hosts is not None:
            history.append((consumed, hosts, 1))
    assert sum(seen.values()) == 480 and max(seen.values()) == 1


def test_another_global_batch_on_the_same_hosts_keeps_each_hosts_order(tmp_path):
    """2 hosts, 3 steps of 64 then 5 of 32 (no layout_history entry: the hosts did not
    change) read what 3 + 5/2 steps of 64 read, host by host."""
    manifest = _write_ids(tmp_path, 2048)
    whole = _host_steps(manifest, (), 2, 64, 0, 6)
    first = _host_steps(manifest, (), 2, 64, 0, 3)
    then = _host_steps(manifest, [(0, 2)], 2, 32, 192, 5)
    for host in range(2):
        assert first[host] + then[host] == whole[host][:96 + 80], host


def test_a_layout_history_that_is_not_this_layouts_is_refused_naming_why():
    from tputrain.data import InputContext
    with pytest.raises(ValueError, match="ends with 3 host.*num_input_pipelines=2"):
        InputContext(2, 0, 2, layout_history=[(0, 2), (64, 3)])
    with pytest.raises(ValueError, match="in order"):
        InputContext(2, 0, 2, layout_history=[(64, 3), (0, 2)])
    context = InputContext(2, 1, 2, layout_history=[(0, 3), (96, 2)])
    assert InputContext.from_tf(context, 32).layout_history == ((0, 3), (96, 2))


# Host mode: the Trainer saves no iterator for a positional input and builds it at
# its position on a resume, on any layout.

def _indexed_records(directory, records: int, payload: int = 0) -> str:
    """`records` examples with "x" (one-hot of index % 8), "index" and, with `payload`,
    that many float32 more per record (record size), in 2 shards."""
    indices = np.arange(records, dtype=np.int64)
    columns = {"x": np.eye(8, dtype=np.float32)[indices % 8], "index": indices}
    if payload:
        columns["payload"] = np.random.default_rng(0).standard_normal(
            (records, payload)).astype(np.float32)  # random: a saved iterator compresses
    prefix = str(directory / "indexed")
    write_tfrecords(columns, prefix, num_shards=2)
    return prefix + ".manifest.json"


def _host_trainer(tmp_path, manifest: str, batch: int, steps: int, every: int = 3):
    import tputrain
    from faults import PositionalIndexedTask
    from tiny import strategy_for

    class Recorded(PositionalIndexedTask):
        contexts: list = []

        def build_inputs(self, split, input_context):
            if split == "train":
                type(self).contexts.append(input_context.examples_consumed)
            return super().build_inputs(split, input_context)
    task = Recorded(str(tmp_path / "seen"), manifest)
    return tputrain.Trainer(task, str(tmp_path / "model"), strategy=strategy_for(1),
                            input_mode="host", global_batch_size=batch, train_steps=steps,
                            steps_per_loop=every, checkpoint_every=every, eval_steps=1,
                            report_mfu=False, jit_compile=False, steps_per_program=1), task


@pytest.mark.slow  # two Trainers, three train() calls: 7-8 s at load 6-8 on 2 cores
def test_host_mode_builds_a_positional_input_at_its_position_on_another_batch(tmp_path):
    """Host mode, 144 records (2 windows of 72): 3 steps of 16, then resumed with a
    global batch of 24 (another layout) to the end of the epoch (step 7): the input
    is built at the 48 examples consumed (not read past them from the start), and
    every record of the epoch is trained on once. The first run trains in two calls:
    the second restores step 1 where its iterator already is, so it builds nothing."""
    from faults import trained_indices
    manifest = _indexed_records(tmp_path, 144)
    first, first_task = _host_trainer(tmp_path, manifest, 16, 3)
    first.train(num_steps=1)
    first.train()
    first.close()
    assert type(first_task).contexts == [0], type(first_task).contexts
    second, task = _host_trainer(tmp_path, manifest, 24, 7)
    type(task).contexts.clear()
    second.train()
    assert second.current_step == 7 and 48 in type(task).contexts, type(task).contexts
    assert trained_indices(tmp_path / "seen") == list(range(144))


def _checkpoint_bytes(checkpoint: str) -> int:
    """Bytes of a checkpoint's files (index and data): the tiny model, its optimizer
    and the data position."""
    return sum(os.path.getsize(path) for path in glob.glob(checkpoint + ".*"))


def test_host_mode_input_state_is_under_64_kb_whatever_the_record_size(tmp_path):
    """Acceptance 4: records of 4 KB (a saved iterator would hold a window of them:
    over 64 KB): the whole checkpoint (a model of 180 weights, its optimizer and the
    data position) is under 64 KB at step 10, and at step 1e5 (the step variable set
    there: the input state is no function of it)."""
    manifest = _indexed_records(tmp_path, 600, payload=1024)
    trainer, _ = _host_trainer(tmp_path, manifest, 8, 10, every=10)
    trainer.train()
    assert trainer.checkpointer.latest.endswith("ckpt-10")
    sizes = {10: _checkpoint_bytes(trainer.checkpointer.latest)}
    trainer.step.assign(100_000)
    sizes[100_000] = _checkpoint_bytes(trainer.checkpointer.save())
    trainer.close()
    assert 0 < sizes[10] < 64 * 1024 and 0 < sizes[100_000] < 64 * 1024, sizes


def test_a_positional_input_with_python_state_is_not_warned_of_an_iterator_checkpoint(
        tmp_path, caplog):
    """A positional train input saves no iterator (it is built at its position), so a
    `tf.numpy_function` in it is no reason for the warning that checkpoints save its
    iterator without that state, nor for the pre-flight's probe of that state; a
    host-mode input that is not positional still gets the warning."""
    import tputrain
    from faults import IndexedTask, PositionalIndexedTask
    from tiny import strategy_for

    def with_python(dataset: tf.data.Dataset) -> tf.data.Dataset:
        return dataset.map(lambda features, labels: ({"x": tf.ensure_shape(tf.numpy_function(
            lambda x: x, [features["x"]], tf.float32, stateful=True), [16, 8])}, labels))

    class Positional(PositionalIndexedTask):
        def build_inputs(self, split, input_context):
            return with_python(super().build_inputs(split, input_context))

    class NotPositional(IndexedTask):
        def build_inputs(self, split, input_context):
            return with_python(super().build_inputs(split, input_context))

    manifest = _indexed_records(tmp_path, 64)
    warned = []
    for name, task in (("positional", Positional(str(tmp_path / "seen"), manifest)),
                       ("not", NotPositional(str(tmp_path / "seen_not")))):
        caplog.clear()
        with caplog.at_level("WARNING"):
            tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(1),
                             input_mode="host", global_batch_size=16, train_steps=2,
                             report_mfu=False, jit_compile=False).train()
        warned.append(any("Checkpoints save its iterator" in r.getMessage()
                          for r in caplog.records))
    assert warned == [False, True]
