"""Content checksums: the table (pure), ranged-read coverage (pure), and corruption caught by
every reader of a real Store: ``verify``, the engines' Store loader, and a planned apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rl.apply.process import WorkerCluster, run_planned_update
from mooncake_rl.apply.verify import Landed, verify_object
from mooncake_rl.apply.wire import WorkerSlice, decode_slice, encode_slice, with_checksums
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import specs_of
from mooncake_rl.generations.checksums import (
    BLOCK_BYTES,
    ChecksumTable,
    CorruptObject,
    ObjectChecksum,
)
from mooncake_rl.generations.commands import verify_generation
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.plan.update import RoutingCache, plan_update
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for, trainer_settings

BIG = np.random.default_rng(0).integers(0, 256, 2 * BLOCK_BYTES + 12345, dtype=np.uint8)
"""An object of three blocks, the last one short."""


# -- the table -------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=4096))
def test_small_object_round_trips_and_has_no_blocks(data: bytes) -> None:
    checksum = ObjectChecksum.of(data)
    assert checksum.nbytes == len(data) and checksum.blocks == ()
    table = ChecksumTable({"k": checksum})
    assert ChecksumTable.decode(table.encode()) == table
    checksum.check("k", data)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=512), st.data())
def test_any_single_byte_flip_is_detected(data: bytes, draw: st.DataObject) -> None:
    position = draw.draw(st.integers(0, len(data) - 1))
    flip = draw.draw(st.integers(1, 255))
    corrupted = bytearray(data)
    corrupted[position] ^= flip
    with pytest.raises(CorruptObject, match="object g/payload/x does not match"):
        ObjectChecksum.of(data).check("g/payload/x", bytes(corrupted))


def test_block_count_and_a_flip_in_every_block_of_a_large_object() -> None:
    checksum = ObjectChecksum.of(BIG)
    assert len(checksum.blocks) == 3 and checksum.nbytes == BIG.nbytes
    assert ChecksumTable.decode(ChecksumTable({"k": checksum}).encode()).objects["k"] == checksum
    for position in (0, BLOCK_BYTES, BIG.nbytes - 1):
        corrupted = BIG.copy()
        corrupted[position] ^= 0x40
        with pytest.raises(CorruptObject):
            checksum.check("k", corrupted.tobytes())
        assert ObjectChecksum.of(corrupted).blocks != checksum.blocks
    exactly_one_block = ObjectChecksum.of(BIG[:BLOCK_BYTES])
    assert exactly_one_block.blocks == ()


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.text("abc/", min_size=1, max_size=8), st.binary(min_size=1), min_size=1))
def test_table_digest_changes_with_any_entry(objects: dict[str, bytes]) -> None:
    table = ChecksumTable({k: ObjectChecksum.of(v) for k, v in objects.items()})
    digest = ChecksumTable.digest_of(table.encode())
    key = sorted(objects)[0]
    changed = ChecksumTable({**table.objects, key: ObjectChecksum.of(objects[key] + b"!")})
    assert ChecksumTable.digest_of(changed.encode()) != digest
    with pytest.raises(InvariantViolation):
        table.merged({key: ObjectChecksum.of(objects[key] + b"!")})


def test_malformed_table_is_refused() -> None:
    with pytest.raises(CorruptObject, match="not valid"):
        ChecksumTable.decode(b"{not json")
    with pytest.raises(InvariantViolation):
        ObjectChecksum(BLOCK_BYTES + 1, "0" * 32, ())


# -- ranged-read coverage (pure: pieces point at a host buffer) -------------------------------
def pieces(buffer: np.ndarray, spans: list[tuple[int, int]]) -> list[Landed]:
    """Each span ``[start, end)`` of the object landed at the same offset of ``buffer``."""
    base = buffer.ctypes.data
    return [Landed(s, e - s, base + s) for s, e in spans]


def test_whole_range_verifies_every_block() -> None:
    stats = verify_object("k", ObjectChecksum.of(BIG), pieces(BIG, [(0, BIG.nbytes)]))
    assert stats.verified_bytes == BIG.nbytes and stats.unverified_bytes == 0


def test_only_blocks_covered_entirely_are_checked() -> None:
    checksum = ObjectChecksum.of(BIG)
    corrupted = BIG.copy()
    corrupted[BLOCK_BYTES - 1] ^= 1  # in block 0, which the range covers only in part
    span = [(100, 2 * BLOCK_BYTES + 5)]  # covers block 1 entirely, blocks 0 and 2 in part
    stats = verify_object("k", checksum, pieces(corrupted, span))
    assert stats.verified_bytes == BLOCK_BYTES
    assert stats.unverified_bytes == 2 * BLOCK_BYTES + 5 - 100 - BLOCK_BYTES
    corrupted[BLOCK_BYTES + 7] ^= 1  # now in block 1
    with pytest.raises(CorruptObject, match=r"object k .*block 1, bytes \[4194304, 8388608\)"):
        verify_object("k", checksum, pieces(corrupted, span))


def test_strided_pieces_that_cover_a_block_together_are_checked() -> None:
    """A column shard reads a block as many rows; their union covers it, so it is checked."""
    checksum = ObjectChecksum.of(BIG)
    row = 4096
    spans = [(o, o + row) for o in range(0, 2 * BLOCK_BYTES, row)]
    shuffled = [spans[i] for i in np.random.default_rng(1).permutation(len(spans))]
    stats = verify_object("k", checksum, pieces(BIG, shuffled))
    assert stats.verified_bytes == 2 * BLOCK_BYTES
    corrupted = BIG.copy()
    corrupted[BLOCK_BYTES + 3 * row + 1] ^= 0xFF
    with pytest.raises(CorruptObject, match="block 1"):
        verify_object("k", checksum, pieces(corrupted, shuffled))


def test_small_object_needs_its_whole_range() -> None:
    data = BIG[:1000].copy()
    checksum = ObjectChecksum.of(data)
    assert verify_object("k", checksum, pieces(data, [(0, 999)])).verified_bytes == 0
    assert verify_object("k", checksum, pieces(data, [(0, 500), (400, 1000)])).verified_bytes == (
        1000
    )
    data[999] ^= 1
    with pytest.raises(CorruptObject, match="object k does not match"):
        verify_object("k", checksum, pieces(data, [(0, 600), (600, 1000)]))


def test_slice_carries_exactly_the_checksums_of_what_it_reads() -> None:
    from mooncake_rl.apply.executor import Batch, ReadOp

    reads = (ReadOp("a", 0, "r", 0, 8), ReadOp("b", 0, "r", 8, 8))
    plain = WorkerSlice({"r": 16}, ((Batch(reads),),))
    table = {k: ObjectChecksum.of(k.encode() * 8) for k in ("a", "b", "c")}
    checked = with_checksums(plain, table)
    assert set(checked.checksums or {}) == {"a", "b"}
    assert decode_slice(encode_slice(checked)) == checked
    assert decode_slice(encode_slice(plain)).checksums is None
    with pytest.raises(InvariantViolation, match="no entry for b"):
        with_checksums(plain, {"a": table["a"]})


# -- a real Store with one corrupted object ----------------------------------------------------
def model() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    shapes = {"big": (2560, 1024), "small": (64, 32), "odd": (7, 9)}  # big: 10 MiB as float32
    return [(n, torch.randn(s, generator=generator)) for n, s in shapes.items()]


@pytest.fixture(scope="module")
def corrupted(master: EmbeddedMaster, holders) -> tuple[str, str]:
    """A published generation whose ``big`` payload was overwritten with same-size garbage,
    and a clean one of the same layout under ``<name>-clean``."""
    name = "checksums-corrupt"
    with StoreClient(trainer_settings(master, holders("checksum-store"), "trainer")) as store:
        publish_local(store, f"{name}-clean", model(), dtype="float32", keep=None)
        publish_local(store, name, model(), dtype="float32", keep=None)
        manifest = GenerationRegistry(store, name).load_active_manifest()
        assert manifest is not None
        key = next(f.object_key for f in manifest.fragments if f.tensor_id == "big")
        assert verify_generation(store, name)["ok"]
        size = store.size(key)
        assert not store.remove([key], force=True)
        store.put_bytes(key, np.random.default_rng(2).bytes(size))
        assert store.size(key) == size
    return name, key


def test_verify_names_exactly_the_corrupted_object(master: EmbeddedMaster, corrupted) -> None:
    name, key = corrupted
    with StoreClient(settings_for(master, segment_bytes=0)) as store:
        report = verify_generation(store, name)
        clean = verify_generation(store, f"{name}-clean")
    assert report["ok"] is False
    assert report["problems"] == [f"corrupted {key}: its bytes differ from the published checksum"]
    assert clean["ok"] is True and clean["checked_bytes"] == clean["bytes"]


def test_store_loader_refuses_the_corrupted_object(master: EmbeddedMaster, corrupted) -> None:
    name, key = corrupted
    with StoreClient(settings_for(master, segment_bytes=0)) as store:
        _, tensors = active_weights(store, name)
        with pytest.raises(CorruptObject, match=f"object {key} does not match"):
            list(tensors)
        _, clean = active_weights(store, f"{name}-clean")
        assert [n for n, _ in clean] == ["big", "small", "odd"]


def planned(master: EmbeddedMaster, name: str, mode: str, cluster: list[tuple[str, int]]):
    with StoreClient(settings_for(master, segment_bytes=0)) as store:
        registry = GenerationRegistry(store, name)
        record = registry.active()
        assert record is not None
        manifest = registry.load_manifest(record.generation, record.manifest_digest)
        table = registry.load_checksums(record.generation, record.checksums_digest).objects
    engines = simulated_engines(specs_of(manifest), cluster, mode)
    plan = plan_update(manifest, engines, mode, 16 << 20, RoutingCache())
    workers = {
        w["worker_id"]: settings_for(
            master, w["node"], segment_bytes=0, staging_watermark_bytes=64 << 20
        )
        for ws in engines.values()
        for w in ws
    }
    return plan, table, workers


@pytest.mark.parametrize(
    "mode,cluster",
    [("direct", [("node-a", 2), ("node-b", 2)]), ("compat", [("node-a", 1), ("node-b", 1)])],
)
def test_planned_apply_checks_reads_and_fails_on_the_corrupted_object(
    master: EmbeddedMaster, corrupted, mode: str, cluster: list[tuple[str, int]]
) -> None:
    name, key = corrupted
    clean_plan, clean_table, workers = planned(master, f"{name}-clean", mode, cluster)
    plan, table, _ = planned(master, name, mode, cluster)
    with WorkerCluster(workers, plan.routing.regions) as running:
        run = run_planned_update(running, clean_plan, timeout_s=60, checksums=clean_table)
        totals = run["workers"].values()
        read = sum(w["read"] for w in totals)
        verified = sum(w["verified"] for w in totals)
        assert read == clean_plan.store_read_bytes
        assert verified + sum(w["unverified"] for w in totals) == read
        # direct: each half of ``big`` (5 MiB, split by rows) covers one whole block and
        # every small object is read whole by one reader; compat splits ``big`` between two
        # leaders (its wide fan-out), at a point the planner does not align to blocks.
        assert verified >= BLOCK_BYTES

        with pytest.raises(RuntimeError, match=f"CorruptObject: object {key} does not match"):
            run_planned_update(running, plan, timeout_s=60, checksums=table)
        # The documented exception, seen from the other side: without the table it lands.
        run = run_planned_update(running, plan, timeout_s=60)
        assert sum(w["read"] for w in run["workers"].values()) == plan.store_read_bytes
