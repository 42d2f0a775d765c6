"""A worker's staging arena: its layout, its reuse, and its one Transfer Engine endpoint."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from mooncake_rl.apply.copies import LocalCopier
from mooncake_rl.apply.executor import Batch, PushOp
from mooncake_rl.apply.registration import Region
from mooncake_rl.apply.worker import (
    ALIGN,
    ApplyWorker,
    allocate_arena,
    arena_offsets,
    copied_into_order,
    covering_spans,
    peers_from,
    pushed_regions,
    region_align,
    region_of,
)
from mooncake_rl.engine import TransferEngineClient, Write
from mooncake_rl.errors import TransferFailed
from mooncake_rl.settings import Settings

SIZES = st.dictionaries(
    st.text(alphabet="abcdefgh.", min_size=1, max_size=6),
    st.integers(min_value=1, max_value=5000),
    min_size=1,
    max_size=6,
)


@hypothesis_settings(max_examples=60, deadline=None)
@given(
    sizes=SIZES,
    current=st.one_of(st.none(), st.integers(min_value=1, max_value=40000)),
    order=st.lists(st.text(alphabet="abcdefgh.", min_size=1, max_size=6), max_size=6),
)
def test_layout_is_aligned_disjoint_ordered_and_reuses_an_arena_it_fits(
    sizes: dict[str, int], current: int | None, order: list[str]
) -> None:
    """Regions named in ``order`` come first, in that order (names not in ``sizes`` are
    ignored); each starts at a multiple of ``region_align`` of its size, so a view of it
    stays aligned to any dtype whose elements divide it."""
    reuse = None if current is None else torch.zeros(current, dtype=torch.uint8)
    arena, regions = allocate_arena(sizes, reuse=reuse, order=order)
    base, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    assert set(regions) == set(sizes)
    spans = sorted((r.base, r.base + r.size) for r in regions.values())
    for (_, stop), (start, _) in itertools.pairwise(spans):
        assert stop <= start
    for name, region in regions.items():
        assert region.size == sizes[name]
        assert (region.base - base) % region_align(region.size) == 0
        assert (region.base - base) % min(ALIGN, region.size & -region.size) == 0
        assert base <= region.base and region.base + region.size <= end
    first = [n for n in dict.fromkeys(order) if n in sizes]
    laid = sorted(regions, key=lambda n: regions[n].base)
    assert laid == first + sorted(set(sizes) - set(first))
    _, needed = arena_offsets(sizes, order)
    needed = max(needed, ALIGN)
    assert (arena is reuse) == (reuse is not None and reuse.numel() >= needed)
    if arena is not reuse:
        assert arena.numel() == needed and not arena.any()


def test_regions_a_spans_copies_fill_in_order_lie_back_to_back_so_the_copies_merge() -> None:
    """A rank-major pack's pieces, copied out of one span in order, into an arena laid out
    by ``copied_into_order``: one move, not one per piece."""
    sizes = {f"w{i}": 6 * 2 for i in range(7)} | {"staging": 128}
    pieces = [(f"w{i}", 12 * i) for i in (3, 0, 6, 1, 5, 2, 4)]  # span order, not names'
    pushes = tuple(
        PushOp("me", "staging", offset, name, 0, 12)
        for name, offset in sorted(pieces, key=lambda p: p[1])
    )
    order = copied_into_order([[Batch((), pushes)]], "me")
    assert order == [name for name, _ in sorted(pieces, key=lambda p: p[1])]
    arena, regions = allocate_arena(sizes, order=order)
    copier = LocalCopier(regions)
    planned = copier.plan([(p.src_region, p.src_offset, p.dst_region, 0, 12) for p in pushes])
    ((_, src, _, length),) = planned.by_device
    assert len(src) == 1 and int(length[0]) == 7 * 12
    arena[regions["staging"].base - arena.data_ptr() :][:84] = torch.arange(84, dtype=torch.uint8)
    assert planned.run() == 84
    for name, offset in pieces:
        view = arena[regions[name].base - arena.data_ptr() :][:12]
        assert view.tolist() == list(range(offset, offset + 12))


@hypothesis_settings(max_examples=100, deadline=None)
@given(layout=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 64)), min_size=1, max_size=12))
def test_covering_spans_cover_every_region_and_register_no_gap(
    layout: list[tuple[int, int]],
) -> None:
    """Parameters received in place (gaps between them included) on CPU: every region lies
    in exactly one span, spans are disjoint, and no span covers a byte outside the regions."""
    regions, cursor = [], 4096
    for index, (gap, size) in enumerate(layout):
        cursor += gap
        regions.append(Region(f"p{index}", cursor, size))
        cursor += size
    spans = covering_spans(regions[::-1])
    for region in regions:
        owners = [
            s
            for s in spans
            if s.base <= region.base and region.base + region.size <= s.base + s.size
        ]
        assert len(owners) == 1
    ordered = sorted(spans, key=lambda s: s.base)
    assert all(a.base + a.size < b.base for a, b in itertools.pairwise(ordered))
    covered = sum(s.size for s in spans)
    assert covered == sum(r.size for r in regions)


SEGMENT_STRIDE = 1 << 12  # segment k starts at (k + 1) * SEGMENT_STRIDE on its device


@hypothesis_settings(max_examples=150, deadline=None)
@given(
    layout=st.lists(
        st.tuples(
            st.sampled_from(["cuda:0", "cuda:1"]),
            st.integers(0, 5),  # the segment (or the gap after it) the region lies in
            st.booleans(),  # inside the segment, else in the gap after it
            st.integers(0, 900),  # offset
            st.integers(1, 300),  # size
        ),
        min_size=1,
        max_size=40,
    )
)
def test_cuda_regions_are_covered_by_their_allocator_segments(
    layout: list[tuple[str, int, bool, int, int]],
) -> None:
    """Parameters in the caching allocator's segments register as those segments, each
    once; regions outside every segment (memory the allocator did not hand out) merge only
    where they touch. Checked against a direct construction, for regions on two devices
    and segments interleaved with gaps (the bisection's neighbours)."""
    segments = [
        Region(f"segment{d}{k}", (k + 1) * SEGMENT_STRIDE, 1200, f"cuda:{d}")
        for d in (0, 1)
        for k in range(6)
    ]
    regions = []
    for index, (device, k, inside, offset, size) in enumerate(layout):
        start = (k + 1) * SEGMENT_STRIDE + (0 if inside else 1200)
        size = min(size, 1200 - offset) if inside else size
        regions.append(Region(f"p{index}", start + offset, size, device))
    spans = covering_spans(regions, segments)

    def holder(region: Region) -> Region | None:
        return next(
            (
                s
                for s in segments
                if s.device == region.device
                and s.base <= region.base
                and region.base + region.size <= s.base + s.size
            ),
            None,
        )

    held = {s for r in regions if (s := holder(r)) is not None}
    merged: list[list] = []
    for region in sorted(
        (r for r in regions if holder(r) is None), key=lambda r: (r.device, r.base)
    ):
        end = region.base + region.size
        if merged and merged[-1][0] == region.device and region.base <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([region.device, region.base, end])
    assert sorted((s.device, s.base, s.size) for s in spans) == sorted(
        [(s.device, s.base, s.size) for s in held]
        + [(device, base, end - base) for device, base, end in merged]
    )
    assert len(spans) == len({(s.device, s.base) for s in spans})


def test_arena_change_keeps_the_endpoint_and_refuses_the_released_arena(
    settings: Settings,
) -> None:
    """A larger arena is registered on the worker's one endpoint: a peer that cached the
    endpoint's descriptor while only the first arena existed writes into the new arena,
    and its writes into the released arena are refused by the receiver."""
    worker = ApplyWorker(settings, "arena-worker")
    try:
        with TransferEngineClient(settings) as peer:
            source = torch.arange(256, dtype=torch.int64).to(torch.uint8)
            peer.register(source.data_ptr(), source.numel())

            first, first_regions = allocate_arena({"w": 256})
            worker.prepare(region_of("arena", first), first_regions, [])
            worker.promote()
            endpoint = worker.describe()["endpoint"]
            peer.write(endpoint, [Write(source.data_ptr(), first_regions["w"].base, 256)])
            assert torch.equal(first[:256], source)

            smaller, _ = allocate_arena({"x": 100}, reuse=first)
            assert smaller is first

            second, second_regions = allocate_arena({"w": 256, "z": 8192}, reuse=first)
            assert second is not first
            worker.prepare(region_of("arena", second), second_regions, [])
            worker.promote()
            assert worker.describe()["endpoint"] == endpoint

            target = second_regions["z"].base
            peer.write(endpoint, [Write(source.data_ptr(), target, 256)])
            offset = target - second.data_ptr()
            assert torch.equal(second[offset : offset + 256], source)

            first.zero_()
            with pytest.raises(TransferFailed):
                peer.write(endpoint, [Write(source.data_ptr(), first_regions["w"].base, 256)])
            assert not first.any()
    finally:
        worker.close()


@hypothesis_settings(max_examples=60, deadline=None)
@given(
    pushes=st.lists(
        st.tuples(st.sampled_from(["w0", "w1", "w2"]), st.sampled_from(["a", "b", "c", "d"])),
        max_size=8,
    )
)
def test_a_stage_builds_only_the_peers_and_regions_it_pushes_into(
    pushes: list[tuple[str, str]],
) -> None:
    """Peers as their descriptions advertise them, limited to what the stage's pushes
    target: every pushed region is there with its advertised base and size, nothing else."""
    descriptions = [
        {
            "worker_id": worker,
            "endpoint": f"127.0.0.1:{port}",
            "regions": {
                n: {"base": 4096 * (i + 1) + port, "size": 64 * (i + 1)}
                for i, n in enumerate("abcd")
            },
        }
        for port, worker in enumerate(["w0", "w1", "w2"])
    ]
    batches = [Batch(pushes=tuple(PushOp(p, "staging", 0, r, 0, 8) for p, r in pushes))]
    everything = peers_from(descriptions)
    limited = peers_from(descriptions, pushed_regions(batches))
    wanted: dict[str, set[str]] = {}
    for peer, region in pushes:
        wanted.setdefault(peer, set()).add(region)
    assert {w: set(p.regions) for w, p in limited.items()} == wanted
    for worker, peer in limited.items():
        assert peer.endpoint == everything[worker].endpoint
        assert all(peer.regions[n] == everything[worker].regions[n] for n in peer.regions)
