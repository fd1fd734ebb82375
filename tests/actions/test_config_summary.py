"""Tests for tputrain/actions/config_summary.py on a full disk (the rest:
tests/test_tensorboard.py)."""

import logging
from types import SimpleNamespace

import tensorflow as tf

from tputrain.actions.config_summary import ConfigSummaryAction
from tputrain.observe.progress import Progress


def test_a_full_disk_at_the_config_summary_warns_and_the_run_goes_on(tmp_path, monkeypatch,
                                                                     caplog):
    """The hparams and config text are summaries too: no space for them is a warning."""
    def full(logdir, *args, **kwargs):
        raise tf.errors.ResourceExhaustedError(None, None, f"{logdir}; No space left on device")

    monkeypatch.setattr(tf.summary, "create_file_writer", full)
    context = SimpleNamespace(is_chief=True, progress=Progress(str(tmp_path), 4, 8),
                              options=SimpleNamespace(train_steps=4))
    with caplog.at_level(logging.WARNING):
        ConfigSummaryAction().on_train_begin(context, 0)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "TensorBoard summaries are not written" in messages[0]
