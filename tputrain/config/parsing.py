"""Gin at the edges: parse config files and bindings, fail early with the fix.

Gin reports a misspelled binding only as "No configurable matching 'Traner'";
`parse_gin` re-raises it as a `ConfigError` that also names the nearest valid
configurable or parameter, before anything is built.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import logging as std_logging
import os
import re
import sys
from typing import Any, Sequence

import gin
from absl import logging

import tputrain.config.registry  # noqa: F401  (registers the configurables)
import tputrain.tasks  # noqa: F401  (registers the built-in Tasks)
from tputrain import configs  # the repository's configs/ folder, packaged


class ConfigError(ValueError):
    """A gin file or binding is invalid; the message says how to fix it."""


def _registry_names() -> list[str]:
    names = set()
    for selector, _ in gin.config._REGISTRY.items():  # pylint: disable=protected-access
        names.add(selector)
        names.add(selector.rsplit(".", 1)[-1])
    return sorted(names)


def _parameters(configurable: str) -> list[str]:
    match = gin.config._REGISTRY.get_match(configurable)  # pylint: disable=protected-access
    if match is None:
        return []
    wrapped = match.wrapped
    target = wrapped.__init__ if inspect.isclass(wrapped) else wrapped
    return [p for p in inspect.signature(target).parameters if p != "self"]


def _suggestion(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def explain_gin_error(error: Exception) -> str:
    """Turns a gin parse error into one line that names the nearest valid name."""
    text = str(error)
    first = text.splitlines()[0] if text else type(error).__name__
    location = " ".join(line.strip() for line in text.splitlines()[1:3])
    where = f" ({location})" if location else ""
    match = re.search(r"No configurable matching (?:reference )?'@?([\w.]+)", first)
    if match:
        name = match.group(1)
        # A near built-in name may be a typo, or the user's own class not registered.
        hint = _suggestion(name, _registry_names()) + (
            "; if it is yours, register it with @gin.configurable and import its module "
            "with --gin_import")
        return f"{first}{where}{hint}"
    match = re.search(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'", first)
    if match:
        configurable, parameter = match.groups()
        valid = _parameters(configurable)
        hint = _suggestion(parameter, valid) or (f"; valid parameters: {', '.join(valid)}" if valid else "")
        return f"{first}{where}{hint}"
    token = re.search(r"Failed to parse token '([^']+)'", text)
    if token and "malformed node" in first:
        word = token.group(1)
        return (f"gin could not parse the value {word!r}{where}: a string "
                f"needs quotes ('{word}'), a configurable an @ (@{word}() or @{word}), a "
                "number its digits")
    return f"gin could not parse the configuration: {first}{where}"


# An `import m`/`from m import n` or `include 'f'` line of a gin file; `from __gin__`
# (gin's own switch for dynamic registration) imports no code.
_CODE_LINE = re.compile(r"^\s*(?:import\s+([\w.]+)|from\s+(?!__gin__\b)([\w.]+)\s+import\b"
                        r"|include\s+(\S+))")


def read_as_data(path: str) -> tuple[str, list[str]]:
    """(text, what was left out): a model_dir's config without its `import` and
    `include` lines. A model_dir is data, often on shared storage: importing the
    modules its config names would run whatever file sits on sys.path under that
    name (model_dir itself, for `python -m` run from inside it)."""
    text = _read_text(path)
    kept, skipped = [], []
    for line in text.splitlines():
        found = _CODE_LINE.match(line)
        if found is None:
            kept.append(line)
        else:
            skipped.append(found.group(1) or found.group(2) or f"include {found.group(3)}")
    return "\n".join(kept) + "\n", skipped


def _read_text(path: str) -> str:
    """A config file's text; an unreadable or non-UTF-8 file is a ConfigError naming it."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise ConfigError(f"cannot read the gin file {path} ({error.strerror or error}): pass "
                          "an existing, readable file") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"the gin file {path} is not UTF-8 text (byte {error.start}: "
                          f"{error.reason}): save it as UTF-8") from None


def _parse_data_files(data_files: Sequence[str], imports: Sequence[str]) -> None:
    """Parses each model_dir config (see `read_as_data`), logging in one line what was
    skipped that would have run: modules not yet imported nor named by --gin_import."""
    for path in data_files:
        text, skipped = read_as_data(path)
        unrun = [m for m in skipped if m not in sys.modules and m not in imports]
        if unrun:
            logging.warning("tputrain: %s: not importing %s (a model_dir's config is data, not "
                            "code): pass --gin_import=MODULE for a module you trust", path,
                            ", ".join(unrun))
        try:
            gin.parse_config(text)
        except (ValueError, SyntaxError) as error:
            raise ConfigError(f"{path}: {explain_gin_error(error)}") from error


def parse_gin(gin_files: Sequence[str] = (), gin_params: Sequence[str] = (),
              search_paths: Sequence[str] = (), imports: Sequence[str] = (),
              finalize: bool = True, data_files: Sequence[str] = ()) -> None:
    """Registers tputrain's configurables, imports user modules, parses all bindings.

    Built-in configs (`configs/` in the source tree, `tputrain.configs` when
    installed) are always on the search path, so `--gin_file=digits.gin` works
    from any directory. `data_files` (a model_dir's operative config) are parsed
    first and never import or include anything (`read_as_data`).
    """
    for module in imports:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ConfigError(f"--gin_import={module}: {error}; is it on PYTHONPATH?") from error
    for path in [*search_paths, builtin_config_dir()]:
        if path and path not in gin.config._LOCATION_PREFIXES:  # pylint: disable=protected-access
            gin.add_config_file_search_path(path)
    folders = [*search_paths, builtin_config_dir()]
    files = [_find(f, folders) for f in gin_files]
    for path in files:  # gin's own message for a non-UTF-8 file does not name it
        if os.path.isfile(path):
            _read_text(path)
    _parse_data_files(data_files, imports)
    try:
        with _quiet_package_lookups():
            gin.parse_config_files_and_bindings(files, list(gin_params),
                                                finalize_config=finalize)
    except OSError as error:
        beside = _include_beside(error, files)
        if beside:
            raise ConfigError(f"{error} It is in {beside}: gin looks in its search paths, not "
                              f"beside the including file; add --gin_search_path={beside}"
                              ) from error
        raise ConfigError(f"{error} Pass an existing file or add its folder with "
                          "--gin_search_path") from error
    except ImportError as error:  # an `import` line in a gin file
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise ConfigError(f"{lines[0]} ({' '.join(lines[1:3])}): install the module or put "
                          "its folder on PYTHONPATH") from error
    except (ValueError, SyntaxError) as error:
        raise ConfigError(explain_gin_error(error)) from error
    except Exception as error:  # tokenizer errors have their own types
        if type(error).__module__.startswith(("tokenize", "gin")):
            sources = ", ".join([*files, *(["--gin_param"] if gin_params else [])])
            raise ConfigError(f"gin could not parse the configuration ({sources}): {error}: "
                              "an unclosed bracket or quote?") from error
        raise
    _check_optimizer_bindings()


def _include_beside(error: OSError, files: Sequence[str]) -> str | None:
    """The folder of a config file given that holds the file gin could not open (an
    included name: gin looks in its search paths, not the including file's folder)."""
    missing = re.search(r"Unable to open file: (.+?)\. Searched", str(error))
    folders = dict.fromkeys(os.path.dirname(os.path.abspath(f)) for f in files)
    return next((folder for folder in folders if missing and os.path.isfile(
        os.path.join(folder, missing.group(1)))), None)


def _check_optimizer_bindings() -> None:
    """`build_optimizer` passes extra keywords to the Keras optimizer, so gin takes any
    name there: a misspelled one is refused here, before anything is built."""
    from tputrain.optim.optimizers import build_optimizer, check_arguments

    bindings = gin.get_bindings(build_optimizer)
    name = bindings.get("name", "adam")
    if not isinstance(name, str):  # a macro or reference: checked when it is built
        return
    try:
        check_arguments(name, bindings)
    except ValueError as error:
        raise ConfigError(str(error)) from None


class _PackageLookupFilter(std_logging.Filter):
    """Drops gin's "Path not found: X" lines and its info line of each path it tries
    (`system_path_file_exists:X`) (see `_quiet_package_lookups`)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Path not found:", "system_path_file_exists:"))


@contextlib.contextmanager
def _quiet_package_lookups():
    """While gin parses: for each file it includes, gin asks its Python-package reader
    before the next search path, which logs an error-level "Path not found" for names
    like `digits.gin` that a later search path holds. A file found nowhere still fails
    (a ConfigError naming it), so the line says nothing; the filter is on the root
    logger (gin logs there) only for the parse."""
    quiet = _PackageLookupFilter()
    root = std_logging.getLogger()
    root.addFilter(quiet)
    try:
        yield
    finally:
        root.removeFilter(quiet)


def _find(gin_file: str, folders: Sequence[str]) -> str:
    """The file itself, or the first folder's copy of it: gin would ask its Python
    package reader first, which logs an error-level "Path not found" for names
    like `digits.gin` on every successful run."""
    if os.path.isfile(gin_file):
        return gin_file
    for folder in folders:
        candidate = os.path.join(folder, gin_file)
        if folder and os.path.isfile(candidate):
            return candidate
    return gin_file  # gin reports it missing, with its own search


def builtin_config_dir() -> str:
    """The directory of the configs shipped with tputrain."""
    return os.path.dirname(os.path.abspath(configs.__file__))


def require_bound(*bindings: str) -> None:
    """Fails with the fix when a required binding (e.g. 'Trainer.task') is missing."""
    for binding in bindings:
        try:
            gin.query_parameter(binding)
        except ValueError:
            raise ConfigError(f"{binding} is not bound: add `{binding} = ...` to your gin file "
                              f"or pass --gin_param='{binding}=...'") from None


def bound_or(binding: str, default: Any) -> Any:
    """The value gin binds to `binding`, or `default` when it is not bound."""
    try:
        return gin.query_parameter(binding)
    except ValueError:  # not bound (or its configurable not registered)
        return default


def clear_config() -> None:
    """Forgets every binding (after a config was parsed only to be read)."""
    gin.clear_config()


def write_operative_config(model_dir: str) -> str:
    """Writes the bindings actually used to model_dir/operative_config.gin (whole: a
    temp file of this writer's own, renamed)."""
    from tputrain.checkpointing.atomic import write_atomically
    from tputrain.checkpointing.run_directory import RunDirectory

    return write_atomically(RunDirectory(model_dir).operative_config, gin.operative_config_str())


def without_gin_notes(error: BaseException) -> BaseException:
    """`error` as it was raised, without the lines gin appends to any error raised in a
    configurable ("In call to configurable 'Trainer'"), when no gin binding is in use:
    a Python caller with no gin config (`tputrain.fit`) reads its own error only."""
    if gin.config_str().strip():
        return error
    while (getattr(type(error).__init__, "__module__", None) == "gin.utils"
           and error.__context__ is not None):
        error = error.__context__
    return error
