"""Packed objects: the packer's layout, the manifest's checks, and packed generations end to
end on a real master (published, announced, loaded, verified, refused when malformed)."""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mooncake_rl.apply.coalesce import coalesced_reads, coalesced_writes
from mooncake_rl.engine import Write
from mooncake_rl.errors import ConfigurationError, InvariantViolation
from mooncake_rl.generations import TensorSpec, build_manifest
from mooncake_rl.generations.assignment import TrainerTopology
from mooncake_rl.generations.checksums import ChecksumTable
from mooncake_rl.generations.commands import verify_generation
from mooncake_rl.generations.keys import group_id, payload_key
from mooncake_rl.generations.packing import (
    DEFAULT_PACK_BYTES,
    MAX_PACK_BYTES,
    PACK_PREFIX,
    Packer,
    Placement,
    check_pack_bytes,
    checksum_sizes,
    is_packed,
    object_extents,
    pack_layout,
    pack_name,
)
from mooncake_rl.generations.publisher import (
    GenerationPublisher,
    publish_local,
    start_attempt,
)
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import RangeRead, StoreClient
from tests.conftest import fragment_bytes, settings_for

DTYPES = ("bfloat16", "float32", "float8_e4m3fn")
rows = st.lists(
    st.tuples(st.integers(1, 4096), st.sampled_from(DTYPES), st.integers(0, 2)),
    min_size=1,
    max_size=60,
)


@given(rows, st.integers(64, 16384))
def test_packer_fills_one_dtype_per_pack_back_to_back_and_reports_each_pack_once(
    entries: list[tuple[int, str, int]], pack_bytes: int
) -> None:
    specs = [(f"t{i}", n, dtype, rank) for i, (n, dtype, rank) in enumerate(entries)]
    packers: dict[int, Packer] = {}
    held: dict[str, list[tuple[int, int, str]]] = {}  # pack -> (offset, bytes, dtype)
    closed: dict[str, int] = {}
    for _, nbytes, dtype, rank in specs:
        if not is_packed(nbytes, pack_bytes):
            continue
        placement, full = packers.setdefault(rank, Packer(rank, pack_bytes)).place(nbytes, dtype)
        if full is not None:
            assert full[0] not in closed
            closed[full[0]] = full[1]
        held.setdefault(placement.object_name, []).append((placement.offset, nbytes, dtype))
    for packer in packers.values():
        for name, size, dtype in packer.open_packs():
            assert name not in closed and name.endswith(f"-{dtype}-" + name.rsplit("-", 1)[1])
            closed[name] = size
    assert set(closed) == set(held)
    for pack, members in held.items():
        assert pack.startswith(PACK_PREFIX) and len({d for _, _, d in members}) == 1
        end = 0
        for offset, nbytes, _ in members:  # in publish order: back to back, no gap
            assert offset == end
            end += nbytes
        assert end == closed[pack] <= pack_bytes
    # The simulator's layout is the publishers' layout.
    assert pack_layout(specs, pack_bytes) == {
        name: (placement,) for name, placement in _replayed(specs, pack_bytes).items()
    }


def _replayed(specs, pack_bytes: int) -> dict[str, Placement]:
    packers: dict[int, Packer] = {}
    return {
        name: packers.setdefault(rank, Packer(rank, pack_bytes)).place(nbytes, dtype)[0]
        for name, nbytes, dtype, rank in specs
        if is_packed(nbytes, pack_bytes)
    }


@pytest.mark.parametrize("bad", [0, -1, MAX_PACK_BYTES + 1, 1.5, "128MiB", None])
def test_bad_pack_size_is_refused_naming_the_setting(bad: object) -> None:
    with pytest.raises(InvariantViolation, match=r"pack_bytes \(--pack-bytes, bridge key"):
        check_pack_bytes(bad)


def test_bridge_config_refuses_a_bad_pack_size() -> None:
    from verl_bridge.config import BridgeConfig

    with pytest.raises(ConfigurationError, match="pack_bytes"):
        BridgeConfig.from_kwargs({"model": "m", "pack_bytes": 0})
    assert BridgeConfig.from_kwargs({"model": "m"}).pack_bytes == DEFAULT_PACK_BYTES


def test_tensor_names_cannot_take_the_pack_prefix() -> None:
    with pytest.raises(InvariantViolation, match="names packed objects"):
        TensorSpec(f"{PACK_PREFIX}x", (2,), "float32")


def _manifest(placements: dict[str, tuple[Placement, ...]], sizes: dict[str, int]):
    specs = [TensorSpec(name, (n // 4,), "float32") for name, n in sizes.items()]
    return build_manifest("m", 1, specs, "2026-12-05T00:00:00+00:00", placements)


def test_overlapping_packed_entries_are_refused_naming_the_tensor() -> None:
    pack = pack_name(0, "float32", 0)
    with pytest.raises(InvariantViolation, match=r"object ranges overlap: a and b in \S+~pack"):
        _manifest({"a": (Placement(pack, 0),), "b": (Placement(pack, 12),)}, {"a": 16, "b": 16})


def test_an_entry_past_its_object_is_refused_naming_the_tensor() -> None:
    pack = pack_name(0, "float32", 0)
    manifest = _manifest(
        {"a": (Placement(pack, 0),), "b": (Placement(pack, 16),)}, {"a": 16, "b": 16}
    )
    key = payload_key(group_id("m", 1), pack)
    assert object_extents(manifest)[key].nbytes == 32
    with pytest.raises(InvariantViolation, match=r"tensor 'b' runs past the end of object"):
        object_extents(manifest, {key: 24})
    # The checksum table must cover the pack and each packed tensor on its own.
    assert checksum_sizes(manifest) == {
        key: 32,
        payload_key(group_id("m", 1), "a"): 16,
        payload_key(group_id("m", 1), "b"): 16,
    }


ranges = st.lists(
    st.tuples(st.sampled_from("ab"), st.integers(0, 64), st.integers(0, 64), st.integers(1, 8)),
    max_size=40,
)


def _moves(pieces) -> list[tuple]:
    """Every (source, source byte, destination byte) a set of ranges moves, with repeats."""
    return sorted(
        (key, src + i, dst + i) for key, src, dst, length in pieces for i in range(length)
    )


@given(ranges)
def test_coalescing_moves_exactly_the_same_bytes_in_fewer_ranges(pieces) -> None:
    reads = [RangeRead(k, s, d, n) for k, s, d, n in pieces]
    merged = coalesced_reads(reads)
    assert _moves((r.key, r.src_offset, r.dst_offset, r.length) for r in merged) == _moves(pieces)
    assert len(merged) <= len(reads)
    writes = [Write(1000 + s, 5000 + d, n) for _, s, d, n in pieces]
    joined = coalesced_writes(writes)
    assert _moves(("", w.src, w.dst, w.length) for w in joined) == _moves(
        ("", w.src, w.dst, w.length) for w in writes
    )
    # Nothing adjacent on both sides is left unmerged.
    for left, right in itertools.pairwise(merged):
        assert not (
            left.key == right.key
            and left.src_offset + left.length == right.src_offset
            and left.dst_offset + left.length == right.dst_offset
        )


def test_adjacent_ranges_merge_into_one_and_gapped_ones_do_not() -> None:
    reads = [RangeRead("k", 8, 108, 8), RangeRead("k", 0, 100, 8), RangeRead("k", 20, 116, 4)]
    assert coalesced_reads(reads) == [RangeRead("k", 0, 100, 16), RangeRead("k", 20, 116, 4)]


def _model() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    shapes = {"big": (1100, 1024), "small.0": (7, 9), "small.1": (64,), "small.2": (3, 3)}
    return [(n, torch.randn(s, generator=generator)) for n, s in shapes.items()]


@pytest.fixture(scope="module")
def store(master: EmbeddedMaster):
    with StoreClient(settings_for(master, "packing")) as client:
        yield client


def test_a_packed_generation_loads_verifies_and_names_a_corrupted_pack(store) -> None:
    model, tensors = "packed", _model()
    publish_local(store, model, tensors, dtype="float32", pack_bytes=1 << 20, keep=None)
    manifest = GenerationRegistry(store, model).load_active_manifest()
    objects = object_extents(manifest)
    pack = payload_key(group_id(model, 1), pack_name(0, "float32", 0))
    # "big" (4.3 MiB > 1 MiB / 4) stays alone; the three small ones share one pack.
    assert sorted(objects) == sorted([payload_key(group_id(model, 1), "big"), pack])
    assert [f.tensor_id for f in objects[pack].fragments] == ["small.0", "small.1", "small.2"]
    expected = {name: t.numpy().tobytes() for name, t in tensors}
    assert {f.tensor_id: fragment_bytes(store, f) for f in manifest.fragments} == expected
    _, loaded = active_weights(store, model)
    assert {name: t.numpy().tobytes() for name, t in loaded} == expected
    report = verify_generation(store, model)
    assert report["ok"] and report["objects"] == 2 and report["tensors"] == 4

    size = store.size(pack)
    assert not store.remove([pack], force=True)
    store.put_bytes(pack, np.random.default_rng(3).bytes(size))
    assert verify_generation(store, model)["problems"] == [
        f"corrupted {pack}: its bytes differ from the published checksum"
    ]
    _, loaded = active_weights(store, model)
    with pytest.raises(Exception, match=re.escape(f"object {pack} does not match")):
        dict(loaded)


def test_a_generation_published_before_packing_still_loads(store) -> None:
    """Packing off (every tensor over a quarter of the pack) is exactly the old layout: one
    object per tensor at offset 0, a checksum per object."""
    model, tensors = "unpacked", _model()
    publish_local(store, model, tensors, dtype="float32", pack_bytes=4, keep=None)
    manifest = GenerationRegistry(store, model).load_active_manifest()
    group = group_id(model, 1)
    assert [(f.object_key, f.object_offset) for f in manifest.fragments] == [
        (payload_key(group, name), 0) for name, _ in tensors
    ]
    _, loaded = active_weights(store, model)
    assert {n: t.numpy().tobytes() for n, t in loaded} == {
        n: t.numpy().tobytes() for n, t in tensors
    }


def test_announce_refuses_packed_entries_past_their_pack_and_changes_nothing(store) -> None:
    model = "overlap"
    generation, attempt = start_attempt(store, model)
    publisher = GenerationPublisher(
        store, model, generation, 0, TrainerTopology.single(), "float32", attempt=attempt
    )
    report = publisher.publish([("a", torch.ones(4)), ("b", torch.ones(4) * 2)])
    placed = {name: Placement(obj, offset) for name, obj, offset, _ in report.placements}
    placed["b"] = dataclasses.replace(placed["b"], offset=24)  # past the pack's 32 bytes
    manifest = build_manifest(model, 1, publisher.specs, "2026-12-05T00:00:00+00:00", _one(placed))
    registry = GenerationRegistry(store, model)
    with pytest.raises(InvariantViolation, match="tensor 'b' runs past the end of object"):
        registry.announce(manifest, ChecksumTable(dict(report.checksums)), attempt)
    assert registry.active() is None
    placed["b"] = dataclasses.replace(placed["b"], offset=8)  # into a's last 8 bytes
    with pytest.raises(InvariantViolation, match="object ranges overlap: a and b"):
        build_manifest(model, 1, publisher.specs, "2026-12-05T00:00:00+00:00", _one(placed))


def _one(placed: dict[str, Placement]) -> dict[str, tuple[Placement, ...]]:
    return {name: (placement,) for name, placement in placed.items()}


def test_pack_size_is_refused_before_anything_is_claimed(store) -> None:
    with pytest.raises(InvariantViolation, match="pack_bytes"):
        publish_local(store, "refused-pack", [("w", torch.ones(4))], pack_bytes=0)
    assert GenerationRegistry(store, "refused-pack").claim(1) is None
