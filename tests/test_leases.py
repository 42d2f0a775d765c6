"""Serving leases against a real master: lease before read, GC's grace, racing renewals,
and retention under churn while a reader holds an old generation (the soak's fast smoke;
the full soak is ``tests/faults/test_soak.py``)."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass

import pytest
import torch

from engine_ext.leases import ENGINE_ID_ENV, LeaseNotTaken, lease_active, loader_engine_id
from engine_ext.loading import store_weights
from mooncake_rl.counters import COUNTERS
from mooncake_rl.generations.gc import collect_garbage
from mooncake_rl.generations.keys import group_id, manifest_key
from mooncake_rl.generations.leases import lease_book
from mooncake_rl.generations.packing import object_extents
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import FENCES_KEPT, GenerationRegistry
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from tests.conftest import READ_LEASE_S, fragment_bytes, settings_for
from tests.procs import ProcessGroup
from verl_bridge.publish import Collective, TrainerSync


def weights(value: float, count: int = 4, size: int = 64) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((size,), value + i)) for i in range(count)]


def listed(store: StoreClient, model: str) -> list[int]:
    return [g.generation for g in GenerationRegistry(store, model).generations()]


@pytest.fixture
def store_env(master: EmbeddedMaster, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The environment an engine's loader reads its Settings from."""
    settings = settings_for(master, segment_bytes=0, lease_ttl_s=30.0, retire_grace_s=2.0)
    for name, value in {
        "MOONCAKE_RL_MASTER": settings.master,
        "MOONCAKE_RL_METADATA": settings.metadata,
        "MOONCAKE_RL_NODE": settings.node,
        "MOONCAKE_RL_LEASE_TTL_S": "30",
        "MOONCAKE_RL_RETIRE_GRACE_S": "2",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(ENGINE_ID_ENV, raising=False)
    return settings


# -- engine identity ---------------------------------------------------------------------


def test_loader_engine_id_matches_the_serving_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_ID_ENV, raising=False)
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port=8123"]
    assert loader_engine_id(argv) == "127.0.0.1:8123"
    assert loader_engine_id(["x", "--host", "10.0.0.5", "--port", "9000"]) == "10.0.0.5:9000"
    assert loader_engine_id(["pytest"]).startswith("loader-")
    monkeypatch.setenv(ENGINE_ID_ENV, "rollout-7")
    assert loader_engine_id(argv) == "rollout-7"


# -- the reader protocol -----------------------------------------------------------------


def test_loader_leases_before_reading_and_keeps_the_lease(
    store_env: Settings, settings: Settings
) -> None:
    model = "lease-reader"
    with StoreClient(settings) as store:
        publish_local(store, model, weights(1.0), keep=None)
        book = lease_book(store, model)
        with store_weights(model, engine_id="engine-a") as (record, tensors):
            # The manifest is read, no payload yet: the lease is already there.
            lease = book.leases()["engine-a"]
            assert lease.generation == record.generation == 1
            assert lease.expires_at > time.time() + 20
            # Newer generations, and retention with no grace: the leased one stays.
            for value in (2.0, 3.0, 4.0):
                publish_local(store, model, weights(value), keep=None)
            time.sleep(READ_LEASE_S)
            report = collect_garbage(store, model, keep=1, grace_s=0)
            assert 1 in report.kept and report.deleted == (2, 3)
            got = dict(tensors)
        assert torch.equal(got["w0"].float(), torch.full((64,), 1.0))
        # After the load the lease is held through engine startup (several TTLs).
        assert book.leases()["engine-a"].expires_at > time.time() + 60
        book.release("engine-a")
        time.sleep(READ_LEASE_S)
        assert collect_garbage(store, model, keep=1, grace_s=0).deleted == (1,)


def test_a_slow_lease_is_retried_then_refused(store_env: Settings, settings: Settings) -> None:
    """More than the grace between reading the active record and writing the lease: the
    reader re-reads the active record (GC may have judged it removable meanwhile)."""
    model = "lease-slow"
    grace = Settings().retire_grace_s
    with StoreClient(settings) as store:
        publish_local(store, model, weights(1.0), keep=None)
        ticks = iter([0.0, grace + 1.0, 100.0, 100.1])  # first try slow, second fast
        record, lease = lease_active(
            store, model, "engine-s", Settings(), clock=lambda: next(ticks)
        )
        assert record.generation == lease.generation == 1
        slow = iter(float(i) * (grace + 1.0) for i in range(100))
        with pytest.raises(LeaseNotTaken, match="within retire_grace_s"):
            lease_active(store, model, "engine-s", Settings(), clock=lambda: next(slow))


def test_gc_spares_leased_and_recently_retired_generations(settings: Settings) -> None:
    model = "lease-grace"
    with StoreClient(settings) as store:
        for value in range(1, 6):
            publish_local(store, model, weights(float(value)), keep=None)
        lease_book(store, model).renew("engine-old", 2, ttl_s=60)
        time.sleep(READ_LEASE_S)
        # Everything retired moments ago stays while the grace lasts.
        assert collect_garbage(store, model, keep=1, grace_s=3600).deleted == ()
        assert listed(store, model) == [1, 2, 3, 4, 5]
        # Run again, nothing changes: no write (each is a never-pruned etcd log entry).
        before = COUNTERS.snapshot()
        assert collect_garbage(store, model, keep=1, grace_s=3600).deleted == ()
        assert (COUNTERS.snapshot() - before).store_put_bytes == 0, "unchanged index rewritten"
        report = collect_garbage(store, model, keep=1, grace_s=0)
        assert report.deleted == (1, 3, 4) and report.kept == (2, 5), report
        assert store.exists([manifest_key(group_id(model, 2))])[0]
        lease_book(store, model).release("engine-old")


def test_racing_renewals_keep_both_engines_listed(settings: Settings) -> None:
    """Two engines register and renew at once, each over its own client: GC sees both."""
    model = f"lease-race-{uuid.uuid4().hex[:6]}"
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def engine(name: str, generation: int) -> None:
        try:
            with StoreClient(settings.with_overrides(segment_bytes=0)) as client:
                book = lease_book(client, model)
                barrier.wait()
                for _ in range(10):
                    book.renew(name, generation, ttl_s=60)
                    # Every renewal returns with the lease visible to GC.
                    assert name in lease_book(client, model).leases()
        except BaseException as error:  # reported to the test thread
            errors.append(error)

    with StoreClient(settings) as store:  # lends the segment the records live in
        for value in range(1, 5):
            publish_local(store, model, weights(float(value)), keep=None)
        threads = [threading.Thread(target=engine, args=a) for a in (("e1", 1), ("e2", 2))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        book = lease_book(store, model)
        assert {n: lease.generation for n, lease in book.leases().items()} == {"e1": 1, "e2": 2}
        time.sleep(READ_LEASE_S)
        report = collect_garbage(store, model, keep=1, grace_s=0)
        assert report.kept == (1, 2, 4) and report.deleted == (3,), report
        book.release("e1")
        book.release("e2")


# -- retention under churn (shared with the soak) ----------------------------------------


def master_metrics(master: EmbeddedMaster) -> dict[str, float]:
    """``master_key_count`` and ``master_allocated_bytes`` from the master's HTTP metrics."""
    url = f"http://{master.config.host}:{master.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    found = re.findall(r"^(master_key_count|master_allocated_bytes) (\S+)$", text, re.M)
    return {name: float(value) for name, value in found}


def footprint(store: StoreClient, model: str) -> tuple[int, int]:
    """Payload objects and bytes of every listed generation (from the manifests)."""
    registry = GenerationRegistry(store, model)
    objects = nbytes = 0
    for info in registry.generations():
        manifest = registry.load_manifest(info.generation)
        objects += len(object_extents(manifest))
        nbytes += sum(f.nbytes for f in manifest.fragments)
    return objects, nbytes


def hold_and_read(env: dict[str, str], model: str, stop: object, out: object) -> dict[str, int]:
    """Reader process: lease the active generation (lease before read), then keep renewing
    the lease and reading every tensor of that generation until told to stop."""
    os.environ.update(env)
    settings = Settings()
    reads = 0
    with store_weights(model, engine_id="soak-reader") as (record, tensors):
        expected = {name: tensor.clone() for name, tensor in tensors}
    with StoreClient(settings.with_overrides(segment_bytes=0)) as store:
        book = lease_book(store, model)
        registry = GenerationRegistry(store, model)
        manifest = registry.load_manifest(record.generation, record.manifest_digest)
        while stop.empty():  # type: ignore[attr-defined]
            book.renew("soak-reader", record.generation, settings.lease_ttl_s)
            for fragment in manifest.fragments:
                tensor = expected[fragment.tensor_id]
                expected_bytes = tensor.contiguous().view(torch.uint8).numpy().tobytes()
                assert fragment_bytes(store, fragment) == expected_bytes
            reads += 1
            if reads == 1:
                out.put(record.generation)  # type: ignore[attr-defined]
            time.sleep(0.02)
        book.release("soak-reader")
    return {"generation": record.generation, "reads": reads}


@dataclass
class ChurnReport:
    leased: int
    reads: int
    start: tuple[int, int]
    end: tuple[int, int]
    peak_generations: int
    metrics_start: dict[str, float]
    metrics_end: dict[str, float]
    syncs: int
    churn_s: float


def churn(
    master: EmbeddedMaster, node_segment: str, model: str, generations: int, pace_s: float
) -> ChurnReport:
    """Publish ``generations`` through the VeRL bridge's trainer sync (one rank, keep=2,
    0.5 s grace), one every ``pace_s`` at most, while a reader process holds a lease on
    generation 2 and keeps reading it. Asserts the leased generation stays listed throughout
    and the Store stays bounded: besides the kept, active and leased ones, only generations
    still under Mooncake's read lease (granted by the announce's completeness check) or
    the grace stay listed."""
    grace, keep = 0.5, 2
    bound = keep + 1 + int((READ_LEASE_S + grace) / pace_s) + 3
    settings = settings_for(
        master, segment_bytes=0, local_segment=node_segment, retire_grace_s=grace
    )
    env = {
        "MOONCAKE_RL_MASTER": settings.master,
        "MOONCAKE_RL_METADATA": settings.metadata,
        "MOONCAKE_RL_NODE": settings.node,
        "MOONCAKE_RL_RETIRE_GRACE_S": str(grace),
        "MOONCAKE_RL_LEASE_TTL_S": "3",
    }
    per_generation = sum(t.numel() * 2 for _, t in weights(0.0))  # bfloat16

    def sync(store: StoreClient, step: int) -> int:
        trainer = TrainerSync(
            store, model, "bfloat16", uuid.uuid4().hex, collective=Collective(), keep=keep
        )
        generation = trainer.begin()
        trainer.publish(iter(weights(float(step))))
        outcome = trainer.conclude()
        assert outcome.ok and outcome.generation == generation, outcome
        return generation

    with StoreClient(settings) as store, ProcessGroup() as group:
        sync(store, 1)
        per_generation_objects = len(
            object_extents(GenerationRegistry(store, model).load_manifest(1))
        )
        sync(store, 2)
        metrics_start = master_metrics(master)
        start = footprint(store, model)
        stop, out = group.queue(), group.queue()
        reader = group.start(hold_and_read, env, model, stop, out)
        leased = out.get(timeout=60)
        assert leased == 2
        peak, began = 0, time.monotonic()
        for step in range(3, generations + 1):
            due = time.monotonic() + pace_s
            generation = sync(store, step)
            present = listed(store, model)
            assert leased in present, f"leased generation {leased} gone after {generation}"
            peak = max(peak, len(present))
            assert len(present) <= bound, present
            time.sleep(max(0.0, due - time.monotonic()))
        churn_s = time.monotonic() - began
        stop.put(True)
        reads = group.results_of(reader, timeout_s=60)["reads"]
        # Once nothing is read for a while, one more sync leaves exactly what retention keeps.
        time.sleep(READ_LEASE_S)
        sync(store, generations + 1)
        final = listed(store, model)
        end = footprint(store, model)
        metrics_end = master_metrics(master)
    assert final == [generations, generations + 1], final
    assert end == (keep * per_generation_objects, keep * per_generation), end
    syncs = generations - 1  # made after metrics_start was read
    report = ChurnReport(
        leased, reads, start, end, peak, metrics_start, metrics_end, syncs, round(churn_s, 2)
    )
    # Keys: fence records stop growing at FENCES_KEPT; what remains per sync is the VeRL
    # bridge's outcome record (verl-sync/<id>, one small record per sync, never removed).
    growth = metrics_end["master_key_count"] - metrics_start["master_key_count"]
    assert growth <= syncs + FENCES_KEPT + 4, report
    return report


def test_retention_smoke_with_a_leased_reader(master: EmbeddedMaster, holders) -> None:
    """Ten generations with automatic retention while a reader holds generation 2."""
    started = time.monotonic()
    report = churn(master, holders("node-leases").segment, "lease-smoke", 10, pace_s=0.25)
    print(f"\nretention smoke: {report}")
    assert report.reads > 1
    assert time.monotonic() - started < 30
