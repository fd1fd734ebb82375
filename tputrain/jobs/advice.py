"""The knobs `tputrain diagnose` names for an input- or compute-bound step, checked
against what the run already does.

Advice to turn a knob the config already turns misleads (advising
`TFRecordInput.cache='memory'` to a pipeline that serves its batches from RAM), so
each knob is given only when the run's setup (`RunSetup`: the Trainer's settings
and `tputrain.data.pipeline_facts` of its train dataset) leaves it open; the knobs
already turned are listed as `in_place` instead. An unknown pipeline (None) gets
every input knob.
"""

from __future__ import annotations

import dataclasses

from tputrain.data.pipeline_facts import PipelineFacts, pipeline_facts
from tputrain.precision.policy import _is_tpu_strategy  # pylint: disable=protected-access
from tputrain.runtime.run_view import RunView, view_of


STALL_GOAL = 0.05  # the seeds' rule: input wait under 5% of the step
DEEP_PREFETCH = 8  # the prefetch depth the advice names
FEW_THREADS = 2  # a private tf.data pool this small already leaves the step its cores


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What the run already does: its train pipeline (None: unknown) and Trainer settings."""

    pipeline: PipelineFacts | None = None
    input_mode: str = "host"
    steps_per_fetch: int = 1
    precision: str = "float32"
    tpu: bool = False
    global_batch_size: int | None = None
    steps_per_loop: int | None = None


@dataclasses.dataclass
class Advice:
    """Why the step is bound as it is, the knobs to turn, and those already turned."""

    reason: str
    advice: list[str]
    in_place: list[str]


def run_setup(view: RunView) -> RunSetup:
    """The setup of a built Trainer, its train dataset's stages read (not run)."""
    view = view_of(view)  # a Trainer, an action's context or a view
    return RunSetup(pipeline=pipeline_facts(view.inputs.train_dataset),
                    input_mode=view.plan.input_mode,
                    steps_per_fetch=view.plan.steps_per_fetch,
                    precision=str(view.plan.precision), tpu=_is_tpu_strategy(view.strategy),
                    global_batch_size=view.plan.batch.global_batch_size,
                    steps_per_loop=view.plan.options.steps_per_loop)


class _Knobs:
    """Collects advice, or what the setup already does in its place."""

    def __init__(self) -> None:
        self.advice: list[str] = []
        self.in_place: list[str] = []

    def add(self, text: str, done: str | None = None) -> None:
        """`text` unless the setup already does it (`done` says what it does)."""
        if done:
            if done not in self.in_place:
                self.in_place.append(done)
        else:
            self.advice.append(text)


def _cache_done(pipeline: PipelineFacts | None) -> str | None:
    if pipeline is None or not pipeline.cached:
        return None
    if pipeline.in_memory:
        return ("the examples are parsed once and batches served from RAM "
                "(TFRecordInput.cache='memory')")
    return "the pipeline caches (Dataset.cache / TFRecordInput.cache)"


def _no_per_batch_work(pipeline: PipelineFacts | None) -> str | None:
    """Said when nothing is left to precompute or offload: cached, no map after."""
    if pipeline is None or not pipeline.cached or pipeline.maps_after_cache:
        return None
    return _cache_done(pipeline)


def _slow_input_knobs(knobs: _Knobs, pipeline: PipelineFacts | None) -> None:
    """The input pipeline alone is slower than the step."""
    knobs.add("parse in parallel and vectorized: batch before parsing (TFRecordInput does), "
              "give per-example maps num_parallel_calls=tf.data.AUTOTUNE, or rewrite them per "
              "batch", None if pipeline is None or pipeline.sequential_maps
              else "no sequential map: every map runs in parallel")
    knobs.add("precompute expensive preprocessing once and store the result "
              "(tputrain.data.write_tfrecords, `tputrain write-tfrecords`)",
              _no_per_batch_work(pipeline))
    knobs.add("read more files at once: at least 16 shards per host (write_tfrecords("
              "num_hosts=..., target_shard_mb=...)) and TFRecordInput.cycle_length",
              None if pipeline is None or (pipeline.reads_files and not pipeline.cached)
              else _cache_done(pipeline) or "no files are read while training")
    knobs.add("cache what fits: TFRecordInput.cache='memory' (parsed, in RAM) or "
              "TFRecordInput.cache='/local/disk/prefix' for remote data", _cache_done(pipeline))
    deep = pipeline is not None and (pipeline.prefetch or 0) >= DEEP_PREFETCH
    knobs.add(f"deeper prefetch for bursty input: InputOptions.prefetch={DEEP_PREFETCH} "
              "(TFRecordInput.options=@InputOptions())",
              f"InputOptions.prefetch={pipeline.prefetch}" if deep else None)
    knobs.add("offload preprocessing to other machines with the tf.data service: "
              "InputOptions.service_address='grpc://dispatcher:5050'", _service_done(pipeline))


def _service_done(pipeline: PipelineFacts | None) -> str | None:
    if pipeline is not None and pipeline.service:
        return "the tf.data service preprocesses (InputOptions.service_address)"
    return _no_per_batch_work(pipeline)


def _competing_input_knobs(knobs: _Knobs, pipeline: PipelineFacts | None) -> None:
    """The input keeps up alone but slows the step when both run."""
    knobs.add("cache the parsed data in RAM if it fits: TFRecordInput.cache='memory' (one "
              "gather per batch instead of per-example work)", _cache_done(pipeline))
    threads = pipeline.threadpool_size if pipeline is not None else None
    knobs.add(f"give tf.data fewer threads: InputOptions.threadpool_size=1 or {FEW_THREADS} "
              "(TFRecordInput.options=@InputOptions())",
              f"InputOptions.threadpool_size={threads}" if threads and threads <= FEW_THREADS
              else None)
    knobs.add("move preprocessing off this host: precompute it (write_tfrecords) or use the "
              "tf.data service (InputOptions.service_address)", _service_done(pipeline))


def _fetch_knobs(knobs: _Knobs, setup: RunSetup) -> None:
    if setup.input_mode != "host":
        return
    fetch = setup.steps_per_fetch
    knobs.add("fetch several steps' batches at once: Trainer.steps_per_fetch (a divisor of "
              "steps_per_loop)", f"Trainer.steps_per_fetch={fetch}" if fetch > 1 else None)
    if setup.tpu or setup.pipeline is None:
        knobs.add("on TPU pods use Trainer.input_mode='distributed' (device prefetch)")


def _compute_knobs(knobs: _Knobs, setup: RunSetup) -> None:
    mixed = setup.precision.startswith("mixed")
    batch = f" (now {setup.global_batch_size})" if setup.global_batch_size else ""
    loop = f" (now {setup.steps_per_loop})" if setup.steps_per_loop else ""
    first = "" if mixed else "Trainer.precision='mixed_bfloat16', "
    knobs.add(f"speed up the step itself: {first}a larger Trainer.global_batch_size{batch}, "
              f"more Trainer.steps_per_loop{loop}")
    if mixed:
        knobs.in_place.append(f"Trainer.precision={setup.precision!r}")


def step_advice(bottleneck: str, input_only: float, compute_only: float, stall: float,
                setup: RunSetup) -> Advice:
    """The reason and the knobs for an input- or compute-bound step (steps per second;
    `stall` the input's share of the step)."""
    knobs = _Knobs()
    if bottleneck == "compute":
        _compute_knobs(knobs, setup)
        reason = (f"input wait {100 * stall:.1f}% < {100 * STALL_GOAL:.0f}% of the step: the "
                  "input pipeline keeps up")
        return Advice(reason, knobs.advice, knobs.in_place)
    if input_only < 1.1 * compute_only:
        reason = (f"the input pipeline alone delivers {input_only:.1f} steps/s but the step "
                  f"could run {compute_only:.1f} steps/s")
        _slow_input_knobs(knobs, setup.pipeline)
    else:
        reason = (f"the input pipeline alone keeps up ({input_only:.1f} >= {compute_only:.1f} "
                  "steps/s) but slows the step when both run: they compete for the host's cores")
        _competing_input_knobs(knobs, setup.pipeline)
    _fetch_knobs(knobs, setup)
    if not knobs.advice:
        knobs.advice.append(
            "the input knobs tputrain checks are already turned (see 'already'): what is left "
            "is the step and the pipeline sharing this host; a larger Trainer.global_batch_size "
            "gives the host fewer batches per example")
    return Advice(reason, knobs.advice, knobs.in_place)
