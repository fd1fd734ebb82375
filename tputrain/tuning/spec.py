"""The tuning spec: one YAML file that `tputrain tune` (Optuna, locally) and
`tputrain vertex-spec --tune` (Vertex AI's HyperparameterTuningJob) both read.

    metric: accuracy          # an eval metric (with named eval sets: "<set>/accuracy")
    goal: maximize            # or minimize
    trials: 6                 # trials in all
    parallel: 1               # trials at once
    params:                   # gin bindings
      build_optimizer.learning_rate: {min: 1.0e-4, max: 1.0e-1, scale: log}
      DigitsTask.dropout: {min: 0.0, max: 0.5}
      Trainer.global_batch_size: {type: int, min: 32, max: 256, scale: log}
      build_optimizer.name: {values: [adam, sgd]}

A parameter is a float range (`min`, `max`, `scale` linear or log), an int range
(`type: int`) or a choice (`values`: numbers, strings, lists; each bound as its
gin literal, a string starting with `@` as a reference). Optional: `pruner`
(`median`, the default, or `none`) and `seed` (the sampler's, default 0).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

GOALS = ("maximize", "minimize")
SCALES = ("linear", "log")
PRUNERS = ("median", "none")
_BINDING = re.compile(r"^([\w.]+/)*[\w.]*\w\.\w+$")


class SpecError(ValueError):
    """A tuning spec that cannot work; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One searched gin binding: a float or int range, or a choice of values."""

    binding: str
    kind: str  # "float", "int" or "choice"
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    values: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class TuningSpec:
    metric: str
    goal: str
    trials: int
    parallel: int
    params: tuple[Param, ...]
    pruner: str = "median"
    seed: int = 0

    @property
    def maximize(self) -> bool:
        return self.goal == "maximize"


def gin_literal(value: Any) -> str:
    """`value` as gin text: numbers and lists as Python writes them, a string quoted,
    unless it is a reference (`@Name()`)."""
    if isinstance(value, str) and value.startswith("@"):
        return value
    if isinstance(value, float):
        return repr(value)
    return repr(tuple(value) if isinstance(value, list) else value)


def binding_lines(params: Mapping[str, Any]) -> list[str]:
    """The gin bindings of one trial's values ({binding: value})."""
    return [f"{name} = {gin_literal(value)}" for name, value in params.items()]


def _number(name: str, field: str, value: Any, kind: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"params.{name}.{field} must be a number, got {value!r}")
    if kind == "int" and value != int(value):
        raise SpecError(f"params.{name}.{field} must be a whole number (type: int)")
    return int(value) if kind == "int" else float(value)


def parse_param(name: str, body: Any) -> Param:
    """One `params` entry, checked."""
    if not _BINDING.match(name):
        raise SpecError(f"params: {name!r} is not a gin binding (write Configurable.parameter, "
                        "e.g. build_optimizer.learning_rate)")
    if not isinstance(body, Mapping):
        raise SpecError(f"params.{name} must be a mapping: {{min: ..., max: ...}} or "
                        "{values: [...]}")
    unknown = set(body) - {"type", "min", "max", "scale", "values"}
    if unknown:
        raise SpecError(f"params.{name}: unknown key(s) {sorted(unknown)}: use type, min, max, "
                        "scale or values")
    if "values" in body:
        values = body["values"]
        if not isinstance(values, list) or len(values) < 2:
            raise SpecError(f"params.{name}.values must list at least 2 choices")
        return Param(name, "choice", values=tuple(values))
    kind = body.get("type", "float")
    if kind not in ("float", "int"):
        raise SpecError(f"params.{name}.type must be float or int, got {kind!r}")
    if "min" not in body or "max" not in body:
        raise SpecError(f"params.{name} needs min and max (or values)")
    low, high = (_number(name, key, body[key], kind) for key in ("min", "max"))
    scale = body.get("scale", "linear")
    if scale not in SCALES or low >= high or (scale == "log" and low <= 0):
        raise SpecError(f"params.{name}: need min < max, scale linear or log, and min > 0 "
                        f"with scale log (got min {low}, max {high}, scale {scale!r})")
    return Param(name, kind, low, high, log=scale == "log")


def _count(body: Mapping[str, Any], key: str, default: int) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{key} must be a whole number >= 1, got {value!r}")
    return value


def parse_spec(body: Any) -> TuningSpec:
    """A spec from its parsed YAML; SpecError names what to fix."""
    if not isinstance(body, Mapping):
        raise SpecError("the tuning spec must be a mapping with metric, goal, trials, params")
    unknown = set(body) - {"metric", "goal", "trials", "parallel", "params", "pruner", "seed"}
    if unknown:
        raise SpecError(f"unknown key(s) {sorted(unknown)}: use metric, goal, trials, "
                        "parallel, params, pruner, seed")
    metric, goal = body.get("metric"), body.get("goal", "maximize")
    if not isinstance(metric, str) or not metric:
        raise SpecError("metric: name the eval metric to tune (e.g. accuracy, loss, "
                        "<set>/accuracy)")
    if goal not in GOALS or body.get("pruner", "median") not in PRUNERS:
        raise SpecError(f"goal must be one of {GOALS} and pruner one of {PRUNERS}")
    params = body.get("params")
    if not isinstance(params, Mapping) or not params:
        raise SpecError("params: list at least one gin binding to search")
    return TuningSpec(metric, goal, _count(body, "trials", 10), _count(body, "parallel", 1),
                      tuple(parse_param(name, params[name]) for name in params),
                      body.get("pruner", "median"), int(body.get("seed", 0)))


def load_spec(path: str) -> TuningSpec:
    """Reads and checks the YAML spec at `path` (pyyaml: the `tune` extra)."""
    try:
        import yaml  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise SpecError("reading a tuning spec needs pyyaml: pip install 'tputrain[tune]'") \
            from error
    try:
        with open(path, encoding="utf-8") as f:
            body = yaml.safe_load(f)
    except OSError as error:
        raise SpecError(f"cannot read the tuning spec {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise SpecError(f"{path} is not YAML: {str(error).splitlines()[0]}") from None
    return parse_spec(body)
