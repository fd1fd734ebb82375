"""The host CPU as Linux describes it (`/proc/cpuinfo`): its model name and its
instruction-set flags.

What tputrain keeps per kind of machine is keyed by them: XLA's compile cache
folder (the flags: programs compiled for AVX-512 must not reach an AVX2 host),
the plan trial's machine record and the measured FLOP/s peak (the name). One
reader for all three, so they agree on what "the same CPU" is. Imports no
TensorFlow (the compile cache is set up at `import tputrain`).
"""

from __future__ import annotations

import platform

CPUINFO = "/proc/cpuinfo"


def _first_field(names: tuple[str, ...], path: str) -> str | None:
    """The value of the first line of `path` that starts with one of `names`."""
    try:
        with open(path, encoding="utf-8") as info:
            for line in info:
                if line.startswith(names):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name(path: str = CPUINFO) -> str:
    """The CPU's model name ("Intel(R) Xeon(R) ..."), else what `platform` knows."""
    return _first_field(("model name",), path) or platform.processor() or platform.machine()


def cpu_flags(path: str = CPUINFO) -> str:
    """The CPU's instruction-set flags ("fpu ... avx2 avx512f ..."; Arm: its Features),
    else its name from `platform`."""
    return _first_field(("flags", "Features"), path) or platform.processor()
