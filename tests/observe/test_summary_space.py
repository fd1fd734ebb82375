"""Tests for tputrain/observe/summary_space.py: a summary write that finds the disk full."""

import errno
import logging

import pytest
import tensorflow as tf

from tputrain.observe.summary_space import SummarySpace


@pytest.mark.parametrize("error", [
    tf.errors.ResourceExhaustedError(None, None, "/d/events; No space left on device"),
    OSError(errno.ENOSPC, "No space left on device"),
    tf.errors.UnknownError(None, None, "write failed: No space left on device"),
])
def test_each_form_of_a_full_disk_is_skipped_with_one_warning(error, caplog):
    space = SummarySpace()

    def write():
        raise error

    with caplog.at_level(logging.WARNING):
        assert space.write("/d/train", write) is False
        assert space.write("/d/eval", write) is False
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert messages[0].startswith("tputrain: TensorBoard summaries are not written: no space "
                                  "left on /d/train"), messages
    assert str(error).splitlines()[0] in messages[0] and "training goes on" in messages[0]


def test_a_write_that_succeeds_returns_true_and_other_errors_are_raised():
    space = SummarySpace()
    written = []
    assert space.write("/d", lambda: written.append(1)) is True and written == [1]

    def denied():
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        space.write("/d", denied)
