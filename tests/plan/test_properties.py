"""Property tests on random models and topologies, checked by executing tables on bytes."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_rl.generations.checksums import BLOCK_BYTES
from mooncake_rl.generations.layout import SegmentMap
from mooncake_rl.plan import (
    CompatDemand,
    Destinations,
    DirectDemand,
    PlanParams,
    Topology,
    Worker,
    assign,
    plan_routing,
)
from mooncake_rl.plan.planner import object_homes
from mooncake_rl.plan.table import demanded_union_bytes, duplex_nic_bytes

from .helpers import (
    ITEMSIZE,
    Spec,
    check_delivery,
    contents,
    execute,
    expected_delivery,
    manifest,
    parts,
    stored_objects,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def models(draw, mixed: bool = False) -> list[Spec]:
    """Random tensors; ``mixed``: 2-3 dims, each divisible by every TP size, so that each
    engine can split a tensor along a dim of its own choice."""
    specs = []
    for i in range(draw(st.integers(1, 8 if mixed else 40))):
        ndim = draw(st.integers(2, 3)) if mixed else draw(st.integers(1, 3))
        kinds = ["replicated", "split", "split"] if mixed else ["replicated", "split", "owned"]
        kind = draw(st.sampled_from(kinds))
        dim = draw(st.integers(0, ndim - 1))
        # Other dims are sometimes divisible by every TP size too (always when ``mixed``).
        other = [4, 8, 12] if mixed else [1, 2, 3, 4, 6, 8]
        shape = tuple(
            4 * draw(st.integers(1, 3)) if d == dim else draw(st.sampled_from(other))
            for d in range(ndim)
        )
        dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
        specs.append(Spec(f"t{i:02d}.weight", shape, dtype, kind, dim))
    return specs


@st.composite
def scenarios(draw, mode: str, mixed: bool = False):
    """Random clusters; ``mixed`` (direct only): at least two TP>1 engines where possible,
    each splitting every split tensor along a dim it draws (engines disagree on dims)."""
    specs = draw(models(mixed))
    n_nodes = draw(st.integers(1, 3 if mixed else 4))
    per_node = draw(st.integers(4 if mixed and n_nodes == 1 else 1, 4))
    n = n_nodes * per_node
    tps, left = [], n
    while left:
        sizes = [t for t in (1, 2, 4) if t <= left]
        if mixed:
            sizes = [t for t in sizes if 1 < t < n] or [1]
        tp = draw(st.sampled_from(sizes)) if mode == "direct" else 1
        tps.append(tp)
        left -= tp
    workers, part_of, g = [], {}, 0
    # Locality: some nodes hold a Store segment (colocated trainers), named after the node.
    located = {f"n{i}" for i in range(n_nodes) if draw(st.booleans())}
    pieces = mode == "direct" and draw(st.booleans())  # several fragments per tensor and rank
    for i, tp in enumerate(tps):
        dims = {}
        if mixed:
            for s in specs:
                if s.kind == "split":
                    dims[s.name] = draw(st.integers(0, len(s.shape) - 1))
        instance = parts(specs, tp, pieces, dims)
        for r in range(tp):
            worker_id = f"w{g:02d}"
            node = f"n{g // per_node}"
            segment = f"seg-{node}" if node in located else None
            workers.append(Worker(worker_id, node, f"i{i}", r, segment))
            part_of[worker_id] = instance[r]
            g += 1
    destinations = {}
    if mode == "direct" and draw(st.booleans()):
        for worker_id, part in part_of.items():  # pack all fragments into one region
            if not part.fragments:
                continue
            offset, placed = 0, {}
            for f in part.fragments:
                offset += draw(st.integers(0, 3)) * 8
                placed[f.placement_fragment_id] = ("params", offset)
                offset += f.nbytes
            destinations[worker_id] = Destinations.of({"params": offset}, placed)
    params = PlanParams(
        batch_bytes=draw(st.integers(16, 4096)),
        balance_slack=draw(st.floats(0.01, 1.0)),
        min_chunk_bytes=draw(st.integers(1, 512)),
        align=draw(st.sampled_from([1, 8, 64])),
    )
    if mode == "compat":
        demand = CompatDemand(align=draw(st.sampled_from([1, 16, 64])))
    else:
        demand = DirectDemand.of(part_of, destinations)
    packed = draw(st.booleans())
    segments = None
    if located or draw(st.booleans()):
        names = {f.object_key.rsplit("/", 1)[1] for f in manifest(specs, packed=packed).fragments}
        homes = [*sorted(f"seg-{n}" for n in located), "seg-trainer"]
        segments = SegmentMap.of({name: draw(st.sampled_from(homes)) for name in names})
    topology = Topology.of(workers)
    return specs, topology, demand, part_of, destinations, params, packed, segments


def nodes_per_read(table):
    """For each read: the nodes of every worker its bytes reach (the reader's node only when
    it consumes them), its cross-node sends, and per other node (relay, workers reached)."""
    origin = {}
    for i, r in enumerate(table.reads):
        origin[(int(r["worker"]), int(r["dst_region"]), int(r["dst_offset"]))] = i
    cross = defaultdict(int)
    reached = defaultdict(set)
    relays = defaultdict(dict)  # read -> {node: (relay, set of workers reached)}
    for i, r in enumerate(table.reads):
        if table.regions[int(r["dst_region"])] != "staging":
            reached[i].add(int(table.worker_node[r["worker"]]))
    for stage in (1, 2):
        pushes = table.pushes[table.pushes["stage"] == stage]
        for p in pushes[pushes["peer"] != pushes["worker"]]:  # local copies reach no one new
            i = origin[(int(p["worker"]), int(p["src_region"]), int(p["src_offset"]))]
            origin[(int(p["peer"]), int(p["dst_region"]), int(p["dst_offset"]))] = i
            node, peer = int(table.worker_node[p["peer"]]), int(p["peer"])
            reached[i].add(node)
            if table.worker_node[p["worker"]] != node:
                cross[i] += 1
                relays[i][node] = (peer, {peer})
            elif node in relays[i]:
                relays[i][node][1].add(peer)
    return reached, cross, relays


def sieved_reads(table) -> np.ndarray:
    """Reads into staging that their reader copies out of locally (sieved spans): consumer
    reads, not reads staged for others."""
    p = table.pushes[table.pushes["peer"] == table.pushes["worker"]]
    copied = {(int(w), int(o)) for w, o in zip(p["worker"], p["src_offset"], strict=True)}
    out = np.zeros(len(table.reads), bool)
    for i, r in enumerate(table.reads):
        if r["dst_region"] == 0:
            lo, hi = int(r["dst_offset"]), int(r["dst_offset"] + r["length"] * r["count"])
            out[i] = any(w == r["worker"] and lo <= o < hi for w, o in copied)
    return out


def check_relay_bound(table, relays) -> None:
    """Each stream (a node's chunks with one set of k consumers there) is striped: every
    candidate relays within T / k +- b_max of the stream's T bytes."""
    streams = defaultdict(list)
    for i, per_node in relays.items():
        size = int(table.reads[i]["length"]) * int(table.reads[i]["count"])
        for node, (relay, members) in per_node.items():
            streams[(node, frozenset(members))].append((relay, size))
    for (_, members), chunks in streams.items():
        total, b_max = sum(b for _, b in chunks), max(b for _, b in chunks)
        relayed = dict.fromkeys(members, 0)
        for relay, size in chunks:
            relayed[relay] += size
        for got in relayed.values():
            assert abs(got * len(members) - total) <= b_max * len(members), (relayed, total)


def shares_a_block_in_its_batch(table, i: int) -> bool:
    """Whether read ``i`` lies in one checksum block with another read of its worker's
    batch: the only reason a worker reads bytes it does not consume on a consuming node."""
    r = table.reads[i]
    same = table.reads[
        (table.reads["worker"] == r["worker"])
        & (table.reads["batch"] == r["batch"])
        & (table.reads["object"] == r["object"])
    ]
    cell = int(r["src_offset"]) // BLOCK_BYTES
    return len(same) > 1 and bool(
        (same["src_offset"] // BLOCK_BYTES == cell).sum() > 1
        or ((same["src_offset"] + same["length"] - 1) // BLOCK_BYTES == cell).sum() > 1
    )


def check(scenario) -> None:
    specs, topology, demand, part_of, destinations, params, packed, segments = scenario
    m = manifest(specs, packed=packed)
    table = plan_routing(m, topology, demand, params=params, segments=segments)
    totals = table.totals
    model_bytes = sum(s.nbytes for s in specs)

    # Single pull: every tensor is demanded, and each demanded byte is read exactly once.
    assert totals.store_read_bytes == totals.unique_demand_bytes == model_bytes

    # Coverage exactly once, no overlap, right bytes: run the table on real bytes.
    data = contents(specs, seed=len(specs))
    buffers, written, nic = execute(table, stored_objects(m, specs, data))
    check_delivery(
        table,
        buffers,
        written,
        expected_delivery(table, specs, data, demand, part_of, destinations),
    )
    assert int(totals.delivered_bytes.sum()) == table.lower_bound_bytes
    assert list(nic) == list(totals.node_nic_bytes)

    # Hierarchical push: each remote consumer node receives each read's bytes exactly once.
    reached, cross, relays = nodes_per_read(table)
    for i, r in enumerate(table.reads):
        own = int(table.worker_node[r["worker"]])
        assert cross[i] == len(reached[i] - {own})
    check_relay_bound(table, relays)

    # Full duplex, reads from a segment on the reader's node off the NIC (as measured).
    homes = object_homes(table.objects, topology, segments)
    nic_in, nic_out = duplex_nic_bytes(table, homes)
    n_nodes = len(table.nodes)
    read_node = table.worker_node[table.reads["worker"]]
    size = table.reads["length"] * table.reads["count"]
    local = np.zeros(n_nodes, np.int64)
    if homes is not None:
        stays = homes[table.reads["object"]] == read_node
        local = np.bincount(read_node[stays], size[stays], n_nodes).astype(np.int64)
    # A read staged on a node that consumes it (one reader taking a whole checksum block,
    # ``plan/blocks.py``) adds nothing to the node's inbound bytes: one staged on a node
    # that consumes none of it (a relay) does.
    on_consumer = np.array([int(read_node[i]) in reached[i] for i in range(len(read_node))], bool)
    staged_reads = (table.reads["dst_region"] == 0) & ~sieved_reads(table) & ~on_consumer
    staged = np.bincount(read_node[staged_reads], size[staged_reads], n_nodes).astype(np.int64)
    for i in np.flatnonzero((table.reads["dst_region"] == 0) & ~sieved_reads(table) & on_consumer):
        assert shares_a_block_in_its_batch(table, i)
    d_node = table.worker_node[table.demands["worker"]]
    in0 = np.array([demanded_union_bytes(table.demands[d_node == n]) for n in range(n_nodes)])
    assert list(nic_in) == list(in0 + staged - local)
    assert list(nic_in + local) == list(totals.node_nic_in)
    assert list(nic_out) == list(totals.node_nic_out)

    # Balance bound: out <= max(in0 + staged, mean(out) + max over chunks of b * n_c).
    term = max((int(size[i]) * len(reached[i]) for i in range(len(size))), default=0)
    assert term <= table.max_chunk_cost
    assert (nic_out <= np.maximum(in0 + staged, nic_out.mean() + table.max_chunk_cost)).all()

    # A consumer reads whenever one keeps the bound: a chunk is staged only if every consumer
    # node already sent more than it receives, less the chunk's own sends.
    for i in np.flatnonzero(staged_reads):
        o = int(size[i]) * (len(reached[i]) - 1)
        assert o > 0
        for n in reached[i]:
            assert nic_out[n] > in0[n] - local[n] - o

    # Determinism: the same inputs give an equal table.
    again = plan_routing(
        manifest(specs, packed=packed), topology, demand, params=params, segments=segments
    )
    for name in ("reads", "pushes", "demands", "region_sizes"):
        assert np.array_equal(getattr(table, name), getattr(again, name))
    assert (table.objects, table.regions, table.workers) == (
        again.objects,
        again.regions,
        again.workers,
    )


@SETTINGS
@given(scenarios("direct"))
def test_direct_mode_properties(scenario):
    check(scenario)


@SETTINGS
@given(scenarios("direct", mixed=True))
def test_direct_mode_properties_engines_splitting_along_different_dims(scenario):
    """Engines splitting one tensor along different dims demand strided runs of different
    pitches in one object (a regression: such correct plans were refused)."""
    check(scenario)


@SETTINGS
@given(scenarios("compat"))
def test_compat_mode_properties(scenario):
    check(scenario)
    specs, topology, demand, _, _, params, packed, segments = scenario
    table = plan_routing(
        manifest(specs, packed=packed), topology, demand, params=params, segments=segments
    )
    reads = table.totals.store_read_bytes
    assert table.totals.cross_node_push_bytes == reads * (len(topology.nodes) - 1)


@SETTINGS
@given(st.sampled_from(["compat", "direct"]).flatmap(scenarios))
def test_a_pull_per_node_reads_each_node_its_own_union_and_fans_out_in_stage_1(scenario):
    """``PlanParams.pull == "node"``: each node reads exactly the union of what its workers
    demand (its reads disjoint), nothing crosses a NIC but reads, nothing waits for the
    barrier, and the table still delivers every demanded byte once (executed on bytes)."""
    specs, topology, demand, part_of, destinations, params, packed, segments = scenario
    params = PlanParams(**{**params.__dict__, "pull": "node"})
    m = manifest(specs, packed=packed)
    table = plan_routing(m, topology, demand, params=params, segments=segments)
    data = contents(specs, seed=len(specs))
    buffers, written, _ = execute(table, stored_objects(m, specs, data))
    expected = expected_delivery(table, specs, data, demand, part_of, destinations)
    check_delivery(table, buffers, written, expected)

    n_nodes = len(table.nodes)
    read_node = table.worker_node[table.reads["worker"]]
    size = table.reads["length"].astype(np.int64) * table.reads["count"]
    d_node = table.worker_node[table.demands["worker"]]
    in0 = [demanded_union_bytes(table.demands[d_node == n]) for n in range(n_nodes)]
    assert np.bincount(read_node, size, n_nodes).astype(np.int64).tolist() == in0
    pushes = table.pushes
    local = pushes["peer"] == pushes["worker"]  # a sieved span's local copies
    assert (pushes["stage"][~local] == 1).all()
    assert (table.worker_node[pushes["worker"]] == table.worker_node[pushes["peer"]]).all()
    assert table.totals.cross_node_push_bytes == 0
    assert table.totals.store_read_bytes == sum(in0)
    # A node's copy is read on that node (above); a reader stages only bytes that share a
    # checksum block with its own (``plan/blocks.py``).
    for i in np.flatnonzero((table.reads["dst_region"] == 0) & ~sieved_reads(table)):
        assert shares_a_block_in_its_batch(table, i)


@SETTINGS
@given(st.sampled_from(["compat", "direct"]).flatmap(scenarios))
def test_readers_taken_from_consumer_class_queues_are_the_readers_a_scan_picks(scenario):
    """The greedy's queue per consumer class is only a faster way to the same choice:
    scanning every candidate of every chunk picks the same reader for every chunk."""
    specs, topology, demand, _, _, params, packed, segments = scenario
    seen = []
    planned = assign._greedy

    def recorded(loop, lpt):
        seen.append((loop, lpt, planned(loop, lpt)))
        return seen[-1][2]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(assign, "_greedy", recorded)
        plan_routing(
            manifest(specs, packed=packed), topology, demand, params=params, segments=segments
        )
    ((loop, lpt, readers),) = seen
    assert readers == planned(replace(loop, range_class=[-1] * len(loop.range_class)), lpt)


def test_consumer_classes_group_ranges_by_their_consuming_workers_despite_hash_collisions():
    """Ranges 0 and 2 have workers (4, 5) on their two nodes, range 1 has (4, 6), range 3
    a node with two consuming workers (-1) and range 4 a home node: neither is queued.
    Two rows whose hashes collide still get classes of their own."""
    g_single = np.array([4, 5, 4, 6, 4, 5, -1, 7, 4, 5])
    range_groups = np.array([0, 2, 4, 6, 8, 10])
    home = np.array([-1, -1, -1, -1, 1])
    classes = assign.consumer_classes(g_single, range_groups, home).tolist()
    assert classes[0] == classes[2] >= 0 and classes[1] >= 0 and classes[1] != classes[0]
    assert classes[3:] == [-1, -1]
    a, b = assign._mix(2).tolist()
    colliding = np.array([b, 0, 0, a])  # b * a + 0 == 0 + a * b
    assert (colliding[:2] @ assign._mix(2)) == (colliding[2:] @ assign._mix(2))
    classes = assign.consumer_classes(colliding, np.array([0, 2, 4]), np.array([-1, -1]))
    assert sorted(classes.tolist()) == [0, 1]


@st.composite
def greedy_loops(draw):
    """Arbitrary inputs of the greedy loop: consumer nodes with one or several consuming
    workers, home nodes, and inbound budgets and chunk costs small enough that candidates
    are often over the bound (refused, or every one of them: staged)."""
    n_nodes = draw(st.integers(1, 4))
    workers_on = [[] for _ in range(n_nodes)]
    extra = draw(st.lists(st.integers(0, n_nodes - 1), max_size=4))
    node_of = [*range(n_nodes), *extra]  # every node has a worker
    for w, node in enumerate(node_of):
        workers_on[node].append(w)
    g_node, g_bounds, g_workers, range_groups, range_home = [], [0], [], [0], []
    for _ in range(draw(st.integers(1, 6))):
        nodes = sorted(draw(st.sets(st.integers(0, n_nodes - 1), min_size=1)))
        for node in nodes:
            mine = workers_on[node]
            g_workers += sorted(draw(st.sets(st.sampled_from(mine), min_size=1)))
            g_node.append(node)
            g_bounds.append(len(g_workers))
        range_groups.append(len(g_node))
        range_home.append(draw(st.sampled_from([-1, -1, -1, *range(n_nodes)])))
    g_bounds_a = np.array(g_bounds)
    g_single = np.where(np.diff(g_bounds_a) == 1, np.array(g_workers)[g_bounds_a[:-1]], -1)
    owner = draw(st.lists(st.integers(0, len(range_home) - 1), min_size=1, max_size=40))
    loop = assign._Loop(
        owner=owner,
        c_bytes=[draw(st.integers(1, 100)) for _ in owner],
        range_groups=range_groups,
        range_home=range_home,
        g_node=g_node,
        g_bounds=g_bounds,
        g_workers=g_workers,
        g_single=g_single.tolist(),
        range_class=assign.consumer_classes(
            g_single, np.array(range_groups), np.array(range_home)
        ).tolist(),
        workers_on=workers_on,
        in0=[draw(st.integers(0, 300)) for _ in range(n_nodes)],
        n_workers=len(node_of),
        max_cost=draw(st.integers(0, 300)),
    )
    return loop, draw(st.permutations(range(len(owner))))


@settings(max_examples=300, deadline=None)
@given(greedy_loops())
def test_class_queues_choose_as_a_scan_does_when_candidates_are_refused(case):
    loop, lpt = case
    scanned = replace(loop, range_class=[-1] * len(loop.range_class))
    assert assign._greedy(loop, lpt) == assign._greedy(scanned, lpt)
