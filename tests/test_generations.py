"""Generations against a real master: multi-process publish, announce fences, failures, GC."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from mooncake_rl.errors import InvariantViolation, StoreFull
from mooncake_rl.generations import (
    GenerationPublisher,
    GenerationRegistry,
    TrainerTopology,
    active_generation,
    finalize_generation,
    load_manifest,
)
from mooncake_rl.generations.catalog import build_manifest
from mooncake_rl.generations.checksums import ChecksumTable
from mooncake_rl.generations.gc import collect_garbage
from mooncake_rl.generations.keys import (
    group_id,
    payload_key,
    payload_prefix,
    report_key,
    routing_table_key,
)
from mooncake_rl.generations.layout import layout_digest
from mooncake_rl.generations.leases import lease_book
from mooncake_rl.generations.packing import DEFAULT_PACK_BYTES, object_extents, pack_name
from mooncake_rl.generations.publisher import PublishFailed, publish_local, start_attempt
from mooncake_rl.generations.registry import FenceError
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from tests.conftest import payload_keys, settings_for, trainer_settings
from tests.procs import ProcessGroup


def model_tensors(seed: int, count: int = 56) -> list[tuple[str, torch.Tensor]]:
    """Mixed sizes (1 to ~200k elements), mixed source dtypes, some non-contiguous."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for i in range(count):
        rows = int(torch.randint(1, 400, (1,), generator=generator))
        cols = int(torch.randint(1, 500, (1,), generator=generator))
        tensor = torch.randn(cols, rows, generator=generator, dtype=torch.float32)
        if i % 3 == 0:
            tensor = tensor.t()  # non-contiguous view
        tensors.append((f"layers.{i}.weight", tensor))
    return tensors


def expected_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> bytes:
    return tensor.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class RankBehaviour:
    """How one test publisher misbehaves: dies mid-iteration, or starts only once rank 0 has
    aborted the generation (the straggler the abort marker exists for)."""

    die_after: int | None = None
    start_after_abort: bool = False


def publish_rank(
    settings: Settings,
    model: str,
    generation: int,
    attempt: str,
    rank: int,
    nodes: tuple[str, ...],
    seed: int,
    behaviour: RankBehaviour,
    finalize_timeout_s: float,
) -> dict:
    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        while behaviour.start_after_abort and not publisher.aborted():
            time.sleep(0.05)
        for index, item in enumerate(model_tensors(seed)):
            if index == behaviour.die_after:
                os._exit(17)  # a publisher killed mid-generation
            yield item

    with StoreClient(settings) as store:
        publisher = GenerationPublisher(
            store,
            model,
            generation,
            rank,
            TrainerTopology(nodes),
            "bfloat16",
            check_locality=True,
            attempt=attempt if rank == 0 else None,
        )
        report = publisher.publish(tensors())
        result = {"segment": store.local_segment, "report": report}
        if rank == 0:
            try:
                result["active"] = finalize_generation(
                    publisher, report, timeout_s=finalize_timeout_s
                )
            except PublishFailed as error:
                result["error"] = str(error)
        return result


def publish_two_nodes(
    master: EmbeddedMaster,
    holders,
    model: str,
    generation: int,
    seed: int | tuple[int, int],
    rank1: RankBehaviour = RankBehaviour(),
    finalize_timeout_s: float = 60.0,
) -> list[dict]:
    """Rank 0 on node-a, rank 1 on node-b; rank 0 finalizes. A killed rank 1 returns nothing.

    The attempt claims the next number, which must be ``generation``; a pair of seeds makes
    the two ranks iterate different tensor sets."""
    seeds = (seed, seed) if isinstance(seed, int) else seed
    nodes = ("node-a", "node-b")
    ranks = [trainer_settings(master, holders(node), node) for node in nodes]
    with StoreClient(ranks[0]) as store:
        claimed, attempt = start_attempt(store, model)
    assert claimed == generation
    with ProcessGroup() as group:
        for rank, settings in enumerate(ranks):
            behaviour = rank1 if rank == 1 else RankBehaviour()
            group.start(
                publish_rank,
                settings,
                model,
                generation,
                attempt,
                rank,
                nodes,
                seeds[rank],
                behaviour,
                finalize_timeout_s,
            )
        if rank1.die_after is not None:
            return [group.results_of(0)]
        return group.results()


def read_generation(settings: Settings, model: str) -> dict[str, bytes]:
    """A brand-new process with only the Store address finds and reads the active generation."""
    with StoreClient(settings) as store:
        record = active_generation(store, model)
        manifest = load_manifest(store, model, record.generation)
        out = {"__generation__": str(record.generation).encode()}
        for fragment in manifest.fragments:
            stored = store.get_bytes(fragment.object_key)  # the tensor's own object, or its pack
            out[fragment.tensor_id] = stored[fragment.object_offset :][: fragment.nbytes]
        return out


def test_two_publishers_on_two_nodes(master: EmbeddedMaster, holders) -> None:
    model = "two-nodes"
    results = publish_two_nodes(master, holders, model, 1, seed=1)
    rank0, rank1 = results
    assert "error" not in rank0 and rank0["active"].generation == 1
    segments = {0: rank0["segment"], 1: rank1["segment"]}
    tensors = model_tensors(1)
    total = sum(t.numel() * 2 for _, t in tensors)
    per_rank = [r["report"].put_bytes for r in results]
    assert sum(per_rank) == total
    assert max(per_rank) <= 1.10 * min(per_rank), per_rank
    assert [r["report"].nonlocal_put_bytes for r in results] == [0, 0]
    with StoreClient(settings_for(master, "inspector")) as store:
        manifest = load_manifest(store, model, 1)
        assert len(manifest.fragments) == len(tensors) >= 50
        # Announce seals the layout digest into the record: consumers' plan-cache key.
        assert active_generation(store, model).layout_digest == layout_digest(manifest)
        placed_on, object_of = {}, {}
        prefix = len(payload_prefix(manifest.group_id))
        for fragment in manifest.fragments:
            (segment,) = store.replica_segments(fragment.object_key)
            placed_on[fragment.tensor_id] = segment
            object_of[fragment.tensor_id] = fragment.object_key[prefix:]
        # Every object sits in the node-local segment of the rank assigned to publish it.
        from mooncake_rl.generations import assign_publishers

        assignment = assign_publishers(
            [(n, t.numel() * 2) for n, t in tensors], TrainerTopology(("node-a", "node-b"))
        )
        assert placed_on == {name: segments[rank] for name, rank in assignment.items()}
        # The announce recorded the same segments: the planner's locality hints.
        record = active_generation(store, model)
        hints = GenerationRegistry(store, model).load_segments(1, record.segments_digest)
        assert {name: hints.segment(object_of[name]) for name in placed_on} == placed_on
    with ProcessGroup() as group:
        group.start(read_generation, settings_for(master, "fresh"), model)
        got = group.results()[0]
    assert got.pop("__generation__") == b"1"
    assert got == {name: expected_bytes(t, torch.bfloat16) for name, t in tensors}


def test_killed_publisher_keeps_previous_generation(master: EmbeddedMaster, holders) -> None:
    model = "killed"
    assert publish_two_nodes(master, holders, model, 1, seed=3)[0]["active"].generation == 1
    [rank0] = publish_two_nodes(
        master, holders, model, 2, seed=4, rank1=RankBehaviour(die_after=20), finalize_timeout_s=8
    )
    assert "rank 1 did not report" in rank0["error"]
    with StoreClient(settings_for(master, "inspector")) as store:
        assert active_generation(store, model).generation == 1
        gen2_keys = payload_keys(group_id(model, 2), (n for n, _ in model_tensors(4)))
        assert not any(store.exists(gen2_keys))
    got = read_generation(settings_for(master, "reader"), model)
    got.pop("__generation__")
    assert got == {name: expected_bytes(t, torch.bfloat16) for name, t in model_tensors(3)}


def test_late_publisher_removes_what_it_put_after_the_abort(
    master: EmbeddedMaster, holders
) -> None:
    model = "late"
    rank0, rank1 = publish_two_nodes(
        master,
        holders,
        model,
        1,
        seed=7,
        rank1=RankBehaviour(start_after_abort=True),
        finalize_timeout_s=1,
    )
    assert "rank 1 did not report within 1s" in rank0["error"]
    assert rank1["report"].put_tensors > 0
    assert rank1["report"].failures[-1] == ("", "generation aborted")
    group = group_id(model, 1)
    with StoreClient(settings_for(master, "inspector")) as store:
        assert active_generation(store, model) is None
        leftovers = payload_keys(group, (n for n, _ in model_tensors(7)))
        leftovers += [report_key(group, rank) for rank in (0, 1)]
        assert store.exists(leftovers) == [False] * len(leftovers)


def test_store_out_of_space_aborts_and_names_the_tensor(settings: Settings) -> None:
    model = "no-space"
    with StoreClient(settings) as store:
        publish_local(store, model, [("small", torch.ones(10))], dtype="float32")
        huge = torch.zeros(settings.segment_bytes, dtype=torch.float32)  # 4x the segment
        with pytest.raises(PublishFailed) as failed:
            publish_local(
                store, model, [("small", torch.ones(10)), ("huge", huge)], dtype="float32"
            )
        assert "tensor 'huge'" in str(failed.value)
        assert "NO_AVAILABLE_HANDLE (-200)" in str(failed.value)
        assert active_generation(store, model).generation == 1
        assert not any(store.exists(payload_keys(group_id(model, 2), ["small"])))
        with pytest.raises(StoreFull):
            store.put_tensor("direct-huge", huge)


def test_small_tensors_the_store_cannot_hold_abort_and_name_a_tensor() -> None:
    """Small tensors are put in packs: a pack the Store cannot place fails the generation,
    names a tensor of it and its error, and leaves nothing behind. A master of
    its own: the session's gains holders as tests run, so its room is not known here."""
    model = "no-space-small"
    with EmbeddedMaster() as master, StoreClient(settings_for(master)) as store:
        names = [f"t{i:04d}" for i in range(4 * store.settings.segment_bytes // (256 << 10))]
        tensors = [(n, torch.full((64 << 10,), float(i))) for i, n in enumerate(names)]
        publish_local(store, model, [("small", torch.ones(10))], dtype="float32")
        with pytest.raises(PublishFailed) as failed:
            publish_local(store, model, tensors, dtype="float32")
        found = re.search(
            r"tensor 't(\d{4})': NO_AVAILABLE_HANDLE \(-200\) in put_from \[key=\S+/~pack/r0-"
            r"float32-(\d+), a pack of (\d+) tensors\]",
            str(failed.value),
        )
        assert found, str(failed.value)
        first, pack, count = map(int, found.groups())
        assert count == DEFAULT_PACK_BYTES // (256 << 10) and first == pack * count  # its first
        assert active_generation(store, model).generation == 1
        keys = payload_keys(group_id(model, 2), names)
        assert store.exists(keys) == [False] * len(keys)


@pytest.mark.parametrize(
    "tensors,message",
    [
        ([], "empty model"),
        ([("a", torch.ones(2)), ("a", torch.ones(2))], "duplicate tensor name 'a'"),
    ],
)
def test_bad_generations_are_not_announced(settings: Settings, tensors: list, message: str) -> None:
    model = f"bad-{abs(hash(message)) % 1000}"
    with StoreClient(settings) as store:
        with pytest.raises(PublishFailed, match=message):
            publish_local(store, model, tensors)
        assert active_generation(store, model) is None


def test_ranks_with_different_tensor_sets_are_refused(master: EmbeddedMaster, holders) -> None:
    model = "mismatch"
    rank0, _ = publish_two_nodes(master, holders, model, 1, seed=(5, 6))
    assert "rank 1 iterated a different tensor set than rank 0" in rank0["error"]
    with StoreClient(settings_for(master)) as store:
        assert active_generation(store, model) is None


def test_stale_announces_are_fenced_and_name_the_winner(settings: Settings) -> None:
    """An attempt that claimed an older number than the active generation loses: the error
    names the winner, the active record is unchanged and the loser's objects are gone."""
    model = "fenced"
    with StoreClient(settings) as store:
        late, attempt = start_attempt(store, model)  # claims 1, publishes after 2 and 3
        publish_local(store, model, [("w", torch.ones(4))])
        publish_local(store, model, [("w", torch.ones(4) * 2)])
        registry = GenerationRegistry(store, model)
        assert registry.active().generation == 3
        publisher = GenerationPublisher(
            store, model, late, 0, TrainerTopology.single(), attempt=attempt
        )
        with pytest.raises(PublishFailed, match=r"lost to generation 3 \(active: 3, fence 2\)"):
            finalize_generation(publisher, publisher.publish([("w", torch.ones(4) * 9)]))
        assert registry.active().generation == 3 and registry.active().fence == 2
        assert not any(store.exists(payload_keys(group_id(model, late), ["w"])))
        with pytest.raises(FenceError, match="belongs to publish attempt"):
            registry.announce(registry.load_manifest(3), ChecksumTable(), "someone-else")


def watch_active(settings: Settings, model: str, last: int, timeout_s: float, ready) -> dict:
    """Reader loop: whenever a generation is active, its manifest and payloads are complete.

    Says ``ready`` after its first complete check, so the writer publishes only while it
    watches; runs until generation ``last`` has been seen (or the timeout).
    """
    seen: list[int] = []
    checks = 0
    with StoreClient(settings) as store:
        registry = GenerationRegistry(store, model)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (not seen or seen[-1] != last):
            record = registry.active()
            if record is None:
                continue
            manifest = registry.load_manifest(record.generation, record.manifest_digest)
            objects = object_extents(manifest)
            assert all(store.exists(list(objects))), (
                f"generation {record.generation} active before its payloads"
            )
            for key, stored in objects.items():
                assert store.size(key) == stored.nbytes
            checks += 1
            if not seen or seen[-1] != record.generation:
                seen.append(record.generation)
            if checks == 1:
                ready.put("watching")
    return {"seen": seen, "checks": checks}


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        ("remove", "cannot announce: 1 payload problem(s), first: missing mooncake-rl/torn/"),
        ("resize", "payload/b holds 6 bytes, expected 8"),
    ],
)
def test_announce_refuses_missing_or_resized_payloads(
    settings: Settings, tamper: str, message: str
) -> None:
    model = "torn"
    with StoreClient(settings) as store:
        generation, attempt = start_attempt(store, model)
        publisher = GenerationPublisher(
            store, model, generation, 0, TrainerTopology.single(), attempt=attempt, pack_bytes=4
        )
        report = publisher.publish([("a", torch.ones(4)), ("b", torch.ones(4))])
        key = payload_key(group_id(model, 1), "b")  # its own object: the pre-packing layout
        store.remove([key], force=True)
        if tamper == "resize":
            store.put_bytes(key, b"\x00" * 6)
        manifest = build_manifest(model, 1, publisher.specs, "2026-11-30T00:00:00+00:00")
        registry = GenerationRegistry(store, model)
        with pytest.raises(InvariantViolation, match=re.escape(message)):
            registry.announce(manifest, ChecksumTable(dict(report.checksums)), attempt)
        assert registry.active() is None
        store.remove_prefix(group_id(model, 1) + "/", force=True)


def test_concurrent_reader_never_sees_a_partial_generation(master: EmbeddedMaster) -> None:
    model = "atomic"
    with StoreClient(settings_for(master, "writer")) as store:
        publish_local(store, model, model_tensors(7, count=20))
        with ProcessGroup() as group:
            ready = group.queue()
            group.start(watch_active, settings_for(master, "reader"), model, 4, 120.0, ready)
            assert ready.get(timeout=120) == "watching"
            for seed in (8, 9, 10):
                publish_local(store, model, model_tensors(seed, count=20))
                time.sleep(1.0)
            watched = group.results()[0]
    assert watched["seen"] == sorted(watched["seen"])
    assert watched["seen"][0] == 1 and watched["seen"][-1] == 4
    assert watched["checks"] > 10


def test_gc_removes_the_routing_tables_only_collected_generations_had(
    settings: Settings,
) -> None:
    model = "gc-tables"
    with StoreClient(settings) as store:
        lengths = {1: 8, 2: 16, 3: 16}  # generation 1 has a layout of its own
        for generation, length in lengths.items():
            weights = [("w", torch.full((length,), float(generation)))]
            publish_local(store, model, weights, keep=None)
        registry = GenerationRegistry(store, model)
        layouts = {g: layout_digest(registry.load_manifest(g)) for g in lengths}
        assert layouts[1] != layouts[2] == layouts[3]
        # A table planned from each layout, as the planner keeps them (plan.stored).
        tables = [routing_table_key(layouts[g], f"{g:064x}") for g in (1, 3)]
        legacy = f"mooncake-rl/_plans/{'ab' * 32}"  # a table as releases before issue 51 kept it
        for key in [*tables, legacy]:
            store.upsert_bytes(key, b"table")
        time.sleep(5.5)  # past Mooncake's read lease on the freshly written objects
        report = collect_garbage(store, model, keep=1, grace_s=0)
        assert report.deleted == (1, 2) and report.removed_tables == 2, report
        assert store.exists([*tables, legacy]) == [False, True, False]  # the active one's stays


def test_gc_keeps_newest_active_and_leased(settings: Settings) -> None:
    model = "gc"
    with StoreClient(settings) as store:
        for value in range(1, 6):
            publish_local(store, model, [("w", torch.full((8,), float(value)))], keep=None)
        leases = lease_book(store, model)
        leases.renew("engine-old", 1, ttl_s=60)
        leases.renew("engine-expired", 2, ttl_s=-1)
        # Within the grace period nothing retired goes: a reader may be taking its lease.
        assert collect_garbage(store, model, keep=2, grace_s=3600).deleted == ()
        time.sleep(5.5)  # past Mooncake's read lease on the freshly written objects
        report = collect_garbage(store, model, keep=2, grace_s=0)
        assert report.deleted == (2, 3) and report.kept == (1, 4, 5) and not report.failures
        registry = GenerationRegistry(store, model)
        assert [g.generation for g in registry.generations()] == [1, 4, 5]
        assert not any(store.exists(payload_keys(group_id(model, 2), ["w"])))
        assert store.exists([payload_key(group_id(model, 1), pack_name(0, "bfloat16", 0))])[0]
        leases.release("engine-old")
        # The exists() check above took Mooncake's read lease on generation 1's payload: a
        # non-forced removal refuses it (OBJECT_HAS_LEASE) and the generation stays listed.
        refused = collect_garbage(store, model, keep=2, grace_s=0)
        assert refused.deleted == () and list(refused.failures.values()) == [-706]
        assert [g.generation for g in registry.generations()] == [1, 4, 5]
        time.sleep(5.5)
        again = collect_garbage(store, model, keep=2, grace_s=0)
        assert again.deleted == (1,), again
        assert registry.active().generation == 5
