"""CPU affinity for the native threads that Mooncake clients start.

A thread inherits the CPU affinity of the thread that creates it. Engines pin their
compute workers (vLLM on CPU binds each TP rank to its own cores), so a Store client or
Transfer Engine created inside a worker would have its io, handshake and copy threads
pinned to those cores too: there they queue behind compute threads and busy-polling
waiters, and the kernel cannot move them to an idle core. Mooncake clients are therefore
created with every CPU of the machine allowed; the creating thread's affinity is restored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def machine_cpus() -> set[int]:
    """Every CPU this machine has online (not only those this thread may use)."""
    return set(range(os.cpu_count() or 1))


@contextmanager
def unpinned_native_threads() -> Iterator[None]:
    """Threads started inside the block may run on any CPU; the caller's pinning is kept.

    Where the machine's CPU set cannot be applied (a cpuset narrower than the machine),
    the caller's affinity is left alone: those threads then run where the caller may.
    """
    before = os.sched_getaffinity(0)
    widened = not machine_cpus() <= before and _allow(machine_cpus())
    try:
        yield
    finally:
        if widened:
            os.sched_setaffinity(0, before)


def _allow(cpus: set[int]) -> bool:
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return False
    return True
