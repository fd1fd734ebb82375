"""Gin parsing: every misconfiguration fails before anything is built, with the fix."""

import gin
import pytest

import tputrain  # noqa: F401
from tputrain.config.parsing import ConfigError, parse_gin, require_bound


def test_builtin_configs_parse():
    parse_gin(["digits.gin"])
    assert gin.query_parameter("Trainer.global_batch_size") == 64


def test_misspelled_configurable_names_the_nearest():
    with pytest.raises(ConfigError, match=r"No configurable matching 'Traner'.*did you mean 'Trainer'"):
        parse_gin(gin_params=["Traner.train_steps = 3"])


def test_misspelled_parameter_names_the_nearest():
    with pytest.raises(ConfigError, match=r"parameter named 'train_step'.*did you mean 'train_steps'"):
        parse_gin(gin_params=["Trainer.train_step = 3"])


@pytest.mark.parametrize("bindings, match", [
    (['build_optimizer.nmae = "sgd"'], r"build_optimizer.*'nmae'.*did you mean 'name'"),
    (['build_optimizer.name = "sgd"', "build_optimizer.nesterv = True"],
     r"'sgd'.*'nesterv'.*did you mean 'nesterov'"),
    (['build_optimizer.name = "adamx"'], r"unknown optimizer 'adamx'.*adamw"),
])
def test_a_misspelled_optimizer_argument_fails_at_parse_naming_the_nearest(bindings, match):
    # build_optimizer passes extra keywords to the Keras optimizer: gin alone accepts any
    # name there, and the run failed only once data was built, with Keras's message.
    with pytest.raises(ConfigError, match=match):
        parse_gin(gin_params=bindings)


def test_unknown_reference_suggests_registering():
    with pytest.raises(ConfigError, match=r"'@?MyTask.*--gin_import"):
        parse_gin(gin_params=["Trainer.task = @MyTask()"])


def test_missing_file_says_how_to_find_it():
    with pytest.raises(ConfigError, match="--gin_search_path"):
        parse_gin(["no_such_config.gin"])


def test_syntax_error_is_a_config_error():
    with pytest.raises(ConfigError, match="gin could not parse"):
        parse_gin(gin_params=["Trainer.train_steps = [1"])


def test_missing_required_binding():
    parse_gin(gin_params=["Trainer.train_steps = 3"])
    with pytest.raises(ConfigError, match=r"Trainer.task is not bound: add `Trainer.task = ...`"):
        require_bound("Trainer.task")


def test_user_module_import(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(
        "import gin\n@gin.configurable\ndef my_width(units=3):\n    return units\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    parse_gin(gin_params=["my_width.units = 7"], imports=["my_tasks"])
    assert gin.query_parameter("my_width.units") == 7


def test_bad_import_is_a_config_error():
    with pytest.raises(ConfigError, match="--gin_import=not_a_module_xyz"):
        parse_gin(gin_params=["Trainer.train_steps = 3"], imports=["not_a_module_xyz"])


def test_a_builtin_config_parses_without_error_lines(caplog):
    """gin's package reader logged `E ... Path not found: digits.gin` on every successful run."""
    import logging as std_logging

    with caplog.at_level(std_logging.INFO):
        parse_gin(["digits.gin"], finalize=False)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= std_logging.ERROR]


def test_a_users_config_including_a_builtin_one_parses_without_error_lines(tmp_path, caplog):
    """`include 'digits.gin'` in a user's file: gin looks for it in a Python package
    first, logging `E ... Path not found: digits.gin`, before it finds the file."""
    import logging as std_logging

    mine = tmp_path / "mine.gin"
    mine.write_text("include 'digits.gin'\nTrainer.train_steps = 7\n")
    with caplog.at_level(std_logging.INFO):
        parse_gin([str(mine)], finalize=False)
    assert gin.query_parameter("Trainer.train_steps") == 7
    assert not [r.getMessage() for r in caplog.records if r.levelno >= std_logging.ERROR]
    assert std_logging.getLogger().filters == []  # nothing left behind


def test_an_included_file_that_is_nowhere_is_still_a_config_error(tmp_path, caplog):
    """One error naming the file and the fix; gin's own info lines of each path it
    tried (`system_path_file_exists:...`) are not printed beside it."""
    import logging as std_logging

    mine = tmp_path / "mine.gin"
    mine.write_text("include 'no_such_file.gin'\n")
    with caplog.at_level(std_logging.INFO), pytest.raises(
            ConfigError, match="no_such_file.gin.*--gin_search_path"):
        parse_gin([str(mine)], finalize=False)
    assert [r.getMessage() for r in caplog.records if "no_such_file" in r.getMessage()] == []


def test_an_include_beside_the_including_file_names_the_search_path_to_add(tmp_path):
    """gin resolves `include 'base.gin'` in its search paths, not the including file's
    folder: the error says where the file is and the flag that adds it."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.gin").write_text("Trainer.train_steps = 3\n")
    mine = tmp_path / "sub" / "mine.gin"
    mine.write_text("include 'base.gin'\n")
    with pytest.raises(ConfigError, match=f"--gin_search_path={tmp_path / 'sub'}$"):
        parse_gin([str(mine)], finalize=False)


GIN_UNCHANGED = r'''
import gin, gin.config

def functions():
    return {(module.__name__, name): value for module in (gin, gin.config)
            for name, value in vars(module).items() if callable(value)}

before = functions()
import tputrain
try:  # gin's own parse before the registrations: gin's own error
    gin.parse_config("Trainer.train_steps = 3")
except ValueError as error:
    assert "No configurable matching 'Trainer'" in str(error), error
else:
    raise AssertionError("import tputrain registered configurables with gin")
import tputrain.config.registry  # the documented route (docs/configuration.md)
gin.parse_config("Trainer.train_steps = 3")
gin.clear_config()
tputrain.load_api()
from tputrain.config.parsing import parse_gin
parse_gin(gin_params=["Trainer.train_steps = 3"])
changed = sorted(name for key, value in functions().items()
                 if before.get(key, value) is not value for name in [".".join(key)])
assert changed == [], changed
assert gin.parse_config is gin.config.parse_config is before[("gin.config", "parse_config")]
assert gin.bind_parameter is before[("gin", "bind_parameter")]
print("gin unchanged")
'''


def test_importing_and_using_tputrain_changes_nothing_in_gin():
    """Issue 53: gin's functions stay as gin defines them (compared with the objects a
    fresh process holds before `import tputrain`)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", GIN_UNCHANGED], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "gin unchanged" in result.stdout


def test_the_options_classes_keep_their_own_init():
    """The deprecated gin names are read without replacing `__init__` of an options
    class: only gin's own registration wraps the dataclass's constructor."""
    import tputrain.config.registry

    for cls in tputrain.config.registry.LEGACY:
        files, init = [], cls.__init__
        while init is not None:
            files.append(init.__code__.co_filename)
            init = getattr(init, "__wrapped__", None)
        assert not [f for f in files if f.endswith("configurables.py")], (cls, files)


def test_an_unquoted_word_as_a_value_says_how_to_write_one():
    """`--gin_param=Trainer.train_steps=abc` said "malformed node or string on line 1:
    <ast.Name object at 0x...>"."""
    with pytest.raises(ConfigError) as caught:
        parse_gin(gin_params=["Trainer.train_steps = abc"])
    text = str(caught.value)
    assert "ast.Name" not in text and "'abc'" in text and "quotes" in text and "@abc" in text


@pytest.mark.parametrize("content, words", [
    # An unclosed `(` said only "('EOF in multi-line statement', (3, 0))".
    (b"Trainer.train_steps = 3\nTrainer.steps_per_loop = (\n", ["unclosed"]),
    # Issue 10.4: an `import` line of a missing module gave a traceback.
    (b"import no_such_module_here.tasks\nTrainer.train_steps = 5\n",
     ["No module named 'no_such_module_here'", "PYTHONPATH"]),
    # Issue 33.6: the decode error did not say which file.
    ("# caf\xe9\nTrainer.train_steps = 5\n".encode("latin-1"), ["save it as UTF-8"]),
], ids=["unclosed bracket", "missing module", "not UTF-8"])
def test_a_broken_gin_file_is_one_line_naming_it_and_the_fix(tmp_path, content, words):
    config = tmp_path / "broken.gin"
    config.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        parse_gin([str(config)])
    text = str(caught.value)
    assert "\n" not in text.strip(), text
    assert str(config) in text and all(word in text for word in words), text


def test_an_error_raised_by_a_configurable_names_it():
    """A binding of the wrong type fails inside the configurable's constructor; gin's
    note naming it was cut from the one-line message ("'<=' not supported between
    instances of 'int' and 'str'" alone)."""
    from tputrain.cli.common import error_message

    @gin.configurable
    def width_for_test(units=3):
        return units <= 0

    with gin.config_scope(None):
        gin.bind_parameter("width_for_test.units", "0.1")
        try:
            width_for_test()
        except TypeError as error:
            text = error_message(error)
    assert "'<=' not supported" in text and "width_for_test" in text and "In call" not in text


def test_an_error_in_a_task_method_a_configurable_called_names_the_task():
    """`DigitsTask.dropout = 'abc'` failed in build_model, which the Trainer calls: the
    message named only the Trainer ("'<=' not supported ... (raised in Trainer: check
    its bindings)"), not the Task whose binding is wrong."""
    import tputrain
    from tputrain.cli.common import error_message

    class WideTaskForTest(tputrain.Task):
        def __init__(self, width="3"):
            self.width = width

        def build_model(self):
            return self.width <= 0

    @gin.configurable
    def runner_for_test(task=None):
        return task.build_model()

    with gin.config_scope(None):
        try:
            runner_for_test(task=WideTaskForTest())
        except TypeError as error:
            text = error_message(error)
    assert "'<=' not supported" in text and "In call" not in text, text
    assert "WideTaskForTest.build_model" in text and "runner_for_test" in text, text


def test_a_disk_error_in_a_configurable_is_not_blamed_on_its_bindings():
    """A full disk met while the Trainer saved ended "(raised in Trainer: check its
    bindings)": no binding is wrong; the error's own line says what to do."""
    from tputrain.cli.common import error_message

    @gin.configurable
    def saver_for_test(path="x"):
        raise OSError(28, "model_dir is full", path)

    with gin.config_scope(None):
        try:
            saver_for_test()
        except OSError as error:
            text = error_message(error)
    assert "model_dir is full" in text and "bindings" not in text and "In call" not in text
