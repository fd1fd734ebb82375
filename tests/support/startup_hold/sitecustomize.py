"""Holds a child process at a point of its start-up, so a test can signal it there.

Put this folder first on a child's PYTHONPATH (Python imports `sitecustomize` at
start-up) and set TPUTRAIN_TEST_HOLD:

* `startup`: a process with a TF_CONFIG (a `tputrain launch` worker; not the
  launcher) prints "tputrain-test: held at start-up" and waits to be killed, before
  any of tputrain runs: a worker whose handlers are not installed yet.
* `tensorflow`: the import of tensorflow, once begun (its first submodule: tputrain
  finds the package itself), prints "tputrain-test: held while importing
  tensorflow" and waits for a line on stdin, then goes on.
* `import:<module>`: the same at the import of `<module>` (a command that imports
  no TensorFlow, as the launcher), printing "held while importing <module>".

The test waits for the line, not for a time.
"""

import os
import sys
import time

_HOLD = os.environ.get("TPUTRAIN_TEST_HOLD")
_BOUND_S = 300  # a held process left behind by a failed test ends itself


def _hold_until_killed() -> None:
    print(f"tputrain-test: held at start-up (pid {os.getpid()})", flush=True)
    parent, deadline = os.getppid(), time.monotonic() + _BOUND_S
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(3)


class _HoldImport:
    """A meta path finder that pauses the import of `module` (for tensorflow: its
    first submodule, as tputrain finds the package itself)."""

    module = "tensorflow"

    @classmethod
    def find_spec(cls, name, path=None, target=None):  # noqa: ARG004 (the finder protocol)
        del path, target
        held = name.startswith("tensorflow.") if cls.module == "tensorflow" else name == cls.module
        if held:
            sys.meta_path.remove(cls)
            print(f"tputrain-test: held while importing {cls.module}", flush=True)
            sys.stdin.readline()
        return None


if _HOLD == "startup" and "TF_CONFIG" in os.environ:
    _hold_until_killed()
elif _HOLD == "tensorflow" or (_HOLD or "").startswith("import:"):
    _HoldImport.module = _HOLD.removeprefix("import:")
    sys.meta_path.insert(0, _HoldImport)
