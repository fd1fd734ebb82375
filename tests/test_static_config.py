"""One way to configure: gin lives in the configuration modules and the CLI only."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tputrain"
# The modules that may talk to gin: its registrations, parsing and summaries.
CONFIGURATION = {"config/registry.py", "config/parsing.py", "actions/config_summary.py"}


def _library_modules():
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] != "cli" and str(relative) not in CONFIGURATION:
            yield relative, path.read_text()


def test_no_library_module_queries_gin():
    queries = [str(relative) for relative, text in _library_modules()
               if "gin.query_parameter" in text]
    assert queries == [], queries


def test_no_library_module_uses_gin():
    """Registration, parsing and queries live in the configuration modules and the
    CLI; the library takes arguments and options classes (T5X's gin at the edges)."""
    using = [str(relative) for relative, text in _library_modules()
             if re.search(r"\bgin\.|^import gin", text, re.M)]
    assert using == []


def test_the_check_sees_gin():
    lines = ["@gin.configurable", "import gin", "x = gin.query_parameter('a.b')"]
    assert all(re.search(r"\bgin\.|^import gin", line, re.M) for line in lines)


def test_precision_is_decided_without_gin():
    text = (ROOT / "precision" / "policy.py").read_text()
    assert "query_parameter" not in text
