"""`tputrain [COMMAND] [flags]`: picks the command and hands it the rest of argv.

`tputrain --help` lists the commands from `SUMMARIES` without importing any of
them, and a command imports only its own module: the commands import the
library, and with it TensorFlow, which listing them does not need. For the same
reason `tputrain COMMAND --help` prints the command's help as rendered in
`tputrain/cli/help_text.py` (`python tools/docgen.py write` regenerates it; a test
checks it matches the definitions) and exits 0, where absl's `--help` exits 1.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import pprint
import signal
import sys
import textwrap
from types import ModuleType

from absl import flags  # light: no TensorFlow

from tputrain.fault_tolerance.preemption_early import hold_early_signals  # no TensorFlow
from tputrain.runtime.process_exit import end_process

DEFAULT_COMMAND = "run"  # `tputrain --gin_file=...` trains

# One line each for `tputrain --help` (and the CLI reference's table).
SUMMARIES = {
    "run": "train a gin config (the default: `tputrain --gin_file=...` runs it)",
    "launch": "run N local worker processes as one MultiWorkerMirrored cluster",
    "diagnose": "where a step's time goes: input, compute or communication, and the knob to turn",
    "find-batch": "the largest per-replica batch that fits and pays, and the scaled learning rate",
    "goodput": "where a job's wall-clock time went, restarts included (--model_dir=DIR)",
    "audit-precision": "which layers drift in bf16/fp16, and does it change the metrics?",
    "write-tfrecords": "convert .npz/.csv arrays into sharded TFRecords with a manifest",
    "vertex-spec": "write (or --submit) a Vertex AI CustomJob that trains a gin config",
    "export": "write a checkpoint as a SavedModel for serving (best or latest, or --step)",
    "eval": "evaluate a checkpoint (latest or --step), or --continuous each new one as it appears",
    "predict": "write every example's outputs of a split or TFRecord glob, once and in order",
    "tune": "search a tuning spec's gin bindings with Optuna, each trial its own run (resumable)",
}
# Signals a command answers as a preemption (exit 42), held from its first line until
# its handlers are installed, after TensorFlow's import (`preemption_early`).
EARLY_SIGNALS = {command: (signal.SIGTERM, signal.SIGINT)
                 for command in ("run", "launch", "tune", "eval")}
_HELP = (["--help"], ["-h"], ["help"])
_COMMAND_HELP = ("--help", "-h", "--helpshort", "-?")
_WIDTH = 80


def module_name(command: str) -> str:
    """`tputrain audit-precision` lives in `tputrain.cli.audit_precision`."""
    if command not in SUMMARIES:
        raise KeyError(f"no tputrain command {command!r}: use one of {', '.join(SUMMARIES)}")
    return f"tputrain.cli.{command.replace('-', '_')}"


def command_module(command: str) -> ModuleType:
    """The module of `tputrain <command>`, imported now and not at start-up (see above)."""
    return importlib.import_module(module_name(command))


def overview() -> str:
    """`tputrain --help`: the commands, one line each."""
    width = max(map(len, SUMMARIES))
    lines = ["usage: tputrain [COMMAND] [flags]", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in SUMMARIES.items()]
    lines += ["", "`tputrain COMMAND --help` shows a command's flags; with no command, "
              "`tputrain` trains (`tputrain run --help` lists the training flags)."]
    return "\n".join(lines)


def _flag_lines(flag: flags.Flag) -> list[str]:
    """One absl flag as absl's --help shows it, without its flag-type noise."""
    name = f"--[no]{flag.name}" if flag.boolean else f"--{flag.name}"
    text = (flag.help or "").removesuffix(";\n    repeat this option to specify a list of values")
    if flag.default not in (None, [], False, ""):
        text += f" (default: {flag.default_as_str})"
    if isinstance(flag, flags.MultiFlag):
        text += " (repeatable)"
    return textwrap.wrap(f"{name}: {text}", _WIDTH, initial_indent="  ",
                         subsequent_indent="      ")


def render_help(command: str) -> str:
    """`tputrain COMMAND --help` from the command's own flag definitions (this imports
    the command, and TensorFlow: `help_text.HELP` keeps the result)."""
    module = command_module(command)
    if hasattr(module, "build_parser"):  # argparse
        parser = module.build_parser()
        parser.formatter_class = functools.partial(argparse.HelpFormatter, width=_WIDTH)
        return parser.format_help()
    registry = flags.FlagValues()  # a fresh one: the commands share flag names
    module.define_flags(registry)
    usage = ("tputrain [run] --gin_file=CONFIG [flags]" if command == DEFAULT_COMMAND
             else f"tputrain {command} [flags]")
    summary = (inspect.getdoc(module) or "").split("\n\n")[0]
    lines = [f"USAGE: {usage}", "", summary, "", "flags:"]
    for name in registry:  # definition order
        if registry[name].name == name:  # not a short alias
            lines += _flag_lines(registry[name])
    lines += ["", "--helpfull also lists absl's own flags (logging, --flagfile)."]
    return "\n".join(lines) + "\n"


def help_module_source() -> str:
    """The text of tputrain/cli/help_text.py (`python tools/docgen.py write`)."""
    texts = {command: render_help(command) for command in SUMMARIES}
    return ('"""Every command\'s `--help`, rendered by `tputrain.cli.main.render_help` so that\n'
            'printing it imports no command. Generated by `python tools/docgen.py write`:\n'
            'do not edit."""\n\n'
            f"HELP = {pprint.pformat(texts, width=96, sort_dicts=False)}\n")


def _wants_help(args: list[str]) -> bool:
    """A help flag among the command's own arguments (before a `--`)."""
    own = args[:args.index("--")] if "--" in args else args
    return any(arg in _COMMAND_HELP for arg in own)


def _info_lines_without_prefix() -> None:
    """The CLI's INFO lines (progress) without absl's 55-character prefix;
    `--showprefixforinfo` brings it back."""
    from absl import logging  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    # (importing absl.logging defines the flag)
    flags.FLAGS.set_default("showprefixforinfo", False)


def console_main() -> None:
    """Entry point of the `tputrain` console script (and `python -m tputrain.run`)."""
    if sys.argv[1:] in _HELP:
        print(overview())
        sys.exit(0)
    command, usage_name = DEFAULT_COMMAND, "tputrain"
    if len(sys.argv) > 1 and sys.argv[1] in SUMMARIES:
        command = sys.argv.pop(1)
        usage_name = f"tputrain {command}"
    if _wants_help(sys.argv[1:]):
        from tputrain.cli.help_text import HELP  # pylint: disable=import-outside-toplevel
        print(HELP[command], end="")
        sys.exit(0)
    hold_early_signals(EARLY_SIGNALS.get(command, ()))
    sys.argv[0] = usage_name  # absl's usage line (and --help's flag list) names the command
    _info_lines_without_prefix()
    try:
        command_module(command).console_main()
    except SystemExit as stop:  # absl's app.run ends every command this way
        end_process(stop.code)
    end_process(0)
