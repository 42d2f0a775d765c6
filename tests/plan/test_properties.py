"""Property tests on random models and topologies, checked by executing tables on bytes."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_rl.plan import (
    CompatDemand,
    Destinations,
    DirectDemand,
    PlanParams,
    Topology,
    Worker,
    plan_routing,
)

from .helpers import (
    ITEMSIZE,
    Spec,
    check_delivery,
    contents,
    execute,
    fragment_bytes,
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
            workers.append(Worker(worker_id, f"n{g // per_node}", f"i{i}", r))
            part_of[worker_id] = instance[r]
            g += 1
    delegates = {}
    if draw(st.booleans()):
        for node in {w.node for w in workers}:
            delegates[node] = draw(
                st.sampled_from([w.worker_id for w in workers if w.node == node])
            )
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
    return specs, Topology.of(workers, delegates), demand, part_of, destinations, params, packed


def expected_delivery(table, specs, data, demand, part_of, destinations):
    spec = {s.name: s for s in specs}
    expected = defaultdict(list)
    for w, worker_id in enumerate(table.workers):
        if isinstance(demand, CompatDemand):
            for s in specs:
                expected[(w, "compat")].append((table.compat.offset(s.name), data[s.name]))
            continue
        where = {}
        if worker_id in destinations:
            where = {f: (region, base) for f, region, base in destinations[worker_id].fragments}
        for f in part_of[worker_id].fragments:
            region, base = where.get(f.placement_fragment_id, (f.placement_fragment_id, 0))
            chunk = fragment_bytes(
                spec[f.tensor_id], data[f.tensor_id], f.global_offset, f.local_shape
            )
            expected[(w, region)].append((base, chunk))
    return expected


def nodes_per_read(table):
    """For each read: the reader's node and the nodes of every worker its bytes reach."""
    origin = {}
    for i, r in enumerate(table.reads):
        origin[(int(r["worker"]), int(r["dst_region"]), int(r["dst_offset"]))] = i
    cross = defaultdict(int)
    reached = defaultdict(set)
    for i, r in enumerate(table.reads):
        if table.regions[int(r["dst_region"])] != "staging":
            reached[i].add(int(table.worker_node[r["worker"]]))
    for stage in (1, 2):
        for p in table.pushes[table.pushes["stage"] == stage]:
            i = origin[(int(p["worker"]), int(p["src_region"]), int(p["src_offset"]))]
            origin[(int(p["peer"]), int(p["dst_region"]), int(p["dst_offset"]))] = i
            reached[i].add(int(table.worker_node[p["peer"]]))
            cross[i] += int(table.worker_node[p["worker"]] != table.worker_node[p["peer"]])
    return reached, cross


def check(scenario) -> None:
    specs, topology, demand, part_of, destinations, params, packed = scenario
    m = manifest(specs, packed=packed)
    table = plan_routing(m, topology, demand, params=params)
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
    reached, cross = nodes_per_read(table)
    for i, r in enumerate(table.reads):
        own = int(table.worker_node[r["worker"]])
        assert cross[i] == len(reached[i] - {own})

    # Balance bound: max <= mean + max over chunks of bytes * (consumer nodes + 1).
    term = max(
        (
            int(r["length"]) * int(r["count"]) * (len(reached[i]) + 1)
            for i, r in enumerate(table.reads)
        ),
        default=0,
    )
    assert term <= table.max_chunk_cost
    assert nic.max() <= nic.mean() + term + 1e-6

    # Determinism: the same inputs give an equal table.
    again = plan_routing(manifest(specs, packed=packed), topology, demand, params=params)
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
    specs, topology, demand, _, _, params, packed = scenario
    table = plan_routing(manifest(specs, packed=packed), topology, demand, params=params)
    reads = table.totals.store_read_bytes
    assert table.totals.cross_node_push_bytes == reads * (len(topology.nodes) - 1)
