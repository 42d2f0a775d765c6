"""The planner knows where numpy's quicksort is the slow one (AMD Zen 4 with AVX-512),
and plans the same table with either sort."""

from __future__ import annotations

import json
import os

import pytest

from mooncake_rl.plan.cpu import host_cpu, parse_cpuinfo, vectorized_sort_is_slow
from tests.plan.helpers import run_bench


def cpuinfo(vendor: str, family: int) -> str:
    core = (
        f"processor\t: {{n}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
        "model\t\t: 17\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 avx512f\n\n"
    )
    return core.format(n=0) + core.format(n=1).replace(vendor, "OtherVendor")


@pytest.mark.parametrize(
    ("vendor", "family", "numpy_avx512", "slow"),
    [
        ("AuthenticAMD", 25, True, True),  # Zen 4 (family 19h) with numpy's AVX-512 sort
        ("AuthenticAMD", 25, False, False),  # the same, AVX-512 turned off at import
        ("AuthenticAMD", 26, True, False),  # Zen 5 (family 1Ah) stores compressed fast
        ("AuthenticAMD", 23, False, False),  # Zen 2: no AVX-512
        ("GenuineIntel", 6, True, False),  # the hardware x86-simd-sort's AVX-512 path is for
    ],
)
def test_only_zen4_with_numpy_avx512_is_slow(
    vendor: str, family: int, numpy_avx512: bool, slow: bool
) -> None:
    cpu = parse_cpuinfo(cpuinfo(vendor, family), numpy_avx512)
    assert (cpu.vendor, cpu.family, cpu.model) == (vendor, family, "Some CPU")  # first core
    assert cpu.slow_sort is slow
    assert cpu.as_json()["numpy_sort_slow"] is slow


def test_unreadable_cpuinfo_is_not_slow() -> None:
    cpu = parse_cpuinfo("", True)
    assert (cpu.vendor, cpu.family, cpu.slow_sort) == ("unknown", -1, False)


def plan_small(disable: str | None) -> dict:
    """``bench.plan`` on the small model in a fresh process (numpy reads the variable at
    import): its JSON."""
    env = {k: v for k, v in os.environ.items() if k != "NPY_DISABLE_CPU_FEATURES"}
    if disable is not None:
        env["NPY_DISABLE_CPU_FEATURES"] = disable
    return json.loads(run_bench("--model", "small", "--target", "2xTP4", env=env).stdout)


def test_the_table_is_the_same_whichever_sort_this_cpu_gets() -> None:
    """Where numpy dispatches AVX-512 on Zen 4 the planner takes the timsort; with AVX-512
    turned off at import it takes the quicksort: same reads, pushes and table."""
    default = plan_small(None)
    cpu = default["host"]
    with open("/proc/cpuinfo") as info:
        has_avx512 = "avx512f" in info.read().split()
    assert cpu["numpy_avx512"] is has_avx512  # numpy dispatches to what the CPU has
    expected = cpu["vendor"] == "AuthenticAMD" and cpu["family"] == 25 and has_avx512
    assert cpu["numpy_sort_slow"] is expected
    assert vectorized_sort_is_slow() is host_cpu().slow_sort is expected

    fixed = plan_small("AVX512F")
    assert fixed["host"]["numpy_avx512"] is False and fixed["host"]["numpy_sort_slow"] is False
    for field in ("reads", "pushes", "table_digest"):
        assert fixed[field] == default[field], field
