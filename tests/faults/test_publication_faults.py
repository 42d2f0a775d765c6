"""Publications that fail, and publications that race, against a real master (issue 14).

Every failure is caused, not mocked: a rank process killed mid-publish, a put the Store
cannot place (``StoreFull``), a duplicate tensor name; two processes publishing one model at
the same moment. The end state is asserted exactly: the next good publish is announced under
a fresh number, the failed attempt left only its tombstoned claim, losers name the winner.

The fast cases run in ``make test``; the full matrix is marked ``faults`` (``make faults``).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mooncake_rl.generations import GenerationRegistry, active_generation
from mooncake_rl.generations.assignment import TrainerTopology
from mooncake_rl.generations.commands import verify_generation
from mooncake_rl.generations.keys import (
    checksums_key,
    claim_key,
    group_id,
    manifest_key,
    report_key,
)
from mooncake_rl.generations.publisher import (
    GenerationPublisher,
    PublishFailed,
    finalize_generation,
    publish_local,
    start_attempt,
)
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from tests.conftest import fragment_bytes, payload_keys, settings_for, trainer_settings
from tests.procs import CTX, ProcessGroup
from tests.test_generations import RankBehaviour, model_tensors, publish_two_nodes

GOOD = [("embed", torch.arange(64, dtype=torch.float32)), ("norm", torch.ones(8))]


def attempt_objects(model: str, generation: int, names: list[str], ranks: int = 2) -> list[str]:
    """Every key an attempt at ``generation`` could have written (its claim excepted)."""
    group = group_id(model, generation)
    keys = payload_keys(group, names, ranks)
    keys += [report_key(group, rank) for rank in range(ranks)]
    return [*keys, manifest_key(group), checksums_key(group)]


def assert_only_tombstone_left(
    store: StoreClient, model: str, generation: int, names: list[str]
) -> None:
    """The failed attempt left nothing but its claim, and the claim is tombstoned."""
    leftovers = attempt_objects(model, generation, names)
    assert store.exists(leftovers) == [False] * len(leftovers), dict(
        zip(leftovers, store.exists(leftovers), strict=True)
    )
    claim = GenerationRegistry(store, model).claim(generation)
    assert claim is not None and claim.aborted_at is not None, claim
    assert store.exists([claim_key(group_id(model, generation))]) == [True]


def assert_good_publish_after(store: StoreClient, model: str, failed: int) -> int:
    """Republishing the good set succeeds under a number never used before, and is whole."""
    record = publish_local(store, model, GOOD, dtype="float32")
    assert record.generation > failed
    registry = GenerationRegistry(store, model)
    assert registry.active() == record
    assert record.generation not in {failed}
    claim = registry.claim(record.generation)
    assert claim is not None and claim.aborted_at is None
    report = verify_generation(store, model, record.generation)
    assert report["ok"] and report["tensors"] == len(GOOD), report
    manifest = registry.load_manifest(record.generation, record.manifest_digest)
    got = {f.tensor_id: fragment_bytes(store, f) for f in manifest.fragments}
    assert got == {name: t.numpy().tobytes() for name, t in GOOD}
    return record.generation


# -- 1. fail a publish three ways, then publish again ------------------------------------


def test_duplicate_name_then_republish(settings: Settings) -> None:
    model = "fault-duplicate"
    with StoreClient(settings) as store:
        first = publish_local(store, model, GOOD, dtype="float32").generation
        assert first == 1
        with pytest.raises(PublishFailed, match="duplicate tensor name 'embed'"):
            publish_local(store, model, [*GOOD, GOOD[0]], dtype="float32")
        assert active_generation(store, model).generation == 1
        assert_only_tombstone_left(store, model, 2, ["embed", "norm"])
        assert assert_good_publish_after(store, model, failed=2) == 3


def test_failed_publish_does_not_wedge_the_next_two(settings: Settings) -> None:
    """The original wedge: after a failed attempt the next publishes neither wait nor fail."""
    model = "fault-wedge"
    with StoreClient(settings) as store:
        assert publish_local(store, model, GOOD, dtype="float32").generation == 1
        with pytest.raises(PublishFailed, match="duplicate tensor name"):
            publish_local(store, model, [GOOD[0], GOOD[0]], dtype="float32")
        started = time.monotonic()
        third = publish_local(store, model, GOOD, dtype="float32")
        fourth = publish_local(store, model, GOOD, dtype="float32")
        elapsed = time.monotonic() - started
        assert (third.generation, fourth.generation) == (3, 4)
        assert active_generation(store, model) == fourth
        assert elapsed < 15, f"two publishes after a failure took {elapsed:.1f}s"
        assert_only_tombstone_left(store, model, 2, ["embed"])
        registry = GenerationRegistry(store, model)
        assert [g.generation for g in registry.generations()] == [1, 3, 4]


@pytest.mark.faults
def test_store_full_then_republish(settings: Settings) -> None:
    model = "fault-full"
    huge = torch.zeros(settings.segment_bytes, dtype=torch.float32)  # 4x the largest segment
    with StoreClient(settings) as store:
        assert publish_local(store, model, GOOD, dtype="float32").generation == 1
        with pytest.raises(PublishFailed, match=r"tensor 'huge'.*NO_AVAILABLE_HANDLE"):
            publish_local(store, model, [*GOOD, ("huge", huge)], dtype="float32")
        assert active_generation(store, model).generation == 1
        assert_only_tombstone_left(store, model, 2, ["embed", "norm", "huge"])
        assert assert_good_publish_after(store, model, failed=2) == 3


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_killed_rank_then_republish(master: EmbeddedMaster, holders) -> None:
    model = "fault-killed"
    names = [name for name, _ in model_tensors(4)]
    assert publish_two_nodes(master, holders, model, 1, seed=3)[0]["active"].generation == 1
    [rank0] = publish_two_nodes(
        master, holders, model, 2, seed=4, rank1=RankBehaviour(die_after=20), finalize_timeout_s=8
    )
    assert "rank 1 did not report within 8" in rank0["error"]
    with StoreClient(settings_for(master, "inspector")) as store:
        assert active_generation(store, model).generation == 1
        assert_only_tombstone_left(store, model, 2, names)
    # The same two ranks publish the good set again: a fresh number, announced.
    again = publish_two_nodes(master, holders, model, 3, seed=4)
    assert "error" not in again[0] and again[0]["active"].generation == 3
    with StoreClient(settings_for(master, "inspector")) as store:
        assert active_generation(store, model) == again[0]["active"]
        assert verify_generation(store, model, 3)["ok"]
        assert_only_tombstone_left(store, model, 2, names)


# -- 2. two publishes of one model at once ----------------------------------------------


def racing_publisher(
    settings: Settings, model: str, me: int, rounds: int, barrier: Any, numbers: Any, done: Any
) -> list[dict[str, Any]]:
    """One of two trainers: each round claims, puts, meets the other at the barrier, then
    announces. In odd rounds the one holding the lower number announces a little later, so
    it must lose; in even rounds both announce at once (a real race)."""
    outcomes = []
    with StoreClient(settings) as store, _setting(done):
        for round_ in range(rounds):
            barrier.wait()
            generation, attempt = start_attempt(store, model)
            numbers[me] = generation
            publisher = GenerationPublisher(
                store, model, generation, 0, TrainerTopology.single(), "float32", attempt=attempt
            )
            tensors = [("w", torch.full((256,), float(1000 * me + round_)))]
            report = publisher.publish(tensors)
            barrier.wait()
            if round_ % 2 == 1 and generation < numbers[1 - me]:
                time.sleep(0.3)
            outcome: dict[str, Any] = {"round": round_, "generation": generation}
            try:
                record = finalize_generation(publisher, report, keep=2)
                outcome["won"] = record.generation
            except PublishFailed as error:
                outcome["error"] = str(error)
            outcomes.append(outcome)
    return outcomes


@contextlib.contextmanager
def _setting(event: Any) -> Iterator[None]:
    try:
        yield
    finally:
        event.set()


def watch_fences(
    settings: Settings, model: str, done: tuple[Any, Any], ready: Any
) -> list[tuple[int, int]]:
    """Record every (fence, generation) the active record passes through, in order, until
    both publishers are done."""
    seen: list[tuple[int, int]] = []
    with StoreClient(settings) as store:
        registry = GenerationRegistry(store, model)
        ready.put("watching")
        while not all(event.is_set() for event in done):
            record = registry.active()
            if record is not None and (not seen or seen[-1] != (record.fence, record.generation)):
                seen.append((record.fence, record.generation))
    return seen


def race(master: EmbeddedMaster, holders, model: str, rounds: int) -> None:
    """Every process lends no memory: records and payloads sit in a segment holder that
    outlives the publishers (records in a publisher's own segment would die with it)."""
    holder = holders("race-store")
    with ProcessGroup() as group:
        barrier, numbers = CTX.Barrier(2), CTX.Array("i", 2)
        done, ready = (CTX.Event(), CTX.Event()), group.queue()
        group.start(watch_fences, trainer_settings(master, holder, "watcher"), model, done, ready)
        assert ready.get(timeout=120) == "watching"
        for me in (0, 1):
            settings = trainer_settings(master, holder, f"trainer-{me}")
            group.start(racing_publisher, settings, model, me, rounds, barrier, numbers, done[me])
        fences, first, second = group.results(timeout_s=60 + 20 * rounds)
    outcomes = [*first, *second]
    winners = sorted(o["won"] for o in outcomes if "won" in o)
    losers = [o for o in outcomes if "error" in o]
    assert len(outcomes) == 2 * rounds and len(winners) + len(losers) == 2 * rounds
    assert len(set(o["generation"] for o in outcomes)) == 2 * rounds  # no number twice
    assert len(losers) >= rounds // 2, outcomes  # every forced round produced a loser
    # The watcher saw fences and generations only move forward.
    assert fences == sorted(fences) and [g for _, g in fences] == sorted(g for _, g in fences)
    assert {g for _, g in fences} <= set(winners)
    with StoreClient(settings_for(master, "inspector")) as store:
        registry = GenerationRegistry(store, model)
        assert registry.active().generation == max(winners)
        for loser in losers:
            found = re.search(r"lost to generation (\d+)", loser["error"])
            assert found, loser
            assert int(found.group(1)) > loser["generation"]
            assert int(found.group(1)) in winners
            assert_only_tombstone_left(store, model, loser["generation"], ["w"])
        for info in registry.generations():
            assert info.generation in winners
            report = verify_generation(store, model, info.generation)
            assert report["ok"], report


def test_two_concurrent_publishers_smoke(master: EmbeddedMaster, holders) -> None:
    race(master, holders, "fault-race-smoke", rounds=3)


@pytest.mark.faults
@pytest.mark.timeout(900)
def test_two_concurrent_publishers_twenty_rounds(master: EmbeddedMaster, holders) -> None:
    race(master, holders, "fault-race", rounds=20)
