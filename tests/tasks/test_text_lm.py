"""The packing-aware Transformer LM (tputrain.tasks.text_lm)."""

import numpy as np
import pytest
import tensorflow as tf

from tputrain.tasks.text_lm import TextLMTask, segment_mask

LENGTH = 8


def _row(examples, length=LENGTH):
    """Packs `examples` (lists of token ids) into one row by hand."""
    tokens, segments, positions = [], [], []
    for number, example in enumerate(examples, 1):
        tokens += example
        segments += [number] * len(example)
        positions += list(range(len(example)))
    pad = length - len(tokens)
    return {"tokens": np.array([tokens + [0] * pad], np.int32),
            "segment_ids": np.array([segments + [0] * pad], np.int32),
            "positions": np.array([positions + [0] * pad], np.int32)}


@pytest.fixture(scope="module")
def model():
    task = TextLMTask(sequence_length=LENGTH, width=16, num_layers=2, num_heads=2)
    return task, task.build_model()


@pytest.mark.same_worker("text_lm_model")
def test_a_packed_rows_token_losses_equal_each_example_alone(model):
    task, lm = model
    first, second = [5, 9, 3], [7, 1, 4, 2]
    targets = {"first": [9, 3, 256], "second": [1, 4, 2, 256]}
    packed = lm(_row([first, second]), training=False)
    alone_first = lm(_row([first]), training=False)
    alone_second = lm(_row([second]), training=False)
    packed_labels = np.array([targets["first"] + targets["second"] + [0]], np.int32)
    packed_loss = task.compute_loss(packed_labels, packed).numpy()[0]
    loss_first = task.compute_loss(np.array([targets["first"] + [0] * 5], np.int32),
                                   alone_first).numpy()[0]
    loss_second = task.compute_loss(np.array([targets["second"] + [0] * 4], np.int32),
                                    alone_second).numpy()[0]
    np.testing.assert_allclose(packed_loss[:3], loss_first[:3], rtol=1e-5)
    np.testing.assert_allclose(packed_loss[3:7], loss_second[:4], rtol=1e-5)


@pytest.mark.same_worker("text_lm_model")
def test_the_comparison_sees_a_leak_across_segments(model):
    """Without the segment ids (one segment for the row), the second example attends
    to the first and its positions do not restart: its outputs change."""
    _, lm = model
    row = _row([[5, 9, 3], [7, 1, 4, 2]])
    leaky = dict(row, segment_ids=np.where(row["segment_ids"] > 0, 1, 0).astype(np.int32))
    assert not np.allclose(lm(row, training=False)[0, 3:7], lm(leaky, training=False)[0, 3:7],
                           atol=1e-4)
    unrestarted = dict(row, positions=np.arange(LENGTH, dtype=np.int32)[None])
    assert not np.allclose(lm(row, training=False)[0, 3:7],
                           lm(unrestarted, training=False)[0, 3:7], atol=1e-4)


def test_segment_mask_is_causal_within_segments():
    mask = segment_mask(tf.constant([[1, 1, 2, 2, 0]])).numpy()[0]
    expected = np.array([[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0],
                         [0, 0, 1, 0, 0],
                         [0, 0, 1, 1, 0],
                         [0, 0, 0, 0, 1]], bool)
    np.testing.assert_array_equal(mask, expected)


def test_the_loss_denominator_counts_real_tokens():
    task = TextLMTask(sequence_length=LENGTH)
    weights = tf.constant([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert int(task.loss_denominator(({}, None, weights))) == 3


TEXT_CONFIG = """
Trainer.task = @TextLMTask()
Trainer.train_steps = 10
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 4
Trainer.checkpoint_every = 4
Trainer.eval_steps = 1
Trainer.report_mfu = False
TextLMTask.sequence_length = 32
TextLMTask.width = 16
TextLMTask.num_layers = 1
TextLMTask.num_heads = 2
TextLMTask.max_files = 6
TextLMTask.shuffle_buffer = 8
"""


@pytest.mark.slow
def test_a_packed_text_run_killed_mid_run_resumes_bitwise(tmp_path):
    """Shuffled, packed rows in host input mode: the iterator's checkpoint holds the
    partly filled row, so a run killed after step 6 (its model_dir as a SIGKILL at
    the pause leaves it) and rerun equals the uninterrupted run bitwise."""
    from faults import killed_and_rerun, same_final_weights

    config = tmp_path / "text.gin"
    config.write_text(TEXT_CONFIG + f"TextLMTask.corpus_dir = '{tmp_path / 'corpus'}'\n")
    reference, resumed = killed_and_rerun(tmp_path, config, step=6)
    assert "ckpt-4 (step 4)" in resumed.text(), resumed.log()  # steps 5-6 replayed
    assert "real tokens/s" in reference.text() and "padding" in reference.text()
    weights = same_final_weights(tmp_path)
    assert len(weights) > 4


def test_the_corpus_goes_to_tputrains_cache_folder_as_the_digits_do(monkeypatch, tmp_path):
    """Not the temp folder (issue 52): `TPUTRAIN_CACHE_DIR`, else ~/.cache/tputrain."""
    from tputrain.tasks.text_lm_inputs import corpus_directory

    monkeypatch.setenv("TPUTRAIN_CACHE_DIR", str(tmp_path))
    assert corpus_directory(None, 5) == str(tmp_path / "stdlib-text-5")
    assert corpus_directory(str(tmp_path / "mine"), 5) == str(tmp_path / "mine")
    monkeypatch.delenv("TPUTRAIN_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert corpus_directory(None, None) == str(tmp_path / "home" / ".cache" / "tputrain" /
                                               "stdlib-text-all")
