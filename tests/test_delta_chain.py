"""Delta generations, pure parts: delta objects per checksum block, tables, lineage, policy."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.chain import (
    CorruptDelta,
    DeltaPolicy,
    DeltaTable,
    ObjectDelta,
    apply_object,
    delta_key,
    delta_object,
    entry_hash,
)
from mooncake_rl.generations.checksums import BLOCK_BYTES
from mooncake_rl.generations.delta import ENCODINGS, HEADER, MAGIC, decode_changes
from mooncake_rl.generations.gc import plan_gc
from mooncake_rl.generations.records import FenceError, GenerationInfo, Lineage, seal


@st.composite
def object_pairs(draw: st.DrawFn) -> tuple[np.ndarray | None, np.ndarray, int, tuple[int, ...]]:
    itemsize = draw(st.sampled_from([1, 2, 4]))
    numel = draw(st.integers(1, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    rate = draw(st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]))
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, numel * itemsize, dtype=np.uint8)
    new = base.copy().view(f"u{itemsize}")
    changed = rng.random(numel) < rate
    new[changed] ^= 1
    nbytes = numel * itemsize
    cuts = tuple(sorted(set(draw(st.lists(st.integers(1, max(1, nbytes - 1)), max_size=3)))))
    cuts = tuple(c for c in cuts if 0 < c < nbytes)
    fresh = draw(st.booleans())
    return (None if fresh else base), new.view(np.uint8), itemsize, cuts


@settings(max_examples=150, deadline=None)
@given(object_pairs())
def test_a_delta_object_rebuilds_exactly_what_was_published(case) -> None:  # type: ignore[no-untyped-def]
    base, new, itemsize, cuts = case
    blob, row = delta_object(base, new, itemsize, cuts)
    assert row.nbytes == len(new) and row.delta_bytes == len(blob)
    assert [s for s, _ in row.spans()][1:] == sorted(
        {*range(BLOCK_BYTES, len(new), BLOCK_BYTES), *cuts}
    )
    target = np.zeros(len(new), np.uint8) if base is None else base.copy()
    apply_object(target, blob, row, "k")
    assert target.tobytes() == new.tobytes()


def test_entries_cost_what_changed_and_a_block_is_sent_whole_when_that_is_smaller() -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint16)
    new = base.copy()
    new[::100] += 1  # 1 % changed: 2-byte gaps and 2-byte values
    blob, _ = delta_object(base, new, 2)
    assert len(blob) == HEADER.size + len(new[::100]) * 4
    everything = base + 1
    blob, _ = delta_object(base, everything, 2)
    assert len(blob) == HEADER.size + base.nbytes  # whole: smaller than positions plus values


def test_a_corrupted_entry_is_refused_naming_the_object_and_nothing_is_half_applied() -> None:
    base = np.arange(4096, dtype=np.uint8)
    new = base.copy()
    new[7] = 0
    blob, row = delta_object(base, new, 1)
    bad = bytearray(blob)
    bad[-1] ^= 0xFF
    target = base.copy()
    with pytest.raises(CorruptDelta, match=r"g2/payload/w.*published hash"):
        apply_object(target, bytes(bad), row, "m/g2/payload/w")
    assert target.tobytes() == base.tobytes()


def test_an_entry_outside_its_block_is_refused() -> None:
    base = np.zeros(64, np.uint8)
    # A well-hashed entry that says it changes element 64 of a 64-element block.
    forged = (
        HEADER.pack(MAGIC, ENCODINGS.index("gaps16"), 1, 64, 1) + np.uint16(64).tobytes() + b"\1"
    )
    forged_row = ObjectDelta(64, (len(forged),), (entry_hash(forged),))
    with pytest.raises(CorruptDelta, match="changes element 64 of 64"):
        apply_object(base.copy(), forged, forged_row, "k")


@settings(max_examples=150, deadline=None)
@given(object_pairs())
def test_declared_extents_are_what_each_entry_writes_and_round_trip(case) -> None:  # type: ignore[no-untyped-def]
    base, new, itemsize, cuts = case
    blob, row = delta_object(base, new, itemsize, cuts)
    for (lo, hi), extent in zip(row.entries(), row.extents, strict=True):
        delta, positions = decode_changes(blob[lo:hi])
        assert delta.itemsize == row.itemsize
        assert extent == (len(positions), int(positions[-1]) if len(positions) else -1)
    assert row.problems() == []
    assert ObjectDelta.from_json(json.loads(json.dumps(asdict(row)))) == row
    table = DeltaTable(1, 1, {"m/g2/payload/w": row})
    assert DeltaTable.decode(table.encode()) == table


def test_a_table_from_before_extents_decodes_and_its_entries_are_checked_at_load() -> None:
    base = np.arange(4096, dtype=np.uint16)
    new = base.copy()
    new[::50] += 1
    blob, row = delta_object(base, new, 2)
    old = {k: v for k, v in asdict(row).items() if k not in ("itemsize", "extents")}
    table = DeltaTable.decode(seal({"base": 1, "keyframe": 1, "objects": {"k": old}}))
    legacy = table.objects["k"]
    assert (legacy.itemsize, legacy.extents, legacy.problems()) == (0, (), [])
    target = base.view(np.uint8).copy()
    apply_object(target, blob, legacy, "k")
    assert target.tobytes() == new.tobytes()


def test_an_extent_outside_its_block_or_its_entry_is_found_without_reading_it() -> None:
    base = np.zeros(1000, np.uint16)
    new = base.copy()
    new[[3, 700]] = 1
    _, row = delta_object(base, new, 2, (1000,))  # blocks of 500 elements: 3 | 200
    assert row.extents == ((1, 3), (1, 200))
    cases = {
        ((1, 3), (1, 500)): "declares a change at element 500, outside its 500 elements",
        ((1, 3), (2, 0)): "declares 2 changed elements up to element 0",
        ((1, 3), (0, 200)): "declares 0 changed elements up to element 200",
        ((1, 3), (3, 200)): "has an entry of 32 bytes, which no encoding fills with 3 of its "
        "500 2-byte elements",
    }
    for extents, why in cases.items():
        assert replace(row, extents=extents).problems() == [(1, why)]
    for bad in [{"extents": ((1, 3),)}, {"itemsize": 3}, {"extents": ((1, 3), (-1, 200))}]:
        with pytest.raises(InvariantViolation, match="extents"):
            replace(row, **bad)


def test_an_entry_that_writes_other_than_its_declared_extent_or_block_is_refused_at_load() -> None:
    base = np.zeros(64, np.uint8)
    new = base.copy()
    new[[5, 9]] = 1
    blob, row = delta_object(base, new, 1)
    assert row.extents == ((2, 9),)
    understated = replace(row, extents=((2, 8),))
    with pytest.raises(CorruptDelta) as refused:
        apply_object(base.copy(), blob, understated, "k", lambda start, end: ["w", "b"])
    assert refused.type is CorruptDelta
    assert str(refused.value).startswith(
        "delta of k bytes 0..64 (tensors w, b): its entry writes 2 1-byte elements up to "
        "element 9, the delta table declares 2 1-byte elements up to element 8; the publisher "
        "wrote a malformed delta: publish a keyframe"
    )
    # A well-hashed entry of 32 elements for a block of 64: it would leave half unwritten.
    short = HEADER.pack(MAGIC, ENCODINGS.index("gaps16"), 1, 32, 1) + b"\5\0\1"
    short_row = ObjectDelta(64, (len(short),), (entry_hash(short),))
    with pytest.raises(CorruptDelta, match="covers 32 elements of 1 bytes, not the block's 64"):
        apply_object(base.copy(), short, short_row, "k")


def test_delta_table_round_trips_and_refuses_a_bad_keyframe() -> None:
    base, new = np.zeros(9000, np.uint8), np.ones(9000, np.uint8)
    _, row = delta_object(base, new, 1, (100,))
    table = DeltaTable(4, 2, {"m/g5/payload/w": row})
    assert DeltaTable.decode(table.encode()) == table
    with pytest.raises(InvariantViolation, match="keyframe 5"):
        DeltaTable(4, 5, {})
    assert delta_key("mooncake-rl/m/g000000000005/payload/p.0") == (
        "mooncake-rl/m/g000000000005/delta/p.0"
    )


def test_lineage_names_base_keyframe_and_chain_together() -> None:
    assert not Lineage(3).is_delta
    assert Lineage(3, 2, 1, 2, 10).is_delta
    for bad in [(3, 2, None, 1, 0), (3, None, 1, 0, 0), (3, 3, 1, 1, 0), (3, 2, 1, 0, 0)]:
        with pytest.raises(FenceError):
            Lineage(*bad)


def info(
    generation: int,
    base: int | None = None,
    keyframe: int | None = None,
    length: int = 0,
    chain: int = 0,
) -> GenerationInfo:
    return GenerationInfo(generation, 1, 1000, "d", "t", "c", None, base, keyframe, length, chain)


def test_policy_keyframes_every_k_and_when_the_chain_grows_heavy() -> None:
    policy = DeltaPolicy(every=3, max_fraction=0.5)
    assert policy.base_for(None) is None
    assert policy.base_for(info(1)) == (1, 1)
    assert policy.base_for(info(2, 1, 1, 1, 100)) == (2, 1)
    assert policy.base_for(info(3, 2, 1, 2, 200)) is None  # a third delta: keyframe
    assert policy.base_for(info(2, 1, 1, 1, 501)) is None  # chain over half a full one
    assert DeltaPolicy(every=1).base_for(info(1)) is None
    for bad in [{"every": 0}, {"every": 2.0}, {"max_fraction": 0}, {"max_fraction": 1.5}]:
        with pytest.raises(InvariantViolation, match="nothing published"):
            DeltaPolicy(**bad)  # type: ignore[arg-type]


def test_gc_keeps_the_chain_of_every_kept_generation() -> None:
    bases = {1: None, 2: 1, 3: 2, 4: None, 5: 4}
    assert plan_gc(range(1, 6), 3, [], 1, bases) == []  # active 3 keeps 2 and 1
    assert plan_gc(range(1, 6), 5, [], 1, bases) == [1, 2, 3]
    assert plan_gc(range(1, 6), 5, [3], 1, bases) == []
    assert plan_gc(range(1, 6), 5, [], 1) == [1, 2, 3, 4]
