"""`InputOptions`: the tf.data knobs shared by every tputrain input builder.

One gin-configurable object instead of a dozen arguments on each builder:
`TFRecordInput.options = @InputOptions()` and `InputOptions.threadpool_size = 1`
in a gin file reach threading, autotuning, prefetch depth and the tf.data
service without code changes. The builders call `apply` on their batched,
parsed dataset (per host, outside any replica context).
"""

from __future__ import annotations

import dataclasses
import logging as std_logging

import tensorflow as tf

from tputrain.core.checks import check_bool, check_int

_PROCESSING_MODES = ("parallel_epochs", "distributed_epoch")
_EXTERNAL_STATE = {"fail": "FAIL", "warn": "WARN", "ignore": "IGNORE"}


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """tf.data options for one input pipeline (per host).

    Args:
        threadpool_size: threads of a private pool for this pipeline; None
            shares TensorFlow's inter-op pool. On hosts with few cores, a small
            pool (1-2) keeps tf.data from competing with the train step.
        max_intra_op_parallelism: threads one tf.data op may use; None is
            tf.data's default.
        autotune: let tf.data tune parallelism and buffer sizes. Off, every
            AUTOTUNE setting runs at its minimum, and freeing iterators no longer
            waits on the autotuning thread (which can block for seconds).
        autotune_ram_budget: bytes tf.data may use for prefetch buffers when
            autotuning; None is tf.data's default (half the host RAM).
        autotune_cpu_budget: cores tf.data may use when autotuning; None: all.
        prefetch: batches prefetched at the end of the pipeline; None lets
            tf.data choose (AUTOTUNE); 0: no prefetch. Deeper buffers absorb
            bursty input.
        service_address: a tf.data service dispatcher (e.g.
            "grpc://dispatcher:5050"); preprocessing then runs on the service's
            workers instead of this host. The iterator of such a pipeline is not
            checkpointable: use it with `Trainer.input_mode="distributed"`,
            which resumes by skipping batches.
        service_job_name: share one service job between consumers (e.g. hosts
            reading disjoint parts of one `distributed_epoch` job).
        service_processing_mode: "parallel_epochs" (each worker produces the
            whole dataset) or "distributed_epoch" (workers split one epoch).
        external_state_policy: what saving the iterator in a checkpoint does when
            the pipeline has state tf.data cannot save (stateful random ops such
            as `tf.image.random_*`, Keras random layers, a `py_function`, a Python
            generator such as `tfds.testing.mock_data`'s). None: the Trainer saves
            the iterator without that state and warns once, naming it; "ignore":
            the same, silently; "warn": tf.data's warning at every save; "fail":
            the Trainer raises `InputStateError` before training. Without that
            state a resumed run draws other random numbers (and restarts a
            generator); `tputrain.data.stateless_augment` resumes exactly.
        symbolic_checkpoint: iterator checkpoints hold positions, not buffered
            elements (`tf.data.Options.experimental_symbolic_checkpoint`): with
            `TFRecordInput(positional=True)` a host-mode checkpoint shrinks from a
            window of records to a few KB, but every element then carries its
            position: CPU per example rose about 13x in benchmarks/resume_time.py's
            pipeline, and TF 2.21 segfaulted now and then destroying such iterators
            (docs/input_pipeline.md). Not with a shuffle buffer (it saves its buffer).
    """

    threadpool_size: int | None = None
    max_intra_op_parallelism: int | None = None
    autotune: bool = True
    autotune_ram_budget: int | None = None
    autotune_cpu_budget: int | None = None
    prefetch: int | None = None
    service_address: str | None = None
    service_job_name: str | None = None
    service_processing_mode: str = "parallel_epochs"
    external_state_policy: str | None = None
    symbolic_checkpoint: bool = False

    def __post_init__(self):
        for name, minimum in (("threadpool_size", 1), ("max_intra_op_parallelism", 1),
                              ("autotune_ram_budget", 1), ("autotune_cpu_budget", 1),
                              ("prefetch", 0)):
            # Stored as a plain int: tf.data.Options refuses numpy ints.
            object.__setattr__(self, name, check_int("InputOptions", name, getattr(self, name),
                                                     minimum, allow_none=True))
        check_bool("InputOptions", "autotune", self.autotune)
        check_bool("InputOptions", "symbolic_checkpoint", self.symbolic_checkpoint)
        if self.service_processing_mode not in _PROCESSING_MODES:
            raise ValueError(
                f"InputOptions.service_processing_mode must be one of {_PROCESSING_MODES}, "
                f"got {self.service_processing_mode!r}")
        if self.service_address is not None and (
                not isinstance(self.service_address, str) or "://" not in self.service_address):
            raise ValueError(
                f"InputOptions.service_address must look like 'grpc://host:port', got "
                f"{self.service_address!r}")
        if self.external_state_policy not in (None, *_EXTERNAL_STATE):
            raise ValueError(f"InputOptions.external_state_policy must be None or one of "
                             f"{sorted(_EXTERNAL_STATE)}, got {self.external_state_policy!r}")
        if self.service_job_name is not None and self.service_address is None:
            raise ValueError("InputOptions.service_job_name is set but service_address is not: "
                             "set service_address to the tf.data service dispatcher")

    def tf_options(self) -> tf.data.Options:
        """The `tf.data.Options` these settings amount to."""
        options = tf.data.Options()
        if self.threadpool_size is not None:
            options.threading.private_threadpool_size = self.threadpool_size
        if self.max_intra_op_parallelism is not None:
            options.threading.max_intra_op_parallelism = self.max_intra_op_parallelism
        if not self.autotune:  # on is tf.data's default: left unset, a probe's copy
            options.autotune.enabled = False  # turns it off without a conflict note
        if self.symbolic_checkpoint:
            options.experimental_symbolic_checkpoint = True
        if self.autotune_ram_budget is not None:
            options.autotune.ram_budget = self.autotune_ram_budget
        if self.autotune_cpu_budget is not None:
            options.autotune.cpu_budget = self.autotune_cpu_budget
        if self.external_state_policy is not None:
            options.experimental_external_state_policy = getattr(
                tf.data.experimental.ExternalStatePolicy, _EXTERNAL_STATE[self.external_state_policy])
        return options

    def apply(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """Offloads to the tf.data service if configured, prefetches, sets options.

        Called on a finished (batched, parsed) per-host dataset: everything up to
        here runs on the service's workers when `service_address` is set.
        """
        if self.service_address is not None:
            dataset = dataset.apply(tf.data.experimental.service.distribute(
                processing_mode=self.service_processing_mode,
                service=self.service_address,
                job_name=self.service_job_name))
        if self.prefetch != 0:
            dataset = dataset.prefetch(
                tf.data.AUTOTUNE if self.prefetch is None else self.prefetch)
        return dataset.with_options(self.tf_options())


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` for a throwaway iterator (a probe of its first element), with tf.data's
    autotuning off; the dataset given keeps its own options.

    The first element starts the tuning thread. When the iterator is freed before that
    thread has run (a probe, under load), TensorFlow logs "Optimization loop failed:
    CANCELLED" on the user's console, and freeing a tuned iterator can wait for the
    thread's next wake-up."""
    options = tf.data.Options()
    options.autotune.enabled = False
    quiet = _WithoutOptionChangeNote()
    absl_logger = std_logging.getLogger("absl")  # where tf.data's merge logs its note
    absl_logger.addFilter(quiet)
    try:
        return dataset.with_options(options)
    finally:
        absl_logger.removeFilter(quiet)


class _WithoutOptionChangeNote(std_logging.Filter):
    """Drops tf.data's "Changing the value of option enabled from True to False" (a
    pipeline that turns autotuning on, merged with the probe's off): the change is the
    point, and the note reached every run's console."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Changing the value of option")
