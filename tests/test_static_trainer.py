"""Static checks: the Trainer's internals stay inside trainer.py (issue 35)."""

import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tputrain"
PRIVATE_READ = re.compile(r"\btrainer\._\w|\._max_over_hosts\b|\._train_iterator\b")
CYCLE = ("runtime/controller.py", "actions", "observe/goodput.py")  # actions: the package, every module


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
    paths = [path for name in CYCLE for path in (
        sorted((PACKAGE / name).glob("*.py")) if (PACKAGE / name).is_dir() else [PACKAGE / name])]
    assert len(paths) > len(CYCLE)  # the actions package's modules are read
    for path in paths:
        source = path.read_text()
        assert "TYPE_CHECKING" not in source, path.name
        assert "tputrain.trainer" not in source, path.name
