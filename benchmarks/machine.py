"""The machine a benchmark figure is from, named the same way in every result file.

Figures differ by CPU kind (AVX2-only, AVX-512, AMX; oneDNN or not), so each result
names it. Reads the CPU through `tputrain.core.cpu_info`, the library's one reader of
/proc/cpuinfo, so a result file and the library's per-machine records (compile
cache, plan trial) agree on what "the same CPU" is.
"""

from __future__ import annotations

from tputrain.core.cpu_info import cpu_flags, cpu_name

# The instruction sets that change TensorFlow's CPU kernels (and XLA's code).
KINDS = ("avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "avx2")


def cpu_kind() -> str:
    """The CPU's instruction sets among `KINDS` ("avx512f ... avx2"), or "no avx2"."""
    flags = cpu_flags().split()
    return " ".join(flag for flag in KINDS if flag in flags) or "no avx2"


def cpu_model() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) ...")."""
    return cpu_name()


def has_flag(flag: str) -> bool:
    """Whether the CPU lists `flag` (e.g. "avx512f")."""
    return flag in cpu_flags().split()
