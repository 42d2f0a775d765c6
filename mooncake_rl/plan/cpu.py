"""Whether numpy's vectorized sort is the slow one on this CPU.

A plan sorts millions of packed int64 keys (``grid.stable_order``). numpy sorts 32- and
64-bit keys with x86-simd-sort, whose AVX-512 path partitions with compress-stores to
memory; AMD Zen 4 (family 19h with AVX-512) runs that form in microcode, so there numpy's
quicksort is several times slower than its AVX2 path (numpy/x86-simd-sort#6; the JDK turns
its AVX-512 sort off on Zen 4 for the same reason). numpy picks its kernels once, at
import, for the whole process, so the planner does not change them: where this says the
quicksort is slow, ``grid.stable_order`` sorts with numpy's timsort instead, which merges
the ordered runs a plan's keys are mostly made of.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

ZEN4_FAMILY = 0x19  # AMD family 19h: Zen 3 (no AVX-512) and Zen 4; Zen 5 is 1Ah


@dataclass(frozen=True)
class HostCpu:
    """What decides numpy's sort speed here: the CPU, and whether numpy dispatches AVX-512."""

    model: str
    vendor: str
    family: int
    numpy_avx512: bool  # numpy's kernels use AVX-512 (the CPU has it, not turned off at import)

    @property
    def slow_sort(self) -> bool:
        return self.vendor == "AuthenticAMD" and self.family == ZEN4_FAMILY and self.numpy_avx512

    def as_json(self) -> dict[str, object]:
        return {
            "cpu": self.model,
            "vendor": self.vendor,
            "family": self.family,
            "numpy_avx512": self.numpy_avx512,
            "numpy_sort_slow": self.slow_sort,
        }


def parse_cpuinfo(text: str, numpy_avx512: bool) -> HostCpu:
    """The first processor's fields of ``/proc/cpuinfo`` (every core reports the same)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    family = fields.get("cpu family", "")
    return HostCpu(
        model=fields.get("model name", "unknown"),
        vendor=fields.get("vendor_id", "unknown"),
        family=int(family) if family.isdigit() else -1,
        numpy_avx512=numpy_avx512,
    )


def numpy_uses_avx512() -> bool:
    """numpy's own record of the features it dispatches to (``np.show_runtime`` reads it)."""
    from numpy._core._multiarray_umath import __cpu_features__

    return bool(__cpu_features__.get("AVX512F", False))


def host_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> HostCpu:
    try:
        text = cpuinfo.read_text()
    except OSError:  # not Linux
        text = ""
    return parse_cpuinfo(text, numpy_uses_avx512())


@functools.cache
def vectorized_sort_is_slow() -> bool:
    """Once per process: numpy's dispatch is fixed at import, and the CPU does not change."""
    return host_cpu().slow_sort
