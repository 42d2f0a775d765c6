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

Arrays above that threshold come from the heap too while a plan runs (``M_MMAP_MAX`` 0),
so that the pages the plan frees, and the pages :func:`warm` faults in, serve them as well.

Kept pages still have to be faulted in once: a 1T MoE's plan touches 1.6 GB of fresh
pages, 0.5-0.6 s of system time on the planning thread. :func:`warm` grows the heap by
about the plan's working set and faults it in on another thread (``madvise``,
``MADV_POPULATE_WRITE``) while the plan's first, pure-Python steps run on this one. fp8
Kimi-K2 on 16 x TP8, the first plan of a fresh process: 4.28-4.61 s (median 4.39) against
4.48-4.78 s (median 4.67), five runs each, alternated; the planning thread's page faults
fall from 290k to 54k. Populating changes no byte: a page the plan writes first is simply
already there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
DEFAULT_MMAP_MAX = 65536  # glibc's default count of mmapped chunks
RESTING_TRIM_THRESHOLD = 2 * MMAP_THRESHOLD_MAX  # where glibc's rule puts it beside that
KEEP_UP_TO = 2**31 - 1  # the largest trim threshold mallopt takes (an int): 2 GiB
TUNING_VARIABLES = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_TOP_PAD_",
)
MADV_POPULATE_WRITE = 23  # Linux 5.14; an older kernel refuses it and nothing is warmed
WARM_AT_LEAST = 64 << 20  # below this, faulting pages as the plan goes costs less
WARM_STEP = 8 << 20  # pages faulted in per call (see _populate)
WARM_AT_MOST = 3 << 29  # 1.5 GiB: a free heap top past KEEP_UP_TO would be trimmed at once


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
        libc.malloc.argtypes, libc.malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
        libc.free.argtypes = (ctypes.c_void_p,)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
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
    libc.mallopt(M_MMAP_MAX, 0)
    return True


def warm(nbytes: int) -> threading.Thread | None:
    """Grow the heap by ``nbytes`` (at most :data:`WARM_AT_MOST`) and fault it in on a new
    thread, which is returned; join it before :func:`give_back_freed_memory`. Only while
    :func:`keep_freed_memory` holds (so the freed block stays in the heap), and only on the
    main thread: its heap is the one the block grows, other threads allocate from arenas of
    their own. None where nothing was warmed."""
    libc = _glibc()
    if (
        libc is None
        or nbytes < WARM_AT_LEAST
        or threading.current_thread() is not threading.main_thread()
    ):
        return None
    nbytes = min(nbytes, WARM_AT_MOST)
    block = libc.malloc(nbytes)
    if not block:
        return None
    libc.free(block)  # the pages stay mapped: the heap keeps what is freed
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-block // page) * page  # whole pages inside the block
    length = (block + nbytes) // page * page - start
    populate = threading.Thread(target=_populate, args=(libc, start, length), name="warm-heap")
    try:
        populate.start()
    except RuntimeError:  # no thread to spare: the plan faults its pages in as it goes
        return None
    return populate


def _populate(libc: ctypes.CDLL, start: int, length: int) -> None:
    """Fault pages in ``WARM_STEP`` at a time. Each call holds the address space's lock for
    reading, and the planning thread's own mappings (Python's object arenas) wait for it:
    one call over the whole block stalled the plan as long as it saved (1.2 GB, 0.3 s)."""
    for offset in range(0, length, WARM_STEP):
        libc.madvise(start + offset, min(WARM_STEP, length - offset), MADV_POPULATE_WRITE)


def give_back_freed_memory() -> None:
    """glibc's resting thresholds, then every free page of the heap back to the kernel."""
    libc = _glibc()
    if libc is None:
        return
    libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
    libc.mallopt(M_TRIM_THRESHOLD, RESTING_TRIM_THRESHOLD)
    libc.malloc_trim(0)
