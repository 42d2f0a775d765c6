"""Delta generations against a real master: publish a keyframe and deltas, read them back
through the chain, verify, realize, collect, and refuse what does not chain."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from mooncake_rl.apply.delta import DeltaUnavailable, check, delta_reads, fetch, scatter
from mooncake_rl.coordinator.delta import BoxRow
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations import GenerationRegistry, fp8, publisher
from mooncake_rl.generations.assignment import TrainerTopology
from mooncake_rl.generations.chain import (
    CorruptDelta,
    DeltaPolicy,
    chain_of,
    delta_key,
    entry_hash,
    load_delta_table,
    manifest_tensors,
    object_reader,
    realize_generation,
)
from mooncake_rl.generations.checksums import CorruptObject
from mooncake_rl.generations.commands import verify_generation
from mooncake_rl.generations.delta import HEADER, decode_changes
from mooncake_rl.generations.gc import collect_garbage
from mooncake_rl.generations.keys import (
    checksums_key,
    deltas_key,
    group_id,
    manifest_key,
    payload_prefix,
    report_key,
)
from mooncake_rl.generations.packing import is_pack_key, object_extents
from mooncake_rl.generations.publisher import (
    GenerationPublisher,
    LastPublished,
    PublishFailed,
    abort_generation,
    finalize_generation,
    publish_local,
    start_attempt,
)
from mooncake_rl.generations.records import ActiveRecord
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from tests.conftest import READ_LEASE_S, settings_for


@pytest.fixture(scope="module")
def store(master: EmbeddedMaster) -> Iterator[StoreClient]:
    """One client for the module: each client's close costs the native client a second."""
    with StoreClient(settings_for(master)) as client:
        yield client


def delta_attempt(store: StoreClient, model: str) -> GenerationPublisher:
    """A publisher of ``model``'s next generation as a delta against generation 1, by hand:
    what the announce then sees is the test's to shape."""
    generation, attempt = start_attempt(store, model)
    return GenerationPublisher(
        store,
        model,
        generation,
        0,
        TrainerTopology.single("node0"),
        attempt=attempt,
        pack_bytes=SMALL_PACKS,
        delta_base=(1, 1),
    )


def policy_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Large tensors stored alone and small ones that share packs, fp32 master weights."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (512, 256), "mlp.weight": (384, 256), "norm.weight": (256,)}
    shapes |= {f"layers.{i}.bias": (64 + i,) for i in range(6)}
    return {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}


def step(weights: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """One step of about ``lr`` per element: a few percent of bf16 elements change."""
    g = torch.Generator().manual_seed(seed)
    return {n: w + lr * torch.randn(w.shape, generator=g) for n, w in weights.items()}


def served(weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: w.to(torch.bfloat16).view(torch.int16).numpy().tobytes() for n, w in weights.items()}


def loaded(store: StoreClient, model: str) -> tuple[int, dict[str, bytes]]:
    record, tensors = active_weights(store, model)
    return record.generation, {
        n: t.contiguous().view(torch.int16).numpy().tobytes() for n, t in tensors
    }


SMALL_PACKS = 1 << 16  # the norm and biases share packs; embed and mlp are stored alone


def publish_chained(
    store: StoreClient,
    model: str,
    weights: dict[str, torch.Tensor],
    policy: DeltaPolicy,
    kept: LastPublished,
) -> ActiveRecord:
    """The next generation under ``policy``, no retention (the test collects itself)."""
    return publish_local(
        store, model, weights.items(), delta=policy, kept=kept, keep=None, pack_bytes=SMALL_PACKS
    )


def test_a_keyframe_and_two_deltas_read_back_exactly_and_cost_what_changed(
    store: StoreClient,
) -> None:
    model, policy, kept = "delta-chain", DeltaPolicy(every=3), LastPublished()
    steps = [policy_weights()]
    for i in range(3):
        steps.append(step(steps[-1], 1e-6, i))
    records = []
    for weights in steps:
        records.append(publish_chained(store, model, weights, policy, kept))
        assert loaded(store, model) == (records[-1].generation, served(weights))
    first, second, third, fourth = records
    assert first.lineage.is_delta is False
    assert (second.base, second.keyframe, second.chain_length) == (
        first.generation,
        first.generation,
        1,
    )
    assert (third.base, third.keyframe, third.chain_length) == (
        second.generation,
        first.generation,
        2,
    )
    assert fourth.base is None  # every=3: a keyframe after two deltas

    registry = GenerationRegistry(store, model)
    manifest = registry.load_manifest(third.generation)
    payloads = list(object_extents(manifest))
    assert len(payloads) >= 3 and all(size is None for size in store.complete_sizes(payloads))
    table = load_delta_table(store, model, third.generation)
    assert table is not None and set(table.objects) == set(payloads)
    assert third.chain_bytes == second.chain_bytes + table.delta_bytes
    assert table.delta_bytes < third.bytes / 10  # lr 1e-6 moves about 2 % of bf16 elements
    assert chain_of(store, model, third.generation).generations == (1, 2, 3)

    report = verify_generation(store, model, third.generation)
    assert report["ok"], report["problems"]
    assert report["chain"] == [1, 2, 3] and report["checked_bytes"] == third.bytes

    checksums = registry.load_checksums(third.generation, third.checksums_digest)
    put = realize_generation(store, model, third.generation, checksums)
    assert put == sum(o.nbytes for o in object_extents(manifest).values())
    assert realize_generation(store, model, third.generation, checksums) == 0
    assert chain_of(store, model, third.generation).generations == (3,)
    for key in payloads:
        checksums.objects[key].check(key, store.get_bytes(key))


def test_without_a_kept_copy_the_base_is_read_back_and_the_delta_is_the_same(
    store: StoreClient,
) -> None:
    policy = DeltaPolicy()
    first, second = policy_weights(1), step(policy_weights(1), 1e-4, 9)
    deltas = []
    for model, kept in (("delta-kept", LastPublished()), ("delta-read-back", None)):
        publish_local(store, model, first.items(), delta=policy, kept=kept, pack_bytes=SMALL_PACKS)
        record = publish_local(
            store, model, second.items(), delta=policy, kept=kept, pack_bytes=SMALL_PACKS
        )
        table = load_delta_table(store, model, record.generation)
        assert table is not None
        prefix = payload_prefix(group_id(model, record.generation))
        deltas.append({k.removeprefix(prefix): r for k, r in table.objects.items()})
        assert loaded(store, model) == (record.generation, served(second))
    assert deltas[0] == deltas[1]


def test_a_delta_against_a_base_that_is_not_the_newest_is_refused_naming_both(
    store: StoreClient,
) -> None:
    model = "delta-stale-base"
    for seed in range(2):
        publish_local(store, model, policy_weights(seed).items(), pack_bytes=SMALL_PACKS)
    writer = delta_attempt(store, model)
    report = writer.publish(policy_weights(2).items())
    with pytest.raises(InvariantViolation, match=r"delta against generation 1.*before it is 2"):
        finalize_generation(writer, report)
    assert GenerationRegistry(store, model).active().generation == 2  # type: ignore[union-attr]
    written = [delta_key(key) for key, _ in report.deltas]
    assert written and store.complete_sizes(written) == [None] * len(written)


def test_a_corrupted_delta_is_found_by_verify_and_refused_by_readers(store: StoreClient) -> None:
    model, policy = "delta-corrupt", DeltaPolicy()
    publish_local(store, model, policy_weights(3).items(), delta=policy, pack_bytes=SMALL_PACKS)
    record = publish_local(
        store,
        model,
        step(policy_weights(3), 1e-4, 4).items(),
        delta=policy,
        pack_bytes=SMALL_PACKS,
    )
    table = load_delta_table(store, model, record.generation)
    assert table is not None
    key = max(table.objects, key=lambda k: table.objects[k].delta_bytes)
    data = bytearray(store.get_bytes(delta_key(key)))
    data[-1] ^= 0x01
    assert not store.remove([delta_key(key)], force=True)  # forced: despite read leases
    store.put_tensor(delta_key(key), torch.frombuffer(data, dtype=torch.uint8))
    report = verify_generation(store, model)
    assert not report["ok"]
    assert report["problems"] == [
        f"corrupted delta: delta of {key} bytes {table.objects[key].spans()[-1][0]}.."
        f"{table.objects[key].nbytes} (tensor embed.weight) does not match its published hash: "
        "the Store holds corrupted bytes; publish a keyframe, or `mooncake-rl activate` a "
        "generation `mooncake-rl verify` passes"
    ]
    with pytest.raises(CorruptDelta, match=key):
        loaded(store, model)


def test_a_delta_table_declaring_a_change_outside_a_block_is_refused_at_announce(
    store: StoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The announce reads no entry, but refuses a row whose declared extent leaves its
    block, naming the object, the block and its tensor; it writes nothing, and the
    attempt's abort then removes the delta objects."""
    model, policy = "delta-extent-announce", DeltaPolicy()
    publish_local(store, model, policy_weights(11).items(), delta=policy, pack_bytes=SMALL_PACKS)
    writer = delta_attempt(store, model)
    report = writer.publish(step(policy_weights(11), 1e-6, 12).items())
    key = payload_prefix(writer.group) + "mlp.weight"  # stored alone: one 192 KiB block
    rows = dict(report.deltas)
    count, _ = rows[key].extents[0]
    rows[key] = replace(rows[key], extents=((count, 384 * 256),))  # one past its last element
    forged = replace(report, deltas=tuple(rows.items()))
    store.upsert_bytes(report_key(writer.group, 0), forged.encode())
    monkeypatch.setattr(publisher, "abort_generation", lambda *args: None)  # see what's left
    with pytest.raises(PublishFailed) as refused:
        finalize_generation(writer, forged)
    assert refused.type is PublishFailed
    assert (
        f"cannot announce: 1 payload problem(s), first: the delta table's block 0 of {key} "
        f"(bytes 0..{384 * 256 * 2}, tensor mlp.weight) declares a change at element "
        f"{384 * 256}, outside its {384 * 256} elements: the publisher wrote a malformed delta; "
        "republish this generation as a keyframe (a full generation)"
    ) in str(refused.value)
    registry = GenerationRegistry(store, model)
    assert registry.active().newest == 1  # type: ignore[union-attr]
    assert [g.generation for g in registry.generations()] == [1]
    group = writer.group
    assert (
        store.exists([manifest_key(group), checksums_key(group), deltas_key(group)]) == [False] * 3
    )
    abort_generation(store, model, writer.generation, writer.attempt)
    written = [delta_key(k) for k in rows]
    assert store.exists(written) == [False] * len(written)


def forge_past_declared(store: StoreClient, model: str, generation: int) -> tuple[str, int]:
    """Move the last change of a gaps16 entry (of a pack, where one has such an entry) one
    element on, within its block, and record the forged entry's hash in the delta table,
    its declared extent left as it was: (object, block)."""
    table = load_delta_table(store, model, generation)
    assert table is not None
    group = group_id(model, generation)
    for key in sorted(table.objects, key=lambda k: not is_pack_key(group, k)):
        row, blob = table.objects[key], bytearray(store.get_bytes(delta_key(key)))
        for block, (lo, hi) in enumerate(row.entries()):
            delta, positions = decode_changes(bytes(blob[lo:hi]))
            if (
                delta.encoding == "gaps16"
                and len(positions) > 0
                and positions[-1] + 1 < delta.numel
            ):
                gaps = np.frombuffer(blob, np.uint16, delta.changed, lo + HEADER.size)
                if gaps[-1] == np.iinfo(np.uint16).max:
                    continue
                gaps[-1] += 1
                hashes = list(row.hashes)
                hashes[block] = entry_hash(bytes(blob[lo:hi]))
                forged = replace(row, hashes=tuple(hashes))
                objects = {**table.objects, key: forged}
                store.upsert_bytes(deltas_key(group), replace(table, objects=objects).encode())
                assert not store.remove([delta_key(key)], force=True)
                store.put_tensor(delta_key(key), torch.frombuffer(blob, dtype=torch.uint8))
                return key, block
    raise AssertionError("no gaps16 entry to forge")


def test_an_entry_writing_past_its_declared_extent_is_refused_at_load_naming_its_tensor(
    store: StoreClient,
) -> None:
    """Well hashed, inside its block, but past what the table declared: every reader
    (the chain's object reader, realize, an engine's in-place fetch) refuses it, naming
    the object, the block and the tensor of the element past the declared extent."""
    model, policy = "delta-extent-load", DeltaPolicy()
    publish_local(store, model, policy_weights(13).items(), delta=policy, pack_bytes=SMALL_PACKS)
    new_weights = step(policy_weights(13), 1e-6, 14)
    record = publish_local(store, model, new_weights.items(), delta=policy, pack_bytes=SMALL_PACKS)
    key, block = forge_past_declared(store, model, record.generation)
    registry = GenerationRegistry(store, model)
    manifest = registry.load_manifest(record.generation)
    table = load_delta_table(store, model, record.generation)
    assert table is not None
    start, end = table.objects[key].spans()[block]
    count, last = table.objects[key].extents[block]
    assert len(manifest_tensors(manifest, key)(start, end)) > 1  # a pack
    at = start + (last + 1) * 2  # the element past the declared extent, in one tensor
    (tensor,) = manifest_tensors(manifest, key)(at, at + 2)
    refusal = (
        f"delta of {key} bytes {start}..{end} (tensor {tensor}): its entry writes {count} "
        f"2-byte elements up to element {last + 1}, the delta table declares {count} 2-byte "
        f"elements up to element {last}; the publisher wrote a malformed delta"
    )
    checksums = registry.load_checksums(record.generation, record.checksums_digest)
    boxes = [
        BoxRow(t.tensor_id, (0,) * len(t.global_shape), tuple(t.global_shape), t.tensor_id, 0)
        for t in manifest.tensors
    ]
    reads = delta_reads(manifest, checksums.objects, table, boxes, {b.region for b in boxes})
    for read in (
        lambda: object_reader(store, model, record.generation)(key),
        lambda: fetch(store, table, reads),
        lambda: realize_generation(store, model, record.generation, checksums),
    ):
        with pytest.raises(CorruptDelta) as refused:
            read()
        assert refused.type is CorruptDelta
        assert str(refused.value).startswith(refusal), str(refused.value)
    assert not store.exists([key])[0]  # never realized


def test_gc_keeps_the_chain_behind_the_active_generation(store: StoreClient) -> None:
    model, policy, kept = "delta-gc", DeltaPolicy(every=3), LastPublished()
    weights = policy_weights(5)
    for i in range(4):  # keyframe 1, deltas 2 and 3, keyframe 4
        publish_chained(store, model, weights, policy, kept)
        weights = step(weights, 1e-6, 20 + i)
        if i == 2:
            assert collect_garbage(store, model, keep=1, grace_s=0).deleted == ()
    time.sleep(READ_LEASE_S)
    report = collect_garbage(store, model, keep=1, grace_s=0)
    assert report.deleted == (1, 2, 3)
    for generation in (2, 3):
        assert load_delta_table(store, model, generation) is None
    assert verify_generation(store, model)["ok"]


def test_a_worker_at_the_base_takes_only_its_entries_and_lands_the_new_bytes_exactly(
    store: StoreClient,
) -> None:
    """Every tensor a region of its own (as a TP=1 engine holds them), filled with the
    base; the delta's entries scattered in; each region then checks against N."""
    model, policy = "delta-in-place", DeltaPolicy()
    base_weights = policy_weights(7)
    new_weights = step(base_weights, 1e-6, 8)
    publish_local(store, model, base_weights.items(), delta=policy, pack_bytes=SMALL_PACKS)
    _, base_bytes = loaded(store, model)
    record = publish_local(store, model, new_weights.items(), delta=policy, pack_bytes=SMALL_PACKS)
    registry = GenerationRegistry(store, model)
    manifest = registry.load_manifest(record.generation)
    checksums = registry.load_checksums(record.generation, record.checksums_digest).objects
    table = load_delta_table(store, model, record.generation)
    assert table is not None
    boxes = [
        BoxRow(t.tensor_id, (0,) * len(t.global_shape), tuple(t.global_shape), t.tensor_id, 0)
        for t in manifest.tensors
    ]
    regions = {
        name: torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for name, data in base_bytes.items()
    }
    with pytest.raises(DeltaUnavailable, match="processed after loading"):
        delta_reads(manifest, checksums, table, boxes, set(regions) - {"norm.weight"})
    reads = delta_reads(manifest, checksums, table, boxes, set(regions))
    changes = fetch(store, table, reads)
    assert changes.entry_bytes == table.delta_bytes  # every box here is a whole tensor
    assert 0 < changes.changed_bytes < record.bytes / 20
    assert scatter(changes, regions) == changes.changed_bytes
    assert check(reads, regions, checksums) == record.bytes
    assert {n: r.numpy().tobytes() for n, r in regions.items()} == served(new_weights)
    # A region that did not hold exactly the base (one byte off, one the delta leaves
    # alone): after the scatter it is not N, and the check names it: never served.
    drifted = {n: torch.frombuffer(bytearray(d), dtype=torch.uint8) for n, d in base_bytes.items()}
    name = next(n for n, r in drifted.items() if r.numel() > 64)
    untouched = next(  # a byte N shares with the base: the scatter leaves it
        i for i in range(drifted[name].numel()) if drifted[name][i] == regions[name][i]
    )
    drifted[name][untouched] ^= 0x01
    assert scatter(changes, drifted) == changes.changed_bytes
    with pytest.raises(CorruptObject, match=name):
        check(reads, drifted, checksums)
    # A row shard of a tensor stored alone is no checksummed unit: the full path.
    shard = BoxRow("embed.weight", (0, 0), (256, 256), "embed.weight", 0)
    with pytest.raises(DeltaUnavailable, match="no checksum covers alone"):
        delta_reads(manifest, checksums, table, [shard], set(regions))


def test_fp8_generations_delta_their_fp8_codes_and_their_scales(store: StoreClient) -> None:
    """Block fp8: the weight's fp8 codes and its float32 block scales are both stored, and
    both delta'd; what reads back is what quantizing the new weights gives."""
    model, policy = "delta-fp8", DeltaPolicy()
    name = "model.layers.0.mlp.up_proj.weight"
    first = {name: torch.randn(256, 384, generator=torch.Generator().manual_seed(1)) * 0.02}
    second = step(first, 1e-6, 2)
    publish_local(store, model, first.items(), dtype="fp8_e4m3", delta=policy)
    record = publish_local(store, model, second.items(), dtype="fp8_e4m3", delta=policy)
    assert record.base is not None and record.chain_bytes < record.bytes / 4
    _, tensors = active_weights(store, model)
    stored = {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in tensors}
    weight, scale = fp8.block_quantize(name, second[name])
    assert stored == {
        name: weight.contiguous().view(torch.uint8).numpy().tobytes(),
        f"{name[: -len('weight')]}weight_scale_inv": scale.contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes(),
    }
