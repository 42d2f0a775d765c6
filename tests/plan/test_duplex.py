"""Full-duplex reader choice, relays spread over a node's GPUs, and locality hints."""

from __future__ import annotations

import numpy as np
import pytest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import specs_of
from mooncake_rl.generations.layout import SegmentMap
from mooncake_rl.plan import CompatDemand, PlanParams, Topology, Worker, plan_key, plan_routing
from mooncake_rl.plan.planner import object_homes
from mooncake_rl.plan.shapes import MODELS, ModelShape, TensorSpec, cluster, weight_manifest
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.plan.table import demanded_union_bytes, duplex_nic_bytes
from mooncake_rl.plan.update import RoutingCache, plan_update

from .helpers import Spec, check_delivery, contents, execute, manifest


def test_topology_order_digest_and_segments():
    topology = Topology.of([Worker("b", "n0"), Worker("a", "n0"), Worker("c", "n1")])
    assert topology.worker_ids == ("a", "b", "c")
    assert Topology.of(reversed(topology.workers)).digest == topology.digest
    located = Topology.of([Worker("a", "n0", segment="s0"), Worker("b", "n0", segment="s0")])
    assert located.segment_node == {"s0": 0}
    assert located.digest != Topology.of([Worker("a", "n0"), Worker("b", "n0")]).digest
    with pytest.raises(InvariantViolation, match="is on node n0 and on node n1"):
        Topology.of([Worker("a", "n0", segment="s"), Worker("b", "n1", segment="s")])
    with pytest.raises(InvariantViolation, match="duplicate worker id"):
        Topology.of([Worker("a", "n0"), Worker("a", "n1")])
    with pytest.raises(InvariantViolation, match="needs a node label"):
        Worker("x", "")
    with pytest.raises(InvariantViolation, match="bad segment"):
        Worker("x", "n0", segment="")


def test_instances_spanning_two_nodes_are_read_by_their_consumers():
    """Four TP4 engines, each spanning two 2-GPU nodes: every chunk is consumed on four of
    eight nodes. Counting reads and pushes as one cost, readers that consume nothing took a
    large share of the reads (inbound bytes above each node's own demand: 44 % of Kimi-K2's
    8 x TP16 reads); full duplex, every node receives exactly what it consumes and sends
    less than that. (A reader may stage another rank's bytes of a checksum block it reads
    whole, ``plan/blocks.py``; its node consumes them, so no node receives more.)"""
    model = MODELS["small"]()
    topology, demand = cluster(model, 4, 4, workers_per_node=2)
    table = plan_routing(weight_manifest(model, 1), topology, demand)
    d_node = table.worker_node[table.demands["worker"]]
    own = [demanded_union_bytes(table.demands[d_node == n]) for n in range(len(table.nodes))]
    nic_in, nic_out = table.totals.node_nic_in, table.totals.node_nic_out
    assert list(nic_in) == own
    assert (nic_out <= nic_in).all()
    assert table.totals.store_read_bytes == table.totals.unique_demand_bytes


def every_gpu_holds_every_tensor(table, specs) -> None:
    """Run the compat table on bytes: each worker's compat region holds every tensor."""
    data = contents(specs)
    buffers, written, _ = execute(table, data)
    expected = [(table.compat.offset(s.name), data[s.name]) for s in specs]
    check_delivery(
        table, buffers, written, {(w, "compat"): expected for w in range(len(table.workers))}
    )


def test_compat_relays_spread_over_every_gpu_of_a_node():
    """Compat, 2 nodes x 4 GPUs, 16 equal tensors: the remote node's relays are its four
    GPUs in turn (each relays 4 tensors and fans each out 3 times after the barrier), where
    one delegate used to relay all 16 and send all 48 copies."""
    specs = [Spec(f"t{i:02d}", (64,), "float32") for i in range(16)]
    workers = [Worker(f"w{n}{g}", f"n{n}", f"i{n}{g}") for n in range(2) for g in range(4)]
    params = PlanParams(min_chunk_bytes=256, balance_slack=1.0)
    table = plan_routing(manifest(specs), Topology.of(workers), CompatDemand(), params=params)
    pushes = table.pushes
    relayed = np.bincount(
        pushes["peer"][(pushes["stage"] == 1) & (pushes["worker"] // 4 != pushes["peer"] // 4)],
        minlength=8,
    )
    fanned = np.bincount(pushes["worker"][pushes["stage"] == 2], minlength=8)
    per_node = relayed.reshape(2, 4)
    for node in range(2):  # each node relays what the other read, spread over its 4 GPUs
        assert per_node[node].max() - per_node[node].min() <= 1
        assert (fanned.reshape(2, 4)[node] == 3 * per_node[node]).all()
    assert relayed.sum() == 16 and fanned.sum() == 48
    every_gpu_holds_every_tensor(table, specs)


def test_compat_pulled_per_node_fans_out_as_reads_land_and_nodes_walk_apart():
    """The same cluster with a pull per node: each node reads all 16 tensors, spread over
    its four GPUs, and every copy is a stage 1 push from a read (nothing waits for the
    barrier, nothing crosses a NIC but reads). Node 1 starts its walk half-way through
    the objects, so the two nodes do not ask one object's holder at once."""
    specs = [Spec(f"t{i:02d}", (64,), "float32") for i in range(16)]
    workers = [Worker(f"w{n}{g}", f"n{n}", f"i{n}{g}") for n in range(2) for g in range(4)]
    params = PlanParams(min_chunk_bytes=256, balance_slack=1.0, batch_bytes=256, pull="node")
    table = plan_routing(manifest(specs), Topology.of(workers), CompatDemand(), params=params)
    reads, pushes = table.reads, table.pushes
    assert np.bincount(reads["worker"], minlength=8).tolist() == [4] * 8
    assert (pushes["stage"] == 1).all() and (pushes["worker"] // 4 == pushes["peer"] // 4).all()
    assert np.bincount(pushes["worker"], minlength=8).tolist() == [12] * 8
    first = {}  # each node's objects in the order of its read batches
    for r in np.sort(reads, order=["batch", "worker"]):
        first.setdefault(int(r["worker"]) // 4, []).append(table.objects[int(r["object"])])
    assert first[0][:4] != first[1][:4]
    assert sorted(first[0]) == sorted(first[1]) == sorted(table.objects)
    assert min(map(table.objects.index, first[1][:4])) >= 8  # node 1 of 2 starts half-way
    every_gpu_holds_every_tensor(table, specs)


def located_cluster(segment: str | None):
    workers = [Worker("a", "n0", "i0"), Worker("b", "n1", "i1", segment=segment)]
    return Topology.of(workers)


def test_locality_prefers_the_segment_node_among_equals_and_reads_off_the_nic():
    specs = [Spec("t", (64,), "float32")]
    m = manifest(specs)
    plain = plan_routing(m, located_cluster(None), CompatDemand())
    assert plain.reads["worker"].tolist() == [0]  # no hint: the lowest index
    topology = located_cluster("holder-n1")
    segments = SegmentMap.of({"t": "holder-n1"})
    table = plan_routing(m, topology, CompatDemand(), segments=segments)
    assert table.reads["worker"].tolist() == [1]  # equally loaded: the segment's node reads
    homes = object_homes(table.objects, topology, segments)
    nic_in, nic_out = duplex_nic_bytes(table, homes)
    assert list(nic_in) == [256, 0] and list(nic_out) == [0, 256]  # the read stayed on n1
    assert list(table.totals.node_nic_in) == [256, 256]  # without hints: every read counts
    # Hints that name no rollout node change nothing, not even the cache key.
    elsewhere = SegmentMap.of({"t": "holder-trainer"})
    key = plan_key(m, topology, CompatDemand().digest, PlanParams())
    assert plan_key(m, topology, CompatDemand().digest, PlanParams(), segments=elsewhere) == key
    assert plan_key(m, topology, CompatDemand().digest, PlanParams(), segments=segments) != key
    assert object_homes(table.objects, topology, elsewhere) is None


def test_reads_on_the_segment_node_are_off_the_nic():
    """Every tensor sits on n1: n0 receives each once (read or pushed); n1's reads stay on
    n1, so its inbound bytes are only what n0 read and pushed over."""
    specs = [Spec(f"t{i}", (64,), "float32") for i in range(6)]
    topology = located_cluster("holder-n1")
    segments = SegmentMap.of({s.name: "holder-n1" for s in specs})
    params = PlanParams(min_chunk_bytes=256, balance_slack=1.0)
    table = plan_routing(
        manifest(specs), topology, CompatDemand(), params=params, segments=segments
    )
    nic_in, nic_out = duplex_nic_bytes(table, object_homes(table.objects, topology, segments))
    read_by_n1 = int((table.reads["worker"] == 1).sum()) * 256
    assert 0 < read_by_n1 < 6 * 256
    assert list(nic_in) == [6 * 256, 6 * 256 - read_by_n1]
    assert list(nic_out) == [6 * 256 - read_by_n1, read_by_n1]


def test_segment_map_round_trip_and_validation():
    segments = SegmentMap.of({"b": "s1", "a": "s0", "c": "s1"})
    assert segments.objects == ("a", "b", "c") and segments.segments == ("s0", "s1")
    assert segments.segment("c") == "s1" and segments.segment("z") is None
    assert SegmentMap.decode(segments.encode()) == segments
    assert SegmentMap.decode(segments.encode()).digest == segments.digest
    assert SegmentMap.of({"a": "s0"}).digest != segments.digest
    with pytest.raises(InvariantViolation, match="sorted and distinct"):
        SegmentMap(("b", "a"), (0, 0), ("s",))
    with pytest.raises(InvariantViolation, match="indices"):
        SegmentMap(("a",), (1,), ("s",))
    with pytest.raises(InvariantViolation, match="not a segment map"):
        SegmentMap.decode(b"{}")


def test_plan_update_takes_segments_from_the_worker_descriptions():
    """The coordinator's path: each worker description names its node's segment, the
    announce's map names each object's; between equally loaded readers, node-b's reads."""
    model = ModelShape("m", (TensorSpec("t", (64,), "replicated"),))
    m = weight_manifest(model, 1)
    engines = simulated_engines(specs_of(m), [("node-a", 1), ("node-b", 1)], "compat")
    for worker in engines["http://engine1"]:
        worker["segment"] = "holder-b"
    names = sorted(f.object_key.rsplit("/", 1)[1] for f in m.fragments)
    segments = SegmentMap.of(dict.fromkeys(names, "holder-b"))
    located = plan_update(m, engines, "compat", 4096, RoutingCache(), segments=segments)
    plain = plan_update(m, engines, "compat", 4096, RoutingCache())
    for plan, node in ((located, 1), (plain, 0)):
        table = plan.routing.table
        assert table.worker_node[table.reads["worker"]].tolist() == [node]
