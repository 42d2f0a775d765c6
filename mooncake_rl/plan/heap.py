"""glibc's malloc keeps the memory a plan frees while the plan runs.

Why: a cold plan of a 1T MoE makes and drops hundreds of numpy arrays of 1-40 MB. By
default glibc serves a request above its mmap threshold (128 KiB at start, raised by the
first large frees) with a fresh mapping that ``free`` unmaps, and trims the heap's top
whenever more than twice that threshold lies free. So nearly every array a plan makes is
memory the kernel maps and zeroes again: for fp8 Kimi-K2 on 16 x TP8 engines, 1.7-2.0 s of
system time in a 6.7-7.9 s plan on this host, 0.7-0.9 s with the heap kept.

While any plan runs, requests up to glibc's largest mmap threshold come from the heap and
freed memory stays there for the next array. When the last plan ends the thresholds are
left where glibc's own dynamic rule puts them once a process has freed one such array
(every 1T plan frees several); glibc has no call that turns its dynamic rule back on,
hence that resting point. Then ``malloc_trim`` hands the free pages back, so the process
does not keep a plan's peak. A trim walks every free chunk (0.5-3 ms even with nothing to
return): it ends a plan, which the coordinator makes once per layout, and nothing that
runs once per engine. Where malloc is not glibc's, or the operator tuned it (``MALLOC_*_``
variables, ``GLIBC_TUNABLES``), nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
RESTING_TRIM_THRESHOLD = 2 * MMAP_THRESHOLD_MAX  # where glibc's rule puts it beside that
KEEP_UP_TO = 2**31 - 1  # the largest trim threshold mallopt takes (an int): 2 GiB
TUNING_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


@cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc and the operator left its malloc untuned."""
    if any(name in os.environ for name in TUNING_VARIABLES) or "malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc exports it
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Serve arrays from the heap and keep what is freed; False where nothing changed."""
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    libc.mallopt(M_TRIM_THRESHOLD, KEEP_UP_TO)
    return True


def give_back_freed_memory() -> None:
    """glibc's resting thresholds, then every free page of the heap back to the kernel."""
    libc = _glibc()
    if libc is None:
        return
    libc.mallopt(M_TRIM_THRESHOLD, RESTING_TRIM_THRESHOLD)
    libc.malloc_trim(0)
