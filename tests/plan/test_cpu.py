"""The planner names numpy's slow AVX-512 sort on AMD Zen 4, and only there."""

from __future__ import annotations

import json
import os

import pytest

from mooncake_rl.plan.cpu import FIX, host_cpu, parse_cpuinfo, warn_once_if_sort_is_slow
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


def plan_small(disable: str | None) -> tuple[dict, str]:
    """``bench.plan`` on the small model in a fresh process (numpy reads the variable at
    import): its JSON, and what it logged."""
    env = {k: v for k, v in os.environ.items() if k != "NPY_DISABLE_CPU_FEATURES"}
    if disable is not None:
        env["NPY_DISABLE_CPU_FEATURES"] = disable
    done = run_bench("--model", "small", "--target", "2xTP4", env=env)
    return json.loads(done.stdout), done.stderr


def test_a_cold_plan_names_the_fix_once_where_the_sort_is_slow() -> None:
    default, logged = plan_small(None)
    cpu = default["host"]
    with open("/proc/cpuinfo") as info:
        has_avx512 = "avx512f" in info.read().split()
    assert cpu["numpy_avx512"] is has_avx512  # numpy dispatches to what the CPU has
    expected = cpu["vendor"] == "AuthenticAMD" and cpu["family"] == 25 and has_avx512
    assert cpu["numpy_sort_slow"] is expected
    assert logged.count(FIX) == (1 if expected else 0), logged

    fixed, logged = plan_small("AVX512F")
    assert fixed["host"]["numpy_avx512"] is False and fixed["host"]["numpy_sort_slow"] is False
    assert FIX not in logged, logged
    assert fixed["pushes"] == default["pushes"] and fixed["reads"] == default["reads"]


def test_the_hint_is_logged_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    warn_once_if_sort_is_slow.cache_clear()
    with caplog.at_level("WARNING", logger="mooncake_rl.plan.cpu"):
        for _ in range(3):
            warn_once_if_sort_is_slow()
    hints = [r for r in caplog.records if FIX in r.getMessage()]
    assert len(hints) == (1 if host_cpu().slow_sort else 0)
