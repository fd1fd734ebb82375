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
    import json, os, subprocess, sys, traceback
    snippets, scratch = json.load(open(sys.argv[1])), sys.argv[2]
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
    # Python blocks: in this process, one namespace per page.
    import gin, keras
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
    for page, shell in shells.items():
        output, _ = shell.communicate(timeout=600)
        if shell.returncode:
            failures.append(f"{page} (bash, exit {shell.returncode})\\n{output[-3000:]}")
    print("SNIPPET-FAILURES " + json.dumps(failures))
''')


def test_every_runnable_snippet_runs(tmp_path):
    snippets = all_snippets()
    assert {s["lang"] for s in snippets} == {"python", "bash"}, "expected both kinds of snippets"
    source = tmp_path / "snippets.json"
    source.write_text(json.dumps(snippets))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", _RUNNER, str(source), str(tmp_path)],
                            capture_output=True, text=True, timeout=900, env=env)
    report = re.search(r"^SNIPPET-FAILURES (.*)$", result.stdout, re.MULTILINE)
    assert report, f"runner crashed (exit {result.returncode}):\n{result.stderr[-3000:]}"
    failures = json.loads(report.group(1))
    assert not failures, "\n\n".join(failures)


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
    from test_docgen import load_docgen

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
