"""The train input's resume cost at a position: `resume_time.py --positions` (its
docstring says what each row is). CPU seconds of this process (`time.process_time`:
every tf.data thread included), trials interleaved, medians reported."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from typing import Callable

import numpy as np

import tputrain
from tputrain.checkpointing.input_layout import InputLayout, LayoutChange
from tputrain.data import InputContext
from tputrain.data.external_state import checkpointable
from tputrain.data.blocks import block_table
from tputrain.data.positional import PositionalRecords

FEATURES = 128
BATCH = 64
LEDGER_ONLY = 10**9
# Every iterator made, kept to the end (what a resumed run holds; freeing one is
# no part of a resume's cost).
_KEEP: list = []
# The host mode's layout: one host, its batch; no earlier layout.
_LAYOUT = InputLayout(replicas=1, hosts=1, global_batch=BATCH)


def _inputs(manifest: str, positional: bool) -> tputrain.data.TFRecordInput:
    return tputrain.data.TFRecordInput(manifest=manifest, label_key="label", seed=1,
                                       positional=positional)


def _context(consumed: int = 0, history: tuple = ()) -> InputContext:
    return InputContext(global_batch_size=BATCH, examples_consumed=consumed,
                        layout_history=history)


def _cpu(work: Callable[[], object]) -> float:
    start = time.process_time()
    work()
    return time.process_time() - start


def _skip(manifest: str, consumed: int) -> None:
    """Today's distributed-mode resume: the shuffle-buffer pipeline read past the batches."""
    _KEEP.append(iter(_inputs(manifest, False)(_context()).skip(consumed // BATCH)))
    next(_KEEP[-1])


def _distributed(manifest: str, consumed: int) -> None:
    """Positional: built at the position."""
    _KEEP.append(iter(_inputs(manifest, True)(_context(consumed))))
    next(_KEEP[-1])


def _host(manifest: str, consumed: int) -> None:
    """Positional, host mode's resume (`Inputs.positioned_iterator`): built at the
    recorded layout's position, with its host history, as the host iterator's
    dataset (`checkpointable`), no saved iterator restored."""
    step = consumed // BATCH
    dataset = checkpointable(_inputs(manifest, True)(_context(
        _LAYOUT.input_steps(step) * BATCH, _LAYOUT.history())), "train")
    _KEEP.append(iter(dataset))
    next(_KEEP[-1])


def _host_state_bytes(consumed: int) -> int:
    """What a host-mode checkpoint holds of a positional input at `consumed`: the
    input layout's JSON (no iterator), as a layout resumed there records it."""
    change = LayoutChange("ckpt", consumed // BATCH, _LAYOUT, _LAYOUT)
    return len(change.continued().to_json().encode())


def _steady(manifest: str, positional: bool, batches: int) -> float:
    """CPU seconds an example over `batches` batches after the first."""
    iterator = iter(_inputs(manifest, positional)(_context()))
    _KEEP.append(iterator)
    next(iterator)
    return _cpu(lambda: [next(iterator) for _ in range(batches)]) / (batches * BATCH)


def _ledger(manifest: str) -> None:
    """The ledger alone at 1e9: the position's window and skip (`locate`), no pipeline."""
    read = tputrain.data.read_manifest(manifest)
    PositionalRecords(block_table(read.files(), [read]), seed=1, window_blocks=40
                      ).locate(LEDGER_ONLY)


def _cases(manifest: str, positions: list[int]) -> tuple[dict, dict]:
    """name -> the work one trial times; and the host checkpoints' input state sizes."""
    cases, sizes = {}, {}
    for consumed in positions:
        cases[f"skip@{consumed:.0e}"] = lambda c=consumed: _skip(manifest, c)
        cases[f"distributed@{consumed:.0e}"] = lambda c=consumed: _distributed(manifest, c)
        cases[f"host@{consumed:.0e}"] = lambda c=consumed: _host(manifest, c)
        sizes[f"{consumed:.0e}"] = _host_state_bytes(consumed)
    cases[f"distributed@{LEDGER_ONLY:.0e}"] = lambda: _distributed(manifest, LEDGER_ONLY)
    cases[f"host@{LEDGER_ONLY:.0e}"] = lambda: _host(manifest, LEDGER_ONLY)
    sizes[f"{LEDGER_ONLY:.0e}"] = _host_state_bytes(LEDGER_ONLY)
    cases[f"host_ledger_only@{LEDGER_ONLY:.0e}"] = lambda: _ledger(manifest)
    return cases, sizes


def _max_over_min(median: dict[str, float], mode: str) -> float:
    values = [v for k, v in median.items() if k.startswith(mode + "@")]
    return max(values) / min(values)


def run(quick: bool, repeats: int, log) -> dict:
    """Every case `repeats` times, interleaved (each round starts one case later)."""
    examples = 16384 if quick else 65536
    positions = [10**3, 10**4, 10**5] if quick else [10**3, 10**4, 10**5, 10**6]
    repeats = 1 if quick else repeats
    root = tempfile.mkdtemp(prefix="tputrain-bench-positions-")
    rng = np.random.RandomState(0)
    tputrain.data.write_tfrecords(
        {"x": rng.randn(examples, FEATURES).astype(np.float32),
         "label": rng.randint(0, 10, examples).astype(np.int64)}, f"{root}/train", num_shards=8)
    manifest = f"{root}/train.manifest.json"
    cases, sizes = _cases(manifest, positions)
    _distributed(manifest, 0), _skip(manifest, 0)  # warm: first tracing of each kind
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    steady: dict[str, list[float]] = {"positional": [], "shuffle_buffer": []}
    names = list(cases)
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            cpu[name].append(_cpu(cases[name]))
        modes = [("positional", True), ("shuffle_buffer", False)]
        for mode, positional in modes if round_ % 2 == 0 else modes[::-1]:
            steady[mode].append(_steady(manifest, positional, 50 if quick else 200))
        log(f"round {round_ + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s"
                                                          for k, v in cpu.items()))
    shutil.rmtree(root, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in cpu.items()}
    steady_median = {mode: statistics.median(v) for mode, v in steady.items()}
    return {
        "benchmark": "train input: build + first batch after N examples consumed (CPU s)",
        "config": {"examples": examples, "global_batch": BATCH, "hosts": 1,
                   "positions": positions, "repeats": repeats, "block_records": 256,
                   "window_blocks": 40, "data": f"{examples} examples of {FEATURES} floats "
                   "+ a label in 8 TFRecord shards written by write_tfrecords"},
        "cpu_seconds_median": median,
        "cpu_seconds_all": cpu,
        "host_checkpoint_input_state_bytes": sizes,
        "max_over_min": {mode: _max_over_min(median, mode)
                         for mode in ("skip", "distributed", "host")},
        "steady_cpu_seconds_per_example": steady_median,
        "steady_positional_vs_shuffle_buffer": (steady_median["positional"]
                                                / steady_median["shuffle_buffer"]),
    }
