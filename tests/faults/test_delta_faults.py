"""Delta generations that lose their base, hold a corrupted entry, or lose their publisher,
against a real master and segment holders (issue 52). Each fault is caused: the holder of
the base stopped, an entry's bytes replaced, the publishing process killed mid-delta. The
end state is asserted: nothing serves a wrong byte, every failure names its cause, and the
next publish starts a readable chain.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch

from mooncake_rl.apply.delta import delta_reads, fetch
from mooncake_rl.coordinator.delta import BoxRow
from mooncake_rl.errors import MooncakeRLError, ObjectNotFound
from mooncake_rl.generations import GenerationRegistry
from mooncake_rl.generations.chain import (
    CorruptDelta,
    DeltaPolicy,
    delta_key,
    load_delta_table,
    realize_generation,
)
from mooncake_rl.generations.commands import generation_status, verify_generation
from mooncake_rl.generations.publisher import LastPublished, publish_local
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from tests.faults.test_master_and_holder_loss import Services
from tests.procs import CTX

pytestmark = pytest.mark.faults
POLICY = DeltaPolicy(every=8)


def weights(step: int) -> dict[str, torch.Tensor]:
    """Step ``step`` of a policy: 1 % of the elements moved per step."""
    base = {
        "embed.weight": torch.arange(64 * 1024, dtype=torch.float32).view(256, 256),
        "norm.weight": torch.ones(256),
    }
    for s in range(1, step + 1):
        for tensor in base.values():
            tensor.view(-1)[s::100] += 1.0
    return base


def read_back(store: StoreClient, model: str) -> dict[str, bytes]:
    _, tensors = active_weights(store, model)
    return {n: t.contiguous().numpy().tobytes() for n, t in tensors}


def expected(step: int) -> dict[str, bytes]:
    return {n: t.numpy().tobytes() for n, t in weights(step).items()}


def test_a_delta_whose_base_is_gone_is_refused_and_the_next_publish_is_a_keyframe(
    services: Services,
) -> None:
    """The keyframe sits only in holder A, which stops: the delta after it (holder B)
    cannot be read, rebuilt or verified, each naming a missing object of the keyframe; the
    next publish under the delta policy starts a new chain instead of extending it."""
    model = "delta-base-gone"
    a = services.holder("node-a")
    with StoreClient(services.client("node-a")) as store:
        keyframe = publish_local(store, model, weights(0).items(), dtype="float32", delta=POLICY)
        keys = sorted(
            {f.object_key for f in GenerationRegistry(store, model).load_manifest(1).fragments}
        )
    with StoreClient(services.client("node-b")) as store:
        delta = publish_local(store, model, weights(1).items(), dtype="float32", delta=POLICY)
        assert (keyframe.base, delta.base) == (None, keyframe.generation)
        assert read_back(store, model) == expected(1)
        a.stop()
        deadline = time.monotonic() + 30
        while any(store.exists(keys)):  # the master drops the stopped holder's segment
            assert time.monotonic() < deadline, "objects of a stopped holder still listed"
            time.sleep(0.2)
        report = verify_generation(store, model)
        assert not report["ok"] and report["chain"] == [1, 2]
        assert any(
            f"missing {k}" in p or "generation 1, the chain's base" in p
            for k in keys
            for p in report["problems"]
        ), report
        rows = {r["generation"]: r for r in generation_status(store, model)["generations"]}
        assert rows[2]["readable"] is False
        registry = GenerationRegistry(store, model)
        checksums = registry.load_checksums(2, delta.checksums_digest)
        with pytest.raises(ObjectNotFound, match="g000000000001"):
            realize_generation(store, model, 2, checksums)
        _, tensors = active_weights(store, model)
        with pytest.raises(MooncakeRLError):
            list(tensors)
        fresh = publish_local(store, model, weights(2).items(), dtype="float32", delta=POLICY)
        assert fresh.base is None  # a keyframe: a delta of an unreadable chain would be too
        assert read_back(store, model) == expected(2)
        assert verify_generation(store, model)["ok"]


def test_a_corrupted_delta_entry_is_refused_by_every_reader(services: Services) -> None:
    """An entry's bytes replaced in the Store: verify names it; rebuilding the generation,
    loading it and an engine fetching it in place all refuse it, naming the object; a
    keyframe published next serves again."""
    model = "delta-corrupt-entry"
    with StoreClient(services.client("node-a")) as store:
        publish_local(store, model, weights(0).items(), dtype="float32", delta=POLICY)
        record = publish_local(store, model, weights(1).items(), dtype="float32", delta=POLICY)
        table = load_delta_table(store, model, record.generation)
        assert table is not None
        key = max(table.objects, key=lambda k: table.objects[k].delta_bytes)
        data = bytearray(store.get_bytes(delta_key(key)))
        data[len(data) // 2] ^= 0x10
        assert not store.remove([delta_key(key)], force=True)  # forced: despite read leases
        store.put_tensor(delta_key(key), torch.frombuffer(data, dtype=torch.uint8))

        report = verify_generation(store, model)
        assert not report["ok"] and any(key in p for p in report["problems"]), report
        registry = GenerationRegistry(store, model)
        checksums = registry.load_checksums(record.generation, record.checksums_digest)
        with pytest.raises(CorruptDelta, match=key):
            realize_generation(store, model, record.generation, checksums)
        with pytest.raises(CorruptDelta, match=key):
            read_back(store, model)
        manifest = registry.load_manifest(record.generation)
        boxes = [
            BoxRow(t.tensor_id, (0,) * len(t.global_shape), tuple(t.global_shape), t.tensor_id, 0)
            for t in manifest.tensors
        ]
        reads = delta_reads(manifest, checksums.objects, table, boxes, {b.region for b in boxes})
        with pytest.raises(CorruptDelta, match="does not match its published hash"):
            fetch(store, table, reads)
        fresh = publish_local(store, model, weights(2).items(), dtype="float32")
        assert fresh.base is None and read_back(store, model) == expected(2)


def publish_and_die(settings: Settings, model: str) -> None:
    """A publisher of a delta that dies after putting some of it (``os._exit``)."""

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for index, item in enumerate(weights(1).items()):
            if index == 1:
                os._exit(17)
            yield item

    with StoreClient(settings) as store:
        publish_local(store, model, tensors(), dtype="float32", delta=POLICY, pack_bytes=1 << 16)


def test_a_publisher_killed_mid_delta_leaves_the_previous_generation_active(
    services: Services,
) -> None:
    """The process dies after putting part of a delta: nothing is announced, readers keep
    the keyframe, and a new publisher (without the dead one's copy) announces the next delta
    against the keyframe, read back exactly."""
    model = "delta-killed"
    settings = services.client("node-a")
    with StoreClient(settings) as store:
        keyframe = publish_local(store, model, weights(0).items(), dtype="float32", delta=POLICY)
    process = CTX.Process(target=publish_and_die, args=(settings, model))
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 17
    with StoreClient(settings) as store:
        registry = GenerationRegistry(store, model)
        active = registry.active()
        assert active is not None and active.generation == keyframe.generation
        assert registry.claim(2) is not None  # the dead attempt's number is never reused
        assert read_back(store, model) == expected(0)
        record = publish_local(
            store, model, weights(1).items(), dtype="float32", delta=POLICY, kept=LastPublished()
        )
        assert (record.generation, record.base) == (3, keyframe.generation)
        assert read_back(store, model) == expected(1)
        assert verify_generation(store, model)["ok"]
