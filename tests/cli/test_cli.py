"""tputrain.cli: the dispatcher, each command's flag definitions, and the layering rule
that the library never imports the command line, and what `run` writes beside training
(end-to-end runs: test_run.py)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags

import tputrain
from tiny import TinyTask, strategy_for
from tputrain.cli import main
from tputrain.cli.run import will_train

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tputrain"

_HELP_PROBE = """
import sys
sys.argv = ["tputrain", *sys.argv[1:]]
from tputrain.cli import main
try:
    main.console_main()
except SystemExit as exit:
    code = exit.code
print("EXIT", code)
print("COMMAND-MODULES", sorted(m for m in sys.modules if m.startswith("tputrain.cli.")
                                and m != "tputrain.cli.main"))
print("TENSORFLOW", "tensorflow" in sys.modules)
"""


def _help_probe(*argv: str) -> str:
    """`tputrain *argv` (default `--help`) in a fresh process, and what it imported."""
    result = subprocess.run([sys.executable, "-c", _HELP_PROBE, *(argv or ["--help"])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_help_lists_every_command_and_exits_0_without_loading_any():
    out = _help_probe()
    assert "EXIT 0" in out
    for command in main.SUMMARIES:
        assert f"\n  {command} " in out, out
    assert "COMMAND-MODULES []" in out  # listing them imports none of them


def test_help_does_not_import_tensorflow():
    assert "TENSORFLOW False" in _help_probe()


def test_a_commands_help_exits_0_without_tensorflow_and_lists_its_flags():
    out = _help_probe("eval", "--help")
    assert "EXIT 0" in out and "TENSORFLOW False" in out, out
    assert "USAGE: tputrain eval [flags]" in out
    for flag in ("--gin_file", "--model_dir", "--[no]continuous", "--timeout_seconds"):
        assert f"\n  {flag}: " in out, out


def test_the_stored_help_is_each_commands_own_flag_definitions():
    """`tputrain COMMAND --help` prints `help_text.HELP` (no import of the command);
    `python tools/docgen.py write` regenerates it from the definitions."""
    from tputrain.cli import help_text

    assert set(help_text.HELP) == set(main.SUMMARIES)
    for command in main.SUMMARIES:
        assert help_text.HELP[command] == main.render_help(command), command


def test_every_command_has_a_module_that_defines_its_own_flags():
    for command in main.SUMMARIES:
        module = main.command_module(command)
        assert module.__name__ == f"tputrain.cli.{command.replace('-', '_')}"
        assert callable(module.console_main), command
        if command == "launch":  # argparse: every other flag goes to the workers
            parser = module.build_parser()
            assert {"--workers", "--peer_exit_timeout"} <= set(parser._option_string_actions)
            continue
        registry = flags.FlagValues()  # a fresh one: the commands share flag names
        module.define_flags(registry)
        if command != "write-tfrecords":
            assert {"gin_file", "gin_param", "gin_search_path", "gin_import"} <= set(registry)
    with pytest.raises(KeyError, match="no tputrain command 'trian'"):
        main.command_module("trian")


def _imports_of_cli(tree: ast.Module) -> list[int]:
    """Lines importing tputrain.cli outside an `if __name__ == "__main__":` block."""
    main_blocks = [node for node in tree.body if isinstance(node, ast.If)
                   and ast.unparse(node.test) in ("__name__ == '__main__'",
                                                  '__name__ == "__main__"')]
    allowed = {id(n) for block in main_blocks for n in ast.walk(block)}
    lines = []
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == "tputrain.cli" or name.startswith("tputrain.cli.") for name in names):
            lines.append(node.lineno)
    return lines


def test_no_library_module_imports_the_cli():
    """The CLI imports the library, never the reverse. Two kinds of entry point may
    start it: tputrain/run.py (`python -m tputrain.run`, a documented shim) and a
    module's `if __name__ == "__main__":` block (`python -m tputrain.jobs.diagnose`)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("tputrain/cli/") or relative == "tputrain/run.py":
            continue
        for line in _imports_of_cli(ast.parse(path.read_text(), filename=relative)):
            offenders.append(f"{relative}:{line}")
    assert not offenders, f"library modules importing tputrain.cli: {offenders}"


def test_the_scan_sees_an_import_of_the_cli():
    tree = ast.parse("import os\nfrom tputrain.cli.common import fail\n"
                     "from tputrain import cli\n"
                     "if __name__ == '__main__':\n    from tputrain.cli import main\n")
    assert _imports_of_cli(tree) == [2, 3]


def _parse_error(command: str, *argv: str, capsys) -> str:
    """What `tputrain COMMAND ARGV` says on a bad flag; it must exit 2 in one line."""
    from tputrain.cli.common import parse_flags

    registry = flags.FlagValues()  # a fresh one: the commands share flag names
    main.command_module(command).define_flags(registry)
    with pytest.raises(SystemExit) as caught:
        parse_flags([f"tputrain {command}", *argv], registry)
    error = capsys.readouterr().err
    assert caught.value.code == 2 and error.count("\n") == 1, error
    return error


def test_a_flag_that_is_not_a_number_exits_2(capsys):
    """Issue 33.6: `tputrain eval --step=abc` exited 1 (absl's code), not 2 (bad config)."""
    assert "--step" in _parse_error("eval", "--step=abc", capsys=capsys)


@pytest.mark.parametrize("flag", ["--seconds=-1", "--seconds=0", "--steps=0", "--steps=-5"])
def test_diagnose_refuses_a_measurement_that_is_not_positive(flag, capsys):
    """`tputrain diagnose --seconds=-1` or `--steps=0` measured with the defaults and
    exited 0 without a word (find-batch refuses its equivalents)."""
    error = _parse_error("diagnose", flag, capsys=capsys)
    assert flag in error and "must be" in error, error


def test_a_negative_timeout_is_refused(capsys):
    """Issue 33.6: --timeout_seconds=-5 was taken as "wait for ever" (that is 0)."""
    error = _parse_error("eval", "--timeout_seconds=-5", capsys=capsys)
    assert "--timeout_seconds" in error and "0 waits for ever" in error


@pytest.mark.parametrize("command", ["run", "export", "eval"])
def test_an_empty_model_dir_is_refused(command, capsys):
    """Issue 33.6: `--model_dir=$UNSET` trained in the config's own model_dir."""
    error = _parse_error(command, "--model_dir=", "--gin_file=digits.gin", capsys=capsys)
    assert "--model_dir" in error and "unset shell variable" in error


@pytest.mark.parametrize("command", ["eval", "run", "export"])
def test_extra_positional_arguments_are_one_line_and_exit_2(command, capsys):
    """Issue 50.6: `tputrain eval --model_dir=X extra` exited 1 with absl's usage dump."""
    with pytest.raises(SystemExit) as caught:
        main.command_module(command).main([f"tputrain {command}", "extra", "more"])
    error = capsys.readouterr().err
    assert caught.value.code == 2 and error.count("\n") == 1, error
    assert "extra more" in error and "--help" in error, error


def _tiny_trainer(model_dir: str, train_steps: int) -> tputrain.Trainer:
    return tputrain.Trainer(TinyTask(), model_dir, strategy=strategy_for(1), train_steps=train_steps,
                            steps_per_loop=2, checkpoint_every=2, global_batch_size=16,
                            report_mfu=False)


def test_a_rerun_that_trains_nothing_is_told_apart_before_it_restores(tmp_path):
    """The operative config is written only by a run that trains (`will_train`), so a
    rerun at or below the checkpoint's step keeps the config of the run that made it."""
    first = _tiny_trainer(str(tmp_path), 4)
    assert will_train(first)  # nothing saved yet
    first.train()
    assert not will_train(_tiny_trainer(str(tmp_path), 4))  # a rerun of the finished run
    assert not will_train(_tiny_trainer(str(tmp_path), 2))  # a train_steps below the step
    assert will_train(_tiny_trainer(str(tmp_path), 6))  # continues


@pytest.mark.parametrize("command, fix", [("eval", "--model_dir"), ("run", "--gin_file"),
                                          ("goodput", "--model_dir"),
                                          ("write-tfrecords", "--output_prefix")])
def test_a_command_without_its_config_is_one_line_naming_the_flag(command, fix, tmp_path):
    """`tputrain eval` (or export, or bare `tputrain`) with no flags printed the whole
    help (27-42 lines), exited 1 and told eval and export to pass --gin_file, when
    they read a run's --model_dir; goodput and write-tfrecords still did (UsageError)."""
    result = subprocess.run([sys.executable, "-m", "tputrain.cli", command], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines()  # (write-tfrecords: its own prefix)
              if line.startswith(("tputrain: error:", f"tputrain {command}: error:"))]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert fix in errors[0] and "Traceback" not in result.stderr
    assert "flags:" not in result.stderr.lower() and len(result.stderr.splitlines()) < 10
