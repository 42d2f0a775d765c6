"""Mooncake's native threads are not pinned to the cores of the thread that creates them."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from mooncake_rl.affinity import machine_cpus
from mooncake_rl.engine import TransferEngineClient
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to pin one")
@pytest.mark.parametrize("client", [TransferEngineClient, StoreClient], ids=["te", "store"])
def test_threads_of_a_client_created_by_a_pinned_thread_may_run_on_every_cpu(
    settings: Settings, client: Callable[[Settings], TransferEngineClient | StoreClient]
) -> None:
    """As inside a vLLM CPU worker, which binds each rank to its own cores."""
    original = os.sched_getaffinity(0)
    threads_before = set(os.listdir("/proc/self/task"))
    os.sched_setaffinity(0, {0})
    try:
        with client(settings):
            started = set(os.listdir("/proc/self/task")) - threads_before
            assert os.sched_getaffinity(0) == {0}
            live = live_affinities(started)
            assert live, "the client keeps native threads running"
            assert live == dict.fromkeys(live, machine_cpus())
    finally:
        os.sched_setaffinity(0, original)


def live_affinities(tids: set[str]) -> dict[str, set[int]]:
    """The CPUs each thread may run on, for the threads still alive: a native thread that
    ended between the listing and the query (the Store client starts short-lived ones)
    runs nowhere, and asking for it raises ProcessLookupError."""
    found = {}
    for tid in tids:
        try:
            found[tid] = os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            continue
    return found
