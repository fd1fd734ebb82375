"""A positional input's rows (`TFRecordInput(positional=True, to_static=...)`): packed
within each window, so a resume re-packs one window instead of every row before.

Rows are not records: how many rows a window packs into depends on its records'
lengths, so a row position cannot follow from the examples consumed by
arithmetic. Here the packer (any `to_static`) restarts at each window of the
host's sequence (`tputrain.data.ledger`), and each row carries two tags: the
host that read it (`ROW_HOST`) and, on its window's last row only, that window's
row count (`ROW_END`, else 0). The train step strips them and sums, per host,
over the rows it trained on: rows, windows ended (rows with an end) and the rows
of those windows (the ends' sum), the way it sums a mixture's per-source counts
(`tputrain.loop.source_counts`, in the checkpoint). Host h's place is then
(windows ended, rows - rows of the ended windows): the window to re-pack and the
rows of it to pass over, in either input mode and on any global batch. A window
ends with its partly filled row (`bins` of them with first-fit packing).
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from tputrain.core import tracing

ROW_HOST = "row_host"  # the input pipeline that read a row
ROW_END = "row_end"  # on a window's last row its rows, else 0
ROW_KEYS = (ROW_HOST, ROW_END)
_ENDLESS = 2**62  # windows of a repeated stream: as good as for ever

Place = tuple[int, int]  # (windows of the host's sequence ended, rows into the next)


def tagged(rows: tf.data.Dataset, host: int) -> tf.data.Dataset:
    """One window's rows, each tagged with `host` and (the last) the window's rows:
    one row is held back, so the last is known when the window ends."""
    spec = rows.element_spec
    if not isinstance(spec, dict):
        raise TypeError("TFRecordInput(positional=True): to_static must give rows as dicts "
                        f"of features (PackSequences does), got {spec}")
    taken = sorted(set(spec) & set(ROW_KEYS))
    if taken:
        raise ValueError(f"TFRecordInput(positional=True): the rows have a feature named "
                         f"{taken[0]!r}, the name of the tag each packed row carries for its "
                         f"place: rename the feature (in the parser or to_static)")
    blank = {name: tf.zeros(s.shape, s.dtype) for name, s in spec.items()}
    marked = rows.map(lambda row: (row, False)).concatenate(
        tf.data.Dataset.from_tensors((blank, True)))

    def step(state, item):
        held, count = state
        row, final = item
        out = {**held, ROW_HOST: tf.constant(host, tf.int64),
               ROW_END: tf.where(final, count, tf.constant(0, tf.int64))}
        return (row, count + 1), (count > 0, out)
    return marked.scan((blank, tf.constant(0, tf.int64)), step).filter(
        lambda ready, row: ready).map(lambda ready, row: row)


def window_rows(window: Callable[[tf.Tensor], tf.data.Dataset], host: int, hosts: int,
                place: Place, repeat: bool, in_pass: int) -> tf.data.Dataset:
    """The host's rows from `place`: `window(w)` gives window w's rows (its records,
    parsed, through to_static); the host's k-th window is `host + k * hosts`."""
    first, skip = place
    ends = _ENDLESS if repeat else in_pass
    return tf.data.Dataset.range(first, ends).flat_map(tracing.graph_helper(
        lambda k: tagged(window(host + k * hosts), host))).skip(skip)


def places(totals: Sequence[Sequence[int]]) -> tuple[Place, ...]:
    """Each host's place from its sums (rows, windows ended, rows of those windows)."""
    return tuple((int(ended), int(rows) - int(done)) for rows, ended, done in totals)


def row_sums(features: dict[str, tf.Tensor], hosts: int) -> tf.Tensor:
    """int32 [hosts, 3]: per host, rows, windows ended and their rows in a batch (any
    leading axes): what the step sums (`places` reads the totals)."""
    host = tf.reshape(tf.cast(features[ROW_HOST], tf.int32), [-1])
    end = tf.reshape(tf.cast(features[ROW_END], tf.int32), [-1])
    each = tf.stack([tf.ones_like(end), tf.cast(end > 0, tf.int32), end], axis=1)
    return tf.math.unsorted_segment_sum(each, host, hosts)
