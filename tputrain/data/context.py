"""The input context handed to input builders: which pipeline am I, how big is a batch.

`tf.distribute` calls an input function once per input pipeline (one per host)
with a `tf.distribute.InputContext`. tputrain's `InputContext` adds the global
batch size, because the Trainer owns it: users configure it once, on the
Trainer, and every input builder reads it from here.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tputrain.core.checks import check_int, per_replica_batch


class InputContext(tf.distribute.InputContext):
    """A `tf.distribute.InputContext` that also carries the global batch size.

    Args:
        num_input_pipelines: number of input pipelines (usually one per host).
        input_pipeline_id: which one this is, in `[0, num_input_pipelines)`.
        num_replicas_in_sync: replicas, over all hosts, that together consume
            one global batch per step.
        global_batch_size: examples per step summed over all replicas, or None
            if the input builder gets its batch size some other way. Must be a
            multiple of `num_replicas_in_sync`.
        examples_consumed: examples (over all pipelines) a resumed run has already
            trained on: a builder that can start there (`TFRecordInput(positional=True)`)
            starts its pipeline's share of them in and sets `position_honoured`; any
            other builder starts at 0 and the Trainer skips them.
        cache_dir: a writable folder of the run (its model_dir) for a builder's
            one-time caches (the block offsets of a read-only data folder), or None.
        layout_history: the host counts the run's input was split over and the
            examples consumed when each took over, `((0, 2), (192, 3))`: a positional
            input finds every host's place across them (`tputrain.data.ledger`; an
            entry's third field 1: a change whose fresh windows are dealt by load).
            Empty: `num_input_pipelines` hosts from the start. The last entry's
            hosts must be `num_input_pipelines`.
        row_places: a positional input's rows (`to_static`), per pipeline: (windows
            of its sequence ended, rows into the next), from the rows trained on
            (`tputrain.data.packed_rows`). Empty: from the start.

    Set by a builder (read by the Trainer after it returns):
        positional: its stream is a function of its position (`examples_consumed`
            across `layout_history`): in `input_mode="host"` the Trainer then saves no
            iterator for it and builds it at its position on every resume.
        position_honoured: it started at a nonzero `examples_consumed`.
    """

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
        global_batch_size: int | None = None,
        examples_consumed: int = 0,
        cache_dir: str | None = None,
        layout_history: Sequence[tuple[int, ...]] = (),
        row_places: Sequence[tuple[int, int]] = (),
    ):
        check_int("InputContext", "num_input_pipelines", num_input_pipelines, 1)
        check_int("InputContext", "input_pipeline_id", input_pipeline_id, 0)
        check_int("InputContext", "num_replicas_in_sync", num_replicas_in_sync, 1)
        if input_pipeline_id >= num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id={input_pipeline_id} is out of range for "
                f"num_input_pipelines={num_input_pipelines}: use an id in "
                f"[0, {num_input_pipelines})")
        super().__init__(
            num_input_pipelines=num_input_pipelines,
            input_pipeline_id=input_pipeline_id,
            num_replicas_in_sync=num_replicas_in_sync)
        if global_batch_size is not None:
            # Fail here, at construction, rather than when the first input is built.
            self.get_per_replica_batch_size(global_batch_size)
        self.global_batch_size = global_batch_size
        self.examples_consumed = check_int("InputContext", "examples_consumed",
                                           examples_consumed, 0)
        self.cache_dir = cache_dir
        self.layout_history = _checked_history(layout_history, num_input_pipelines)
        self.row_places = tuple((int(k), int(r)) for k, r in row_places)
        self.positional = False  # a builder's stream is a function of its position
        self.position_honoured = False  # a builder started at examples_consumed

    @classmethod
    def from_tf(cls, ctx: tf.distribute.InputContext | None,
                global_batch_size: int | None = None, examples_consumed: int | None = None,
                cache_dir: str | None = None,
                layout_history: Sequence[tuple[int, ...]] | None = None,
                row_places: Sequence[tuple[int, int]] | None = None) -> InputContext:
        """Wraps the context `tf.distribute` passes to a dataset function.

        Args:
            ctx: the TF context (the argument of the function given to
                `strategy.distribute_datasets_from_function`), a tputrain
                context, or None for one pipeline feeding one replica.
            global_batch_size: the global batch size to attach. If None and
                `ctx` already carries one (a tputrain context), it is kept.
            examples_consumed, cache_dir, layout_history, row_places: the same (None
                keeps `ctx`'s, if any).
        """
        if isinstance(ctx, cls) and global_batch_size in (None, ctx.global_batch_size) and (
                examples_consumed in (None, ctx.examples_consumed) and cache_dir is None
                and layout_history in (None, ctx.layout_history)
                and row_places in (None, ctx.row_places)):
            return ctx  # the same object: a builder's position_honoured reaches its caller
        if ctx is None:
            ctx = tf.distribute.InputContext()
        if global_batch_size is None:
            global_batch_size = getattr(ctx, "global_batch_size", None)
        if examples_consumed is None:
            examples_consumed = getattr(ctx, "examples_consumed", 0)
        return cls(
            num_input_pipelines=ctx.num_input_pipelines,
            input_pipeline_id=ctx.input_pipeline_id,
            num_replicas_in_sync=ctx.num_replicas_in_sync,
            global_batch_size=global_batch_size, examples_consumed=examples_consumed,
            cache_dir=cache_dir or getattr(ctx, "cache_dir", None),
            layout_history=(getattr(ctx, "layout_history", ()) if layout_history is None
                            else layout_history),
            row_places=getattr(ctx, "row_places", ()) if row_places is None else row_places)

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Returns `global_batch_size // num_replicas_in_sync`; raises if uneven."""
        check_int("InputContext", "global_batch_size", global_batch_size, 1)
        return per_replica_batch(global_batch_size, self.num_replicas_in_sync)

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
                f"input_pipeline_id={self.input_pipeline_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"global_batch_size={self.global_batch_size}"
                + (f", examples_consumed={self.examples_consumed}" if self.examples_consumed
                   else "") + ")")

    __str__ = __repr__  # The base class defines a __str__ without the batch size.


def _checked_history(history: Sequence[tuple[int, ...]], hosts: int
                     ) -> tuple[tuple[int, ...], ...]:
    """`layout_history` as a tuple of (examples, hosts[, rule]), checked: examples
    increasing, hosts positive, the last entry this context's host count (rule 1: a
    change whose fresh windows are dealt by load, `tputrain.data.ledger`)."""
    entries = tuple(tuple(int(field) for field in entry) for entry in history)
    if not entries:
        return ()
    examples = [entry[0] for entry in entries]
    if (examples != sorted(examples) or examples[0] < 0
            or min(entry[1] for entry in entries) < 1
            or any(len(entry) not in (2, 3) for entry in entries)):
        raise ValueError(f"InputContext: layout_history {history!r} must list (examples "
                         "consumed, hosts) pairs in order, examples >= 0 and hosts >= 1")
    if entries[-1][1] != hosts:
        raise ValueError(f"InputContext: layout_history {history!r} ends with "
                         f"{entries[-1][1]} host(s), but num_input_pipelines={hosts}: "
                         "its last entry is the current layout")
    return entries
