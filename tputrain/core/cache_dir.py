"""tputrain's cache folder for the machine: what one run computes and later runs reuse.

The digits and text corpora, the CPU's measured FLOP peak and the plan trial's
choices each keep a file or folder there; `TPUTRAIN_CACHE_DIR` moves all of them
(the test suite gives each session its own).
"""

from __future__ import annotations

import os

ENV = "TPUTRAIN_CACHE_DIR"


def cache_root() -> str:
    """`TPUTRAIN_CACHE_DIR`, else ~/.cache/tputrain (read at each call, so a change of
    the variable takes effect in a running process)."""
    return os.environ.get(ENV, os.path.join(os.path.expanduser("~"), ".cache", "tputrain"))
