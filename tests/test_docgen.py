"""tools/docgen.py: docstring parsing, the error catalogue and the generated pages."""

import textwrap

import gin

from docgen_loader import load_docgen

docgen = load_docgen()


def test_split_docstring_separates_args_and_joins_continuations():
    text, params = docgen.split_docstring('''Builds a thing.

    Why it exists.

    Args:
      width: how wide; continues
        on a second line.
      depth (int): how deep.
      **kwargs: passed on.

    Returns:
      the thing.
    ''')
    assert params == {"width": "how wide; continues on a second line.",
                      "depth": "how deep.", "**kwargs": "passed on."}
    assert "Why it exists." in text and "Returns:" in text and "width" not in text


def test_collect_errors_renders_fstrings_constants_and_helper_calls(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(textwrap.dedent('''
        _FIX = "use a multiple of 8"

        def _fail(path, problem):
            raise ValueError(f"{path} is broken: {problem}; rewrite it")

        def _explain(code):
            if code:
                return f"code {code}: retry"
            return "unknown: retry"

        def check(n, path):
            if n % 8:
                raise ValueError(f"batch {n} does not divide: {_FIX}")
            if not path:
                _fail(path, "it is empty")
            raise OSError(_explain(n))

        def passthrough(error):
            raise RuntimeError(str(error))
        '''))
    errors = docgen.collect_errors(package)
    messages = [(e["where"], e["type"], e["message"]) for e in errors]
    assert ("check", "ValueError", "batch {n} does not divide: use a multiple of 8") in messages
    assert ("check", "ValueError", "{path} is broken: it is empty; rewrite it") in messages
    assert ("check", "OSError", "code {code}: retry") in messages
    assert ("check", "OSError", "unknown: retry") in messages
    assert not any(e["where"] in ("passthrough", "_fail") for e in errors)


def test_gin_reference_lists_every_tputrain_configurable_with_defaults():
    page = docgen.gin_reference()
    for selector, configurable in gin.config._REGISTRY.items():  # pylint: disable=protected-access
        if configurable.module and configurable.module.startswith("tputrain."):
            assert f"## `{configurable.name}`" in page, selector
    assert "| `train_steps` | `1000` | total optimizer steps" in page
    assert "*not bindable in gin (set by tputrain)*" in page  # Checkpointer's denylist


def test_error_reference_lists_the_trainer_batch_error():
    page = docgen.error_reference()
    assert "is not divisible by {replicas} replicas: use a multiple of {replicas}" in page
