"""cpu_info: the CPU's name and flags as /proc/cpuinfo gives them, one reader for the
compile cache's folder, the plan trial's record and the FLOP peak's key."""

from __future__ import annotations

import platform

from tputrain.core import cpu_info

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 avx512f
processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 avx512f
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd sve
"""


def test_the_name_and_flags_are_the_first_processors(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(X86)
    assert cpu_info.cpu_name(str(path)) == "Intel(R) Xeon(R) Processor"
    assert cpu_info.cpu_flags(str(path)) == "fpu sse2 avx2 avx512f"
    path.write_text(ARM)  # Arm names its instruction sets Features and has no model name
    assert cpu_info.cpu_flags(str(path)) == "fp asimd sve"
    assert cpu_info.cpu_name(str(path)) == (platform.processor() or platform.machine())


def test_without_cpuinfo_platform_names_the_cpu(tmp_path):
    missing = str(tmp_path / "none")
    assert cpu_info.cpu_name(missing) == (platform.processor() or platform.machine())
    assert cpu_info.cpu_flags(missing) == platform.processor()
