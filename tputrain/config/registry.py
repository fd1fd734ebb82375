"""What gin can configure, registered in one place; the library itself is gin-free.

Library code takes its knobs as arguments and options classes (`TrainerOptions`
and its parts); this module makes those classes, the `Trainer` and the CLI's
builders gin configurables under their public names, so a gin file says
`CheckpointOptions.async_save = True` or `Trainer.precision = 'mixed_bfloat16'`.
`tputrain.load_api()` (run by the first use of a public name) and `tputrain.config.parsing`
(`parse_gin`, the CLI's) import it; to parse with gin's own functions, import this
module first.

Old gin names keep working as deprecated aliases of the options fields that
replaced them (`LEGACY`): where a run builds an options part (`TrainerOptions`'s
parts, the precision audit: `tputrain.options.build_part`), an alias fills a field
neither the caller nor the new binding set, and a warning names the replacement.
No class's `__init__` is replaced by tputrain (gin's registration wraps it, as
`gin.configurable` does for any class), and importing tputrain changes nothing in gin.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import gin
import tensorflow as tf
from absl import logging

from tputrain.core import builders
from tputrain.optim import optimizers, schedules
from tputrain import options
from tputrain.actions.best import BestCheckpoint
from tputrain.actions.early_stopping import EarlyStopping
from tputrain.checkpointing.manager import Checkpointer
from tputrain.data.mixture import MixtureInput
from tputrain.data.options import InputOptions
from tputrain.data.packing import PackSequences
from tputrain.data.padding import PadSequences
from tputrain.data.tfds import TFDSInput
from tputrain.data.tfrecord import TFRecordInput
from tputrain.distribution import cluster, strategy
from tputrain.distribution.communication import CommunicationOptions
from tputrain.actions.export import Export
from tputrain.observe.flops import peak_flops
from tputrain.fault_tolerance.guard import NonFiniteGuard
from tputrain.actions.init_checkpoint import InitCheckpoint
from tputrain.options import CheckpointOptions, PrecisionOptions, ProfilingOptions, RematOptions
from tputrain.precision import audit
from tputrain.precision import policy as precision
from tputrain.precision.layers import override_layer_dtypes
from tputrain.tasks.classifier import MLPClassifierTask
from tputrain.tasks.digits import DigitsTask
from tputrain.tasks.keras_hub_lm import KerasHubLMTask
from tputrain.tasks.text_lm import TextLMTask
from tputrain.tasks.transformer import SyntheticLMTask
from tputrain.tracking import MLflowTracker, WandbTracker
from tputrain.trainer import Trainer

# Options class -> {field: the old binding it replaces}.
LEGACY: dict[type, dict[str, str]] = {
    CheckpointOptions: {"async_save": "Checkpointer.async_save",
                        "check_finite": "Checkpointer.check_finite"},
    PrecisionOptions: {"policy": "set_precision_policy.name",
                       "keep_float32_layers": "override_layer_dtypes.keep_float32_layers"},
    ProfilingOptions: {"device_kind": "peak_flops.device_kind",
                       "peak_flops_per_device": "peak_flops.peak_flops_per_device"},
}
# What a deprecated binding's warning tells to bind instead, where not the field.
_INSTEAD = {"set_precision_policy.name": "Trainer.precision (or PrecisionOptions.policy)"}


def _bound(binding: str) -> tuple[bool, Any]:
    try:
        return True, gin.query_parameter(binding)
    except ValueError:  # not bound (or its configurable not registered)
        return False, None


def _with_aliases(cls: type, aliases: Mapping[str, str]) -> Callable[..., Any]:
    """A builder of `cls` (`tputrain.options.build_part`) that fills each field neither
    the caller nor `cls`'s own binding set from its deprecated binding, with a warning
    naming the replacement. The class and its `__init__` stay as written."""
    def build(**given: Any) -> Any:
        for field, old in aliases.items():
            if field in given or _bound(f"{cls.__name__}.{field}")[0]:
                continue
            found, value = _bound(old)
            if found:
                instead = _INSTEAD.get(old, f"{cls.__name__}.{field}")
                logging.warning("tputrain: %s = %r is deprecated: bind %s instead",
                                old, value, instead.replace(" (", f" = {value!r} (", 1)
                                if "(" in instead else f"{instead} = {value!r}")
                given[field] = value
        return cls(**given)

    return build


def _register_options() -> None:
    """The options classes, in place: `CheckpointOptions()` anywhere takes gin's
    bindings (then, as a run builds them, the deprecated aliases, then the defaults)."""
    for cls in (CheckpointOptions, PrecisionOptions, ProfilingOptions, RematOptions,
                CommunicationOptions):
        if cls in LEGACY:
            options.register_part_builder(cls, _with_aliases(cls, LEGACY[cls]))
        registered = gin.config._INVERSE_REGISTRY.get(cls)  # pylint: disable=protected-access
        if registered is None:  # not imported twice (importlib.reload)
            gin.configurable(cls)


def _register_aliases() -> None:
    """The old names, so that gin files binding them still parse (their values are
    read by `_with_aliases`; nothing calls these registrations)."""
    # Checkpointer under the module it was registered from before it moved.
    for target, module, allowlist in (
            (Checkpointer, "tputrain.checkpoint", ["async_save", "check_finite"]),
            (override_layer_dtypes, None, ["keep_float32_layers"]),
            (peak_flops, None, ["device_kind", "peak_flops_per_device"])):
        if gin.config._INVERSE_REGISTRY.get(target) is None:  # pylint: disable=protected-access
            gin.external_configurable(target, module=module, allowlist=allowlist)


# Classes gin configures in place: `TFRecordInput()` anywhere takes gin's bindings.
CLASSES = (Trainer, NonFiniteGuard, BestCheckpoint, EarlyStopping, Export, InitCheckpoint,
           InputOptions, TFDSInput, TFRecordInput, MixtureInput, PackSequences, PadSequences,
           MLPClassifierTask, DigitsTask, SyntheticLMTask, TextLMTask, KerasHubLMTask,
           MLflowTracker, WandbTracker)


def _register_classes() -> None:
    for cls in CLASSES:
        if gin.config._INVERSE_REGISTRY.get(cls) is None:  # pylint: disable=protected-access
            gin.configurable(cls)


def _function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as gin configures it (a function cannot be configured in place: callers
    that should see gin's bindings call this version: `tputrain.<name>` is it)."""
    return gin.external_configurable(fn, module=fn.__module__)


_register_options()
_register_aliases()
_register_classes()
# The public builders, configured: `tputrain.build_optimizer` etc. name these, so
# `Task.build_optimizer` and `Trainer(strategy=None)` see `build_optimizer.*` and
# `resolve_strategy.*` bindings.
build_optimizer = _function(optimizers.build_optimizer)
resolve_strategy = _function(strategy.resolve_strategy)
split_cpu = _function(strategy.split_cpu)
warmup_schedule = _function(schedules.warmup_schedule)
audit_precision = _function(audit.audit_precision)
set_precision_policy = _function(precision.set_precision_policy)  # deprecated name
join_watchdog: Callable[..., Any] = _function(cluster.join_watchdog)  # the CLI's


def configure_devices() -> None:
    """Applies the device bindings of a parsed gin config: `split_cpu.num_devices`.

    Gin only records a binding; nothing calls `split_cpu` by itself, so a bound
    `split_cpu.num_devices` was silently ignored. Call this after parsing gin and
    before any TensorFlow op runs (the CLI does); it does nothing when unbound.
    """
    found, num_devices = _bound("split_cpu.num_devices")
    if not found:
        return
    try:
        split_cpu()  # gin supplies num_devices (and records it in the operative config).
    except RuntimeError as e:
        have = len(tf.config.list_logical_devices("CPU"))
        raise RuntimeError(
            f"split_cpu.num_devices = {num_devices} but TensorFlow is already initialised "
            f"with {have} logical CPU device(s): something ran a TensorFlow op before "
            f"the config was applied (a --gin_import module or a gin `import` running "
            f"TensorFlow ops at import?); move those ops into functions, or call "
            f"split_cpu before any TensorFlow op runs."
        ) from e


# The configured builders, for the runs that are passed none (tputrain/core/builders.py).
builders.install("resolve_strategy", resolve_strategy)
builders.install("build_optimizer", build_optimizer)
builders.install("configure_devices", configure_devices)
