"""One way to configure: gin lives in the configuration modules and the CLI only."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tputrain"
# The modules that may talk to gin: its registrations, parsing and summaries.
CONFIGURATION = {"configurables.py", "config.py", "config_summary.py"}
# Library modules already free of gin (the rest still decorate public builders).
GIN_FREE = {"options.py", "trainer.py", "checkpoint.py", "layer_precision.py", "flops.py",
            "communication.py", "cluster.py"}


def _library_modules():
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] != "cli" and str(relative) not in CONFIGURATION:
            yield relative, path.read_text()


def test_no_library_module_queries_gin():
    queries = [str(relative) for relative, text in _library_modules()
               if "gin.query_parameter" in text]
    assert queries == ["vertex.py"], queries  # vertex: its spec check, still to move


def test_options_and_trainer_modules_do_not_use_gin():
    using = [str(relative) for relative, text in _library_modules()
             if str(relative) in GIN_FREE and re.search(r"\bgin\.|^import gin", text, re.M)]
    assert using == []


def test_precision_is_decided_without_gin():
    text = (ROOT / "precision.py").read_text()
    assert "query_parameter" not in text
