"""The docs site builds, its generated pages are current, and its runnable snippets run.

Marker convention: a line `<!-- runnable -->` directly above a fenced ```python or
```bash block marks it as executed here (the comment is invisible on the site).
Python blocks of one page run in order in one shared namespace (like a
notebook); bash blocks of one page run in order in one shell script. Every page
gets its own scratch directory as the working directory. All of it runs in one
subprocess, so TensorFlow is imported once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKER = "<!-- runnable -->"
_FENCE = re.compile(r"^(`{3,})(\w+)?[^\n]*$")


def extract_snippets(text: str, page: str = "page.md") -> list[dict]:
    """The fenced blocks preceded by the runnable marker: [{page, line, lang, code}]."""
    lines = text.splitlines()
    snippets = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == MARKER:
            if i + 1 >= len(lines) or not _FENCE.match(lines[i + 1].strip()):
                raise ValueError(f"{page}:{i + 1}: {MARKER} must be directly above a ``` fence")
            fence = _FENCE.match(lines[i + 1].strip())
            ticks, lang = fence.group(1), (fence.group(2) or "").lower()
            if lang not in ("python", "bash"):
                raise ValueError(f"{page}:{i + 2}: runnable blocks are python or bash, got {lang!r}")
            indent = len(lines[i + 1]) - len(lines[i + 1].lstrip())
            body, j = [], i + 2
            while j < len(lines) and lines[j].strip() != ticks:
                body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
                j += 1
            if j >= len(lines):
                raise ValueError(f"{page}:{i + 2}: unclosed code block")
            snippets.append({"page": page, "line": i + 3, "lang": lang, "code": "\n".join(body)})
            i = j
        i += 1
    return snippets


def all_snippets() -> list[dict]:
    snippets = []
    for path in sorted(DOCS.rglob("*.md")):
        snippets += extract_snippets(path.read_text(), str(path.relative_to(ROOT)))
    return snippets


_RUNNER = textwrap.dedent('''
    import json, os, re, subprocess, sys, traceback
    snippets, scratch, TENSORFLOW_LINE = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")

    def page_dir(page):
        path = os.path.join(scratch, page.replace("/", "_").removesuffix(".md"))
        os.makedirs(path, exist_ok=True)
        return path

    failures = []
    # Bash blocks: one script per page, all pages started at once.
    scripts = {}
    for s in snippets:
        if s["lang"] == "bash":
            scripts.setdefault(s["page"], []).append(f"# {s['page']}:{s['line']}\\n{s['code']}")
    shells = {page: subprocess.Popen(["bash", "-euo", "pipefail", "-c", "\\n".join(parts)],
                                     cwd=page_dir(page), env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
              for page, parts in scripts.items()}
    # Python blocks: in this process, one namespace per page (tputrain first, as the
    # snippets import it: TensorFlow's start-up lines are then filtered).
    import tputrain, gin, keras
    namespaces = {}
    for s in snippets:
        if s["lang"] != "python":
            continue
        if s["page"] not in namespaces:
            gin.clear_config()
            keras.mixed_precision.set_global_policy("float32")
            namespaces[s["page"]] = {"__name__": "__main__"}
        os.chdir(page_dir(s["page"]))
        try:
            exec(compile(s["code"], f"{s['page']}:{s['line']}", "exec"), namespaces[s["page"]])
        except BaseException:
            failures.append(f"{s['page']}:{s['line']} (python)\\n{traceback.format_exc()}")
    tensorflow_lines = []
    for page, shell in shells.items():
        output, _ = shell.communicate(timeout=600)
        if shell.returncode:
            failures.append(f"{page} (bash, exit {shell.returncode})\\n{output[-3000:]}")
        tensorflow_lines += [f"{page}: {line}" for line in output.splitlines()
                             if re.search(TENSORFLOW_LINE, line)]
    print("SNIPPET-FAILURES " + json.dumps(failures))
    print("BASH-TENSORFLOW-LINES " + json.dumps(tensorflow_lines))
''')


@pytest.mark.slow
@pytest.mark.start_early(8)
def test_every_runnable_snippet_runs(tmp_path):
    snippets = all_snippets()
    assert {s["lang"] for s in snippets} == {"python", "bash"}, "expected both kinds of snippets"
    source = tmp_path / "snippets.json"
    source.write_text(json.dumps(snippets))
    env = dict(os.environ)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # what a user sees
    result = subprocess.run([sys.executable, "-c", _RUNNER, str(source), str(tmp_path),
                             TENSORFLOW_LINE], capture_output=True, text=True, timeout=900,
                            env=env)
    report = re.search(r"^SNIPPET-FAILURES (.*)$", result.stdout, re.MULTILINE)
    assert report, f"runner crashed (exit {result.returncode}):\n{result.stderr[-3000:]}"
    failures = json.loads(report.group(1))
    assert not failures, "\n\n".join(failures)
    # No snippet prints a TensorFlow C++ line or an E-level line (issue 52).
    bash_lines = json.loads(re.search(r"^BASH-TENSORFLOW-LINES (.*)$", result.stdout,
                                      re.MULTILINE).group(1))
    python_lines = [line for line in result.stderr.splitlines()
                    if re.search(TENSORFLOW_LINE, line)]
    assert bash_lines + python_lines == []


# TensorFlow's C++ lines ("W0000 ... assert_op.cc:39] ...") and E-level lines.
TENSORFLOW_LINE = r"^[IWEF]\d{4} .*\.cc:\d+\] |^E\d{4} |^ERROR"



def test_extract_snippets_follows_the_marker_convention():
    text = textwrap.dedent("""\
        ```python
        not = marked
        ```
        <!-- runnable -->
        ```python
        x = 1
        ```
        !!! note
            <!-- runnable -->
            ```bash
            echo hi
            ```
        """)
    snippets = extract_snippets(text)
    assert [(s["lang"], s["code"]) for s in snippets] == [("python", "x = 1"), ("bash", "echo hi")]
    with pytest.raises(ValueError, match="directly above"):
        extract_snippets("<!-- runnable -->\n\n```python\nx = 1\n```\n")


def test_mkdocs_build_is_strict_clean(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                             "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, (
        f"mkdocs build --strict failed (pip install -e '.[docs]' if mkdocs is missing):\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    assert (tmp_path / "site" / "reference" / "gin" / "index.html").exists()


def test_generated_reference_pages_are_up_to_date():
    """The CI drift check: a new configurable, flag or error needs `docgen write`."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "docgen.py"), "check"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    missing = sorted(p for p in pages if f" {p}" not in nav and f"  /{p}" not in nav)
    assert not missing, f"add these pages to the nav in mkdocs.yml: {missing}"


def test_troubleshooting_quotes_real_error_messages():
    """Each `**Error:** `...`` quoted in troubleshooting.md is part of a message tputrain raises.

    Quotes write run-time values as `{...}`, as the error reference does.
    """
    from docgen_loader import load_docgen

    collect_errors = load_docgen().collect_errors
    text = (DOCS / "troubleshooting.md").read_text()
    quoted = re.findall(r"\*\*Error:\*\* `([^`]+)`", text)
    assert len(quoted) >= 10
    messages = [error["message"] for error in collect_errors()]
    unknown = []
    for quote in quoted:
        pieces = re.split(r"\{[^{}]*\}", quote)
        pattern = re.compile(r"\{[^{}]*\}".join(re.escape(piece) for piece in pieces))
        if not any(pattern.search(message) for message in messages):
            unknown.append(quote)
    assert not unknown, f"not raised anywhere in tputrain (update the page): {unknown}"


# Commands, flags and private names the guides show exist (issue 34: `tputrain train`,
# `Trainer._make_loop`). The guides are README.md and docs/*.md; the generated
# references come from the code itself.

GUIDES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
_INLINE = re.compile(r"`([^`\n]+)`")
_SEGMENT_END = {"&&", "||", ";", "|", ")"}
_MODULES = {"tputrain.run": "run", "tputrain.cli": None, "tputrain": None,
            "tputrain.jobs.diagnose": "diagnose"}


def _code_lines(text: str) -> list[str]:
    """The lines of fenced blocks but Python ones (continuations joined) and the
    inline code spans."""
    lines, fenced, fence, python = [], [], None, False
    for line in text.splitlines():
        match = _FENCE.match(line.strip())
        if fence is None and match:
            fence, python = match.group(1), (match.group(2) or "").lower() == "python"
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is not None:
            if not python:
                fenced.append(line)
        else:
            lines += _INLINE.findall(line)
    return lines + re.sub(r"\\\n\s*", " ", "\n".join(fenced)).splitlines()


def _tokens(line: str) -> list[str]:
    import shlex

    try:
        return shlex.split(line, comments=True, posix=True)
    except ValueError:  # an unbalanced quote in prose
        return line.split()


def _placeholder(token: str) -> bool:
    return token.startswith(("<", "[", "$", "...")) or token.strip("-_").isupper()


def shown_commands(text: str) -> list[tuple[str, list[str]]]:
    """Every `tputrain [COMMAND] args` (or `python -m tputrain.run ...`) in `text`'s
    code: (command, the arguments up to the end of its shell segment)."""
    found = []
    for line in _code_lines(text):
        tokens = _tokens(line)
        for i, token in enumerate(tokens):
            if token == "tputrain" or token.endswith("/tputrain"):
                if any(t == "pip" or t.endswith("/pip") for t in tokens[:i]) or (
                        i and tokens[i - 1] in ("from", "import")):
                    continue  # `pip install tputrain`, `from tputrain import ...`
                command, rest = None, tokens[i + 1:]
            elif token in _MODULES and i and tokens[i - 1] == "-m":
                command, rest = _MODULES[token], tokens[i + 1:]
            else:
                continue
            end = next((j for j, t in enumerate(rest) if t in _SEGMENT_END), len(rest))
            rest = rest[:end]
            if command is None and rest and not rest[0].startswith("-"):
                command, rest = rest[0], rest[1:]
            found.append((command or "run", rest))
    return found


def _known_flags(command: str) -> set[str]:
    """The flags `tputrain <command>` accepts, read from its definitions (as the CLI
    reference is); absl commands also take absl's own (--help, --flagfile, logging)."""
    import absl.logging  # noqa: F401 (defines the logging flags)
    from absl import flags

    from docgen_loader import load_docgen

    info = load_docgen().command_flags(command)
    names = {row["name"] for row in info["flags"]} | {"help", "h"}
    if info["parser"] == "absl":
        names |= {f"no{row['name']}" for row in info["flags"] if row["type"] == "bool"}
        names |= {"helpfull", "helpshort", "helpxml", "flagfile", "undefok"}
        for flag in flags.FLAGS.get_flags_for_module("absl.logging"):
            names |= {flag.name, flag.short_name} - {None}
    return names


def _unknown_flags(command: str, args: list[str], known: dict[str, set[str]]) -> list[str]:
    """The `--flags` in `args` that `command` does not define (launch: its own, then
    those of the command it runs)."""
    if command not in known:
        known[command] = _known_flags(command)
    unknown, i = [], 0
    while i < len(args):
        arg = args[i]
        if command == "launch" and not arg.startswith("-") and not _placeholder(arg):
            if arg in known_commands():  # the command the workers run
                return unknown + _unknown_flags(arg, args[i + 1:], known)
        if arg.startswith("--") and not _placeholder(arg.split("=")[0]):
            name = arg[2:].split("=")[0]
            if name not in known[command]:
                if command != "launch":
                    unknown.append(f"--{name}")
                elif name not in known.setdefault("run", _known_flags("run")):
                    unknown.append(f"--{name}")
            elif command == "launch" and "=" not in arg:
                i += 1  # `--workers 2`: its value
        i += 1
    return unknown


def known_commands() -> set[str]:
    from tputrain.cli.main import SUMMARIES

    return set(SUMMARIES) | {"help"}


def test_shown_commands_are_found_in_code():
    text = textwrap.dedent("""\
        Run `tputrain diagnose --gin_file=F` or `pip install tputrain`; `tputrain.fault_tolerance.lock`.
        ```bash
        python3 -m venv .venv && .venv/bin/tputrain --gin_file=digits.gin \\
            --model_dir=/tmp/x | tee log
        tputrain launch --workers 2 eval --continuous
        python -m tputrain.run --gin_file=my.gin
        ```
        ```text
        tputrain: step 100/1200 | loss 0.8
        ```
        """)
    assert shown_commands(text) == [
        ("diagnose", ["--gin_file=F"]),
        ("run", ["--gin_file=digits.gin", "--model_dir=/tmp/x"]),
        ("launch", ["--workers", "2", "eval", "--continuous"]),
        ("run", ["--gin_file=my.gin"])]


def test_unknown_flags_are_those_the_command_does_not_define():
    known = {}
    assert _unknown_flags("diagnose", ["--gin_file=F", "--secnds=1", "--json"], known) == [
        "--secnds"]
    assert _unknown_flags("run", ["--nodeterministic", "--helpfull", "--v=1"], known) == []
    assert _unknown_flags("launch", ["--workers", "2", "diagnose", "--json", "--bogus"],
                          known) == ["--bogus"]
    assert _unknown_flags("launch", ["--workers=2", "--gin_file=F", "--steps=3"], known) == [
        "--steps"]  # no command: the workers run `tputrain run`


def test_every_command_and_flag_the_guides_show_exists():
    """Each `tputrain COMMAND --flag` in README.md and docs/*.md code is a command of
    `tputrain --help` that defines that flag."""
    commands, known, wrong = known_commands(), {}, []
    for path in GUIDES:
        for command, args in shown_commands(path.read_text()):
            where = f"{path.relative_to(ROOT)}: tputrain {command} {' '.join(args)}"
            if _placeholder(command):
                continue
            if command not in commands:
                wrong.append(f"{where}: no such command")
            elif command != "help":
                unknown = _unknown_flags(command, args, known)
                if unknown:
                    wrong.append(f"{where}: {command} has no {', '.join(unknown)}")
    assert not wrong, "\n".join(wrong)


def test_no_guide_names_a_trainer_private_that_does_not_exist():
    import tputrain

    source = (ROOT / "tputrain" / "trainer.py").read_text()
    texts = [p.read_text() for p in GUIDES]
    texts += [p.read_text() for p in sorted((ROOT / "tputrain").rglob("*.py"))]
    named = set(re.findall(r"\bTrainer\.(_[A-Za-z]\w*)", "\n".join(texts)))
    missing = sorted(name for name in named if not hasattr(tputrain.Trainer, name)
                     and f"self.{name} " not in source and f"self.{name}," not in source)
    assert not missing, f"named in the docs but not in the Trainer: {missing}"


def test_readme_names_only_configurables_of_the_reference():
    readme = (ROOT / "README.md").read_text()
    (line,) = [block.split("\n\n")[0] for block in readme.split("\n- ")
               if block.startswith("Configurables:")]
    reference = (DOCS / "reference" / "gin.md").read_text()
    names = re.findall(r"`([A-Za-z_]\w*)`", line)
    assert names and all(f"## `{name}`" in reference for name in names), names
    assert "set_precision_policy" not in names  # deprecated: Trainer.precision


# Import order (issue 52): a snippet or example that imports TensorFlow or Keras
# before tputrain prints TensorFlow's start-up lines (an E-level cuInit line among
# them); tputrain first filters them.

LOADS_TENSORFLOW = {"tensorflow", "keras", "tensorflow_datasets", "keras_hub", "tf_keras",
                    "tensorflow_text"}
_PYTHON_FENCE = re.compile(r"^(\s*)(`{3,})python\s*$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line, code) of every fenced Python block, runnable or not."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        match = _PYTHON_FENCE.match(lines[i])
        if match:
            indent, ticks, body, j = len(match.group(1)), match.group(2), [], i + 1
            while j < len(lines) and lines[j].strip() != ticks:
                body.append(lines[j][indent:])
                j += 1
            blocks.append((i + 2, "\n".join(body)))
            i = j
        i += 1
    return blocks


def imported_in_order(code: str) -> list[str]:
    """Top-level package names `code` imports, in source order ([] if not Python)."""
    import ast

    try:
        tree = ast.parse(code)
    except SyntaxError:  # an excerpt with `...` in place of code
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module.split(".")[0]))
    return [name for _, name in sorted(found)]


def tensorflow_before_tputrain(names: list[str], tputrain_imported: bool) -> str | None:
    """The first TensorFlow-loading import that comes before tputrain's, if any."""
    for name in names:
        if name == "tputrain":
            return None
        if name in LOADS_TENSORFLOW and not tputrain_imported:
            return name
    return None


def test_import_order_check_follows_the_rule():
    assert tensorflow_before_tputrain(["os", "keras", "tputrain"], False) == "keras"
    assert tensorflow_before_tputrain(["tputrain", "keras"], False) is None
    assert tensorflow_before_tputrain(["keras"], True) is None  # an earlier block imported it
    assert imported_in_order("import keras, tputrain\nfrom tensorflow import io") == [
        "keras", "tputrain", "tensorflow"]


def test_every_snippet_and_example_imports_tputrain_before_tensorflow():
    """Python blocks of a page run in order (like a notebook): a block after one that
    imported tputrain may import TensorFlow. An example that never imports tputrain
    (the plain Keras script a migration starts from) is not a tputrain program."""
    wrong = []
    for path in GUIDES:
        imported = False
        for line, code in python_blocks(path.read_text()):
            names = imported_in_order(code)
            first = tensorflow_before_tputrain(names, imported)
            if first:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: imports {first} before tputrain")
            imported = imported or "tputrain" in names
    for path in sorted((ROOT / "examples").glob("*.py")):
        names = imported_in_order(path.read_text())
        first = tensorflow_before_tputrain(names, False) if "tputrain" in names else None
        if first:
            wrong.append(f"{path.relative_to(ROOT)}: imports {first} before tputrain")
    assert not wrong, "import tputrain first (its import filters TensorFlow's start-up " \
                      "lines):\n" + "\n".join(wrong)


# getting-started.md's "What it prints" against a real run (issue 52: its start-up
# lines had drifted from what `tputrain --gin_file=digits.gin` prints).


def startup_block(text: str) -> list[str]:
    """The first ```text block after "## What it prints": the start-up lines."""
    section = text[text.index("## What it prints"):]
    block = section[section.index("```text\n") + len("```text\n"):]
    return block[:block.index("```")].strip().splitlines()


def line_shape(line: str) -> str:
    """A line with its numbers and paths abstracted: what any run of it shares (the
    compile cache's count of programs depends on the runs before)."""
    if line.startswith("tputrain: XLA compilation cache"):
        line = re.sub(r" \(.*\)$", "", line)
    line = re.sub(r"(?<![\w.])/\S+", "PATH", line)
    return re.sub(r"\d+(\.\d+)?", "N", line)


def test_line_shape_keeps_words_and_drops_numbers_and_paths():
    assert line_shape("tputrain: training from step 0 to 1200") == (
        "tputrain: training from step N to N")
    assert line_shape("TFRecordInput: cached 320 parsed examples (0.1 MB) in memory") == (
        "TFRecordInput: cached N parsed examples (N MB) in memory")
    assert line_shape("tputrain: XLA compilation cache /root/.cache/x/tf-2.21.0") == (
        "tputrain: XLA compilation cache PATH")


@pytest.mark.slow
def test_getting_started_shows_the_start_up_lines_a_digits_run_prints(tmp_path):
    env = dict(os.environ, TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    result = subprocess.run(
        [sys.executable, "-m", "tputrain.run", "--gin_file=digits.gin",
         f"--model_dir={tmp_path / 'run'}", "--gin_param=Trainer.train_steps=100"],
        capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("tputrain: training from"))
    printed = [line_shape(line) for line in lines[:end + 1] if not line.startswith("WARNING")]
    shown = [line_shape(line) for line in startup_block((DOCS / "getting-started.md").read_text())]
    assert shown == printed, "update docs/getting-started.md's start-up lines:\n" + "\n".join(
        lines[:end + 1])
