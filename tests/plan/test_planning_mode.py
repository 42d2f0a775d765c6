"""The process-wide settings a plan holds (GC paused, no huge-page advice, glibc keeping what
the plan frees) come back as they were, also when plans in several threads overlap."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

from mooncake_rl.generations.catalog import TensorSpec, build_manifest
from mooncake_rl.plan import heap, update
from mooncake_rl.plan.planner import _PlanningMode
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.protocol import reported_placement

switch = getattr(np._core.multiarray, "_set_madvise_hugepage", None)


def huge_pages() -> bool | None:
    """numpy's current advice, read by setting it to itself."""
    if switch is None:
        return None
    current = switch(True)
    switch(current)
    return current


@pytest.mark.parametrize("before", [True, False])
def test_overlapping_plans_restore_the_settings_they_found(before: bool) -> None:
    mode = _PlanningMode()
    gc_before, advice_before = gc.isenabled(), huge_pages()
    (gc.enable if before else gc.disable)()
    if switch is not None:
        switch(before)
    try:
        first, second = mode.held(), mode.held()
        first.__enter__()
        second.__enter__()  # a second thread's plan begins while the first runs
        assert not gc.isenabled() and huge_pages() in (False, None)
        first.__exit__(None, None, None)  # the first ends: the second still plans
        assert not gc.isenabled() and huge_pages() in (False, None)
        second.__exit__(None, None, None)
        assert gc.isenabled() is before
        assert huge_pages() in (before, None)
    finally:
        (gc.enable if gc_before else gc.disable)()
        if switch is not None and advice_before is not None:
            switch(advice_before)


def test_a_failed_plan_restores_the_settings() -> None:
    mode = _PlanningMode()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), mode.held():
        raise RuntimeError("a plan that failed")
    assert gc.isenabled()


def test_reading_boxes_on_a_miss_holds_the_mode_and_gives_it_back(monkeypatch) -> None:
    """plan.update builds a 1T MoE's parts from a million boxes: with the collector paused
    (it would rescan the caller's heap), and running again once the plan is made."""
    specs = [TensorSpec("w", (8, 4), "bfloat16"), TensorSpec("b", (4,), "bfloat16")]
    engines = {
        url: [reported_placement(w) for w in workers]
        for url, workers in simulated_engines(specs, [("n0", 2), ("n1", 2)], "direct").items()
    }
    seen: list[bool] = []
    build = update._engine_parts

    def spied(*args):
        seen.append(gc.isenabled())
        return build(*args)

    monkeypatch.setattr(update, "_engine_parts", spied)
    assert gc.isenabled()
    plan = update.plan_routing(build_manifest("m", 1, specs, "now"), engines, "direct", 64)
    assert seen == [False] and gc.isenabled()
    assert plan.unique_demand_bytes == 8 * 4 * 2 + 4 * 2


class _Made:
    """A tracked object of a type nothing else makes, found by identity in a generation."""


def _generation_of(obj: object) -> int | None:
    return next((g for g in range(3) if any(o is obj for o in gc.get_objects(g))), None)


def test_what_a_plan_leaves_joins_the_oldest_generation_and_is_still_collected() -> None:
    """Without the move, the first collection after a plan rescans everything it made
    (0.3-0.4 s after a 1T MoE's plan); after it, a cycle left behind is still freed by the
    next full collection."""
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with _PlanningMode().held():
        kept = _Made()
        cycle: list[object] = [_Made()]
        cycle.append(cycle)
    assert _generation_of(kept) == 2 and gc.get_freeze_count() == 0
    assert _generation_of(cycle) == 2
    in_cycle = weakref.ref(cycle[0])
    del cycle
    assert in_cycle() is not None  # only the collector frees a cycle
    gc.collect()
    assert in_cycle() is None


def test_objects_another_owner_froze_stay_frozen() -> None:
    """A server that froze its startup heap (``gc.freeze``) keeps it frozen: the plan's
    survivors are then left where they are, not unfrozen together with the server's."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        with _PlanningMode().held():
            kept = _Made()
        assert gc.get_freeze_count() == frozen
        assert _generation_of(kept) == 0
    finally:
        gc.unfreeze()


HEAP_PROBE = """
import resource, sys
import numpy as np
from mooncake_rl.plan.planner import _PlanningMode

def faults_touching(nbytes):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = np.ones(nbytes, np.uint8)  # every page touched
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, block

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()

np._core.multiarray._set_madvise_hugepage(False)  # count 4 KiB pages in every run
hold = _PlanningMode().held(keep_heap=sys.argv[1] == "plan")
if sys.argv[1] != "free":
    hold.__enter__()
faults_touching(16 << 20)  # made and freed
again = faults_touching(16 << 20)[0]  # freed again
returned = 0
if sys.argv[1] == "plan":
    blocks = [faults_touching(16 << 20)[1] for _ in range(16)]  # 256 MiB, then freed
    del blocks
    kept = rss()
    hold.__exit__(None, None, None)
    returned = kept - rss()
print(again, returned)
"""


def _probe(run: str, **env: str) -> tuple[int, int]:
    """In a fresh interpreter (glibc's thresholds are process-wide, and this one has
    planned already), a 16 MiB array is made, freed and made again: its page faults the
    second time. ``plan`` holds the mode as a plan does, frees 256 MiB more and reports the
    bytes handed back when the hold ends; ``plain`` holds it as other work does; ``free``
    does not hold it."""
    ran = subprocess.run(
        [sys.executable, "-c", HEAP_PROBE, run],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    again, returned = ran.stdout.split()
    return int(again), int(returned)


def test_a_plan_reuses_the_memory_it_freed_and_gives_it_back_at_the_end() -> None:
    """glibc maps and unmaps each large array on its own: the same 16 MiB faults in again
    (4,096 pages). While a plan holds the mode they are reused, and the plan's end hands
    the free pages back instead of keeping its peak."""
    assert _probe("free")[0] >= 4000
    again, returned = _probe("plan")
    assert again < 100
    assert returned >= 200 << 20


def test_holds_that_plan_nothing_leave_malloc_alone() -> None:
    """The coordinator holds the mode once per engine body: those holds pay no trim (a
    walk over every free chunk) and change nothing in malloc."""
    assert _probe("plain")[0] >= 4000


def test_malloc_the_operator_tuned_is_left_alone() -> None:
    assert _probe("plan", MALLOC_TRIM_THRESHOLD_="131072")[0] >= 4000


WARM_PROBE = """
import resource, sys, threading
import numpy as np
from mooncake_rl.plan import heap

def my_faults_touching(nbytes):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    block = np.ones(nbytes, np.uint8)  # every page touched, on this thread
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

np._core.multiarray._set_madvise_hugepage(False)  # count 4 KiB pages
assert heap.keep_freed_memory()
elsewhere = []
side = threading.Thread(target=lambda: elsewhere.append(heap.warm(256 << 20)))
side.start()
side.join()
warming = heap.warm(256 << 20) if sys.argv[1] == "warm" else None
if warming is not None:
    warming.join()
too_small = heap.warm(heap.WARM_AT_LEAST - 1)
print(elsewhere[0] is None, too_small is None, my_faults_touching(192 << 20))
"""


def test_a_warmed_heap_serves_a_large_array_without_page_faults() -> None:
    """The pages :func:`heap.warm` faults in on its own thread are the ones the planning
    thread's next arrays use, also those above glibc's mmap threshold (192 MiB here): the
    planning thread then takes a few faults where it took one per page. Off the main thread
    (another arena) and below the smallest useful size nothing is warmed."""
    runs = {}
    for run in ("cold", "warm"):
        ran = subprocess.run(
            [sys.executable, "-c", WARM_PROBE, run], capture_output=True, text=True, check=True
        )
        off_main, too_small, faults = ran.stdout.split()
        assert off_main == too_small == "True"
        runs[run] = int(faults)
    pages = (192 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert runs["cold"] >= 0.9 * pages
    assert runs["warm"] < 0.02 * pages


def test_a_plan_whose_warming_thread_cannot_start_still_plans_and_restores(monkeypatch) -> None:
    """Warming is an optimisation: a process out of threads plans without it, and the
    mode it entered (the collector paused) is still left as it was found."""

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    assert gc.isenabled()
    mode = _PlanningMode()
    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", refuse)
        with mode.held(keep_heap=True, warm_bytes=heap.WARM_AT_LEAST):
            assert not gc.isenabled()
            assert mode._warming is None
    assert gc.isenabled()
