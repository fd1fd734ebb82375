"""Static checks: the Trainer's internals stay inside trainer.py (issue 35)."""

import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tputrain"
PRIVATE_READ = re.compile(r"\btrainer\._\w|\._max_over_hosts\b|\._train_iterator\b")
CYCLE = ("controller.py", "actions.py", "goodput.py")


def modules():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).as_posix()
            != "trainer.py"]


def test_no_module_outside_trainer_reads_a_private_trainer_attribute():
    reads = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
             for path in modules()
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if PRIVATE_READ.search(line)]
    assert reads == []


def test_controller_actions_and_goodput_do_not_import_the_trainer():
    for name in CYCLE:
        source = (PACKAGE / name).read_text()
        assert "TYPE_CHECKING" not in source, name
        assert "tputrain.trainer" not in source, name
