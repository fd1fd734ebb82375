"""Unreadable checkpoints: skipped for the previous one, then moved aside.

A truncated or bit-rotten checkpoint (or a damaged state file) is not a reason
to start over: readers take the newest readable one, with a warning for each
newer one skipped; the writer then moves the damaged files into `damaged/`
(kept for a post-mortem, never restored again) and rewrites the state file.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import tensorflow as tf
from absl import logging

from tputrain.checkpointing.atomic import move
from tputrain.checkpointing.files import STATE_FILE, files_of, first_line, list_checkpoints
from tputrain.checkpointing.integrity import CheckpointMismatchError

DAMAGED_DIR = "damaged"  # unreadable checkpoints are moved here, never deleted
_ITERATOR_FAILURE = "Failed to restore dataset iterator"  # TF's words
# What makes a checkpoint unreadable (not another model's): as `restore_latest` skips.
UNREADABLE_ERRORS = (tf.errors.OpError, ValueError, IndexError)


class UnreadableCheckpointError(RuntimeError):
    """No checkpoint in the directory could be read: bad input, named with its fix
    (the CLI says it in one line and exits 2)."""


def unreadable_message(directory: str, failures: list[tuple[str, BaseException]]) -> str:
    """Why no checkpoint was restored, and what to do about it."""
    details = "; ".join(f"{p}: {type(e).__name__}: {first_line(e)}" for p, e in failures)
    if any(_ITERATOR_FAILURE in str(error) for _, error in failures):
        return (f"no checkpoint in {directory} could be restored ({details}). A data iterator "
                "that fails to restore means the input pipeline is not the one that saved it "
                "(its ops, batching or sharding; for checkpoints written before tputrain "
                "recorded the input layout, also another replica count). The files are intact: "
                "resume once with the setup that wrote them (later checkpoints record the "
                "layout and resume on another replica count), or start a new model_dir")
    return (f"no checkpoint in {directory} could be read ({details}): delete the damaged files "
            "(or the whole directory to start over)")


def first_readable(candidates: Sequence[str], read: Callable[[str], Any], verb: str
                   ) -> tuple[str | None, Any, list[tuple[str, BaseException]]]:
    """(path, `read(path)`, failures) for the first of `candidates` (newest first)
    that `read` can read, warning once for each newer one it skipped; (None, None,
    failures) if none. A `CheckpointMismatchError` (another model) is raised as is:
    an older checkpoint of the wrong model is no fallback."""
    failures: list[tuple[str, BaseException]] = []
    for path in candidates:
        try:
            value = read(path)
        except CheckpointMismatchError:
            raise
        except UNREADABLE_ERRORS as error:
            failures.append((path, error))
            continue
        for failed, error in failures:
            logging.warning("tputrain: checkpoint %s is unreadable (%s: %s); %s the older %s "
                            "instead", failed, type(error).__name__, first_line(error), verb, path)
        return path, value, failures
    return None, None, failures


def newest_readable(candidates: Sequence[str], read: Callable[[str], Any], verb: str,
                    directory: str) -> tuple[str | None, Any, list[tuple[str, BaseException]]]:
    """`first_readable`, raising `UnreadableCheckpointError` when there were
    candidates and none could be read; (None, None, []) when there were none."""
    path, value, failures = first_readable(candidates, read, verb)
    if path is None and failures:
        raise UnreadableCheckpointError(unreadable_message(directory, failures))
    return path, value, failures


def read_newest(paths: Sequence[str], read: Callable[[str], Any], directory: str
                ) -> tuple[str, Any]:
    """(path, what `read` returned) for the newest of `paths` (oldest first) that
    `read` can read, for readers that are not the run's `Checkpointer` (export,
    eval): a truncated or damaged one is skipped for the older one, with the
    warning `restore_latest` logs; none readable is `UnreadableCheckpointError`."""
    path, value, failures = first_readable(list(reversed(list(paths))), read, "read")
    if path is None:
        raise UnreadableCheckpointError(unreadable_message(directory, failures))
    return path, value


def tidy_after_restore(directory: str, restored: str | None, failed: list[str]) -> bool:
    """As the writer, after a restore: unreadable checkpoints and a damaged state file
    moved to `damaged/`, the state file rewritten, and temp folders of killed writes
    removed. Returns whether the state file changed (a `CheckpointManager` made
    before has read the old one)."""
    state = list_checkpoints(directory)
    if state.damage:
        logging.warning("tputrain: the checkpoint state file is damaged (%s); used the "
                        "checkpoint files on disk instead", state.damage)
    if state.missing and restored is not None:
        logging.warning("tputrain: %s has no checkpoint state file (`%s`): resumed from "
                        "the newest intact checkpoint file %s and wrote a new state file "
                        "listing %d", directory, STATE_FILE, restored,
                        len(state.paths) - len(failed))
    _move_uncommitted(directory, state.uncommitted)
    changed = bool(failed or state.damage or state.missing or state.uncommitted)
    if changed:
        if failed or state.damage:
            quarantine(directory, failed, state_file=state.damage is not None)
        kept = [p for p in state.paths if p not in failed and tf.io.gfile.exists(f"{p}.index")]
        if restored is not None:
            _rewrite_state_file(directory, restored, kept)
    for leftover in tf.io.gfile.glob(f"{directory.rstrip('/')}/ckpt-*_temp*"):
        logging.info("tputrain: removing %s, left by a killed checkpoint write", leftover)
        if tf.io.gfile.isdir(leftover):
            tf.io.gfile.rmtree(leftover)
        else:
            tf.io.gfile.remove(leftover)
    return changed


def _move_uncommitted(directory: str, uncommitted: list[str]) -> None:
    """Saves killed before their commit, with no state file (`never_committed`), moved to
    `damaged/`: left, they look like a checkpoint that no rerun can read."""
    for prefix in uncommitted:
        logging.warning("tputrain: %s was never committed (a save killed before the state "
                        "file `%s` was written, it cannot be read): moving it to %s/; that "
                        "step is saved again when the run gets there", prefix, STATE_FILE,
                        DAMAGED_DIR)
    if uncommitted:
        quarantine(directory, uncommitted, state_file=False)


def _rewrite_state_file(directory: str, restored: str, kept: list[str]) -> None:
    """A new state file listing `kept`, with `restored` the latest."""
    from tensorflow.python.checkpoint import checkpoint_management

    # Timestamps after last_preserved: TF's manager then rotates these too.
    stamps = [time.time() - len(kept) + i for i in range(len(kept))]
    checkpoint_management.update_checkpoint_state_internal(
        directory, restored, all_model_checkpoint_paths=kept,
        all_model_checkpoint_timestamps=stamps,
        last_preserved_timestamp=min(stamps, default=time.time()) - 1,
        save_relative_paths=True)


def quarantine(directory: str, failed: list[str], state_file: bool) -> None:
    """Moves damaged files into `directory/damaged/` (kept for a post-mortem)."""
    target = f"{directory.rstrip('/')}/{DAMAGED_DIR}"
    tf.io.gfile.makedirs(target)
    sources = [f for prefix in failed for f in files_of(prefix)]
    if state_file:
        sources.append(f"{directory.rstrip('/')}/{STATE_FILE}")
    for source in sources:
        destination = f"{target}/{source.rsplit('/', 1)[-1]}"
        move(source, destination)
        logging.warning("tputrain: moved damaged %s to %s", source, destination)
