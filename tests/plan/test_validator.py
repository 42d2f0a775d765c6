"""The validator rejects corrupted tables with a precise message."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan import DirectDemand, PlanParams, Topology, Worker, plan_routing, validate
from mooncake_rl.plan.validate import validate_routing_table

from .helpers import Spec, check_delivery, contents, execute, manifest, parts

SPECS = [
    Spec("q", (8, 8), kind="split", dim=0),
    Spec("o", (8, 8), kind="split", dim=1),
    Spec("norm", (8,)),
]


@pytest.fixture(scope="module")
def table():
    """Two TP2 instances on two nodes: strided reads, stage 1 and stage 2 pushes."""
    ps = parts(SPECS, 2)
    workers = [Worker(f"i{i}r{r}", f"n{i}", f"i{i}", r) for i in range(2) for r in range(2)]
    demand = DirectDemand.of({w.worker_id: ps[w.tp_rank] for w in workers})
    t = plan_routing(manifest(SPECS), Topology.of(workers), demand)
    assert set(t.pushes["stage"].tolist()) == {1, 2}
    assert (t.reads["count"] > 1).any()
    return t


def corrupt(t, records: str, index: int, **fields):
    array = getattr(t, records).copy()
    for name, value in fields.items():
        array[index][name] = value
    return replace(t, **{records: array})


def rejects(t, pattern: str) -> None:
    with pytest.raises(InvariantViolation, match=pattern):
        validate_routing_table(t)


def test_valid_table_passes(table):
    validate_routing_table(table)


@pytest.mark.parametrize("block", [1 << 20, 2])
def test_uncovered_byte(table, block: int, monkeypatch) -> None:
    monkeypatch.setattr(validate, "CONTENT_BLOCK", block)  # coverage sums over blocks
    validate_routing_table(table)
    dropped = replace(table, pushes=table.pushes[1:])
    rejects(dropped, r"receives \d+ of \d+ bytes|sends bytes no earlier write landed")


def test_overlapping_write(table):
    doubled = replace(table, pushes=np.insert(table.pushes, 0, table.pushes[0]))
    rejects(doubled, r"writes overlap: push #0 .* and push #1")


def test_read_past_object_end(table):
    i = int(np.flatnonzero(table.reads["count"] == 1)[0])
    size = int(table.object_sizes[table.reads[i]["object"]])
    rejects(corrupt(table, "reads", i, src_offset=size - int(table.reads[i]["length"]) + 2),
            "reads past the end of its object")  # fmt: skip


def test_wrong_range_length(table):
    i = int(np.flatnonzero(table.reads["count"] == 1)[0])
    length = int(table.reads[i]["length"]) - 2
    shorter = corrupt(table, "reads", i, length=length, src_stride=length, dst_stride=length)
    rejects(shorter, r"receives \d+ of \d+ bytes|sends bytes no earlier write landed")


def test_wrong_source_bytes(table):
    i = int(np.flatnonzero(table.reads["count"] > 1)[0])
    moved = corrupt(table, "reads", i, src_offset=int(table.reads[i]["src_offset"]) ^ 8)
    rejects(moved, "single-pull violated|writes bytes no demand maps")


def test_push_before_its_bytes_arrive(table):
    i = int(np.flatnonzero(table.pushes["stage"] == 2)[0])
    early = corrupt(table, "pushes", i, stage=1)
    early = replace(
        early,
        pushes=early.pushes[
            np.lexsort((early.pushes["batch"], early.pushes["stage"], early.pushes["worker"]))
        ],
    )
    rejects(early, "before they arrive")


def test_double_read_breaks_single_pull(table):
    r = table.reads[:1].copy()
    r["dst_region"] = 0  # a second copy of the same bytes, into staging
    staged = np.zeros(1, table.region_sizes.dtype)
    staged[0] = (r["worker"][0], 0, 1 << 20)
    doubled = replace(
        table,
        reads=np.sort(np.concatenate([table.reads, r]), order=["worker", "batch"], kind="stable"),
        region_sizes=np.concatenate([table.region_sizes, staged]),
    )
    rejects(doubled, "single-pull violated")


def test_undeclared_region_and_staging_targets(table):
    rejects(
        corrupt(table, "reads", 0, dst_region=len(table.regions) - 1),
        "undeclared region|past the end",
    )
    # A push into staging needs the peer to declare one (only sieved spans go there).
    staging = {int(r["worker"]) for r in table.region_sizes if r["region"] == 0}
    k = next(i for i, p in enumerate(table.pushes) if int(p["peer"]) not in staging)
    rejects(corrupt(table, "pushes", k, dst_region=0), "undeclared region staging")
    own = int(table.pushes[0]["worker"])
    # A push to oneself is a local copy of bytes it holds, into its own regions
    # (tests/plan/test_sieve.py: the rest).
    rejects(corrupt(table, "pushes", 0, peer=own), "overlap|no demand maps|undeclared|past the end")


def test_reader_outside_the_demand_stages_through_staging():
    """Four TP2 engines, rank 0 on n0-n3 and rank 1 on n4; the five equal tensors ``t*`` are
    owned by rank 0, so each is consumed on n0-n3 only. A consumer reader sends 3 copies:
    after four reads every consumer sends 3 x 256 of the 5 x 256 bytes it receives. A fifth
    on a consumer would send 6 x 256 > 5 x 256 (its NIC's busier side); n4 reads it into
    staging instead (out 4 x 256), then relays it."""
    specs = [Spec(f"t{i}", (64,), "float32", kind="owned") for i in (0, 2, 4, 6, 8)]
    specs.append(Spec("y", (64,), "float32", kind="owned"))  # owned by rank 1
    ps = parts(specs, 2)
    assert [f.tensor_id for f in ps[1].fragments] == ["y"]
    workers = [Worker(f"a{i}", f"n{i}", f"i{i}", 0) for i in range(4)]
    workers += [Worker(f"b{i}", "n4", f"i{i}", 1) for i in range(4)]
    demand = DirectDemand.of({w.worker_id: ps[w.tp_rank] for w in workers})
    params = PlanParams(batch_bytes=256, min_chunk_bytes=256, balance_slack=1.0)
    table = plan_routing(manifest(specs), Topology.of(workers), demand, params=params)
    staged = table.reads[table.reads["dst_region"] == 0]
    assert len(staged) == 1 and table.worker_node[staged["worker"][0]] == 4
    assert table.totals.store_read_bytes == 6 * 256
    data = contents(specs)
    buffers, written, _ = execute(table, data)
    region = {f.tensor_id: f.placement_fragment_id for p in ps for f in p.fragments}
    expected = {
        (w, region[s.name]): [(0, data[s.name])]
        for w in range(8)
        for s in (specs[:5] if w < 4 else specs[5:])
    }
    check_delivery(table, buffers, written, expected)
    assert table.totals.node_nic_in.tolist() == [5 * 256] * 4 + [2 * 256]
    assert table.totals.node_nic_out.tolist() == [3 * 256] * 4 + [4 * 256]

    # Two pushes to one peer with their destinations swapped: no overlap, wrong content.
    # The staged read shifts every later write's index: the message names the right one.
    pushes = table.pushes.copy()
    a, b = (int(i) for i in np.flatnonzero(pushes["peer"] == pushes["peer"][0])[:2])
    pushes["dst_region"][[a, b]] = pushes["dst_region"][[b, a]]
    with pytest.raises(InvariantViolation, match="writes bytes no demand maps") as wrong:
        validate_routing_table(replace(table, pushes=pushes))
    assert f"push #{a} " in str(wrong.value) or f"push #{b} " in str(wrong.value)


@pytest.mark.parametrize("block", [1 << 20, 3, 1])
def test_sub_row_strided_write_with_wrong_source_bytes(block: int, monkeypatch) -> None:
    """TP2 on dim 1 and TP4 on dim 2 of one tensor: the TP2 ranks receive writes strided by
    the object's pitch inside one demand row. Such writes are accepted only when they carry
    the bytes the demand maps there: swapping the sources of two of them is refused."""
    specs = [Spec("t", (3, 6, 4), kind="split", dim=1)]
    workers = [Worker(f"a{r}", "n0", "a", r) for r in range(2)]
    workers += [Worker(f"b{r}", "n0", "b", r) for r in range(4)]
    demand = DirectDemand.of(
        {w.worker_id: parts(specs, 2)[w.tp_rank] for w in workers[:2]}
        | {w.worker_id: parts(specs, 4, dims={"t": 2})[w.tp_rank] for w in workers[2:]}
    )
    t = plan_routing(manifest(specs), Topology.of(workers), demand)
    row = t.demands[t.demands["worker"] == 0][0]  # a0: 24-byte rows, 48 apart
    sub_row = np.flatnonzero(
        (t.reads["worker"] == 0)
        & (t.reads["count"] > 1)
        & (t.reads["dst_stride"] < row["dst_stride"])
        & (t.reads["dst_region"] == row["dst_region"])
    )
    assert len(sub_row) >= 2
    i, j = (int(x) for x in sub_row[:2])
    swapped = corrupt(t, "reads", i, src_offset=int(t.reads[j]["src_offset"]))
    swapped = corrupt(swapped, "reads", j, src_offset=int(t.reads[i]["src_offset"]))
    monkeypatch.setattr(validate, "CONTENT_BLOCK", block)  # one block, or several
    validate_routing_table(t)
    rejects(swapped, rf"read #{min(i, j)} .* writes bytes no demand maps")


def test_the_first_broken_check_is_raised_though_later_ones_run_beside_it(table):
    """Provenance and content run on other threads; their verdicts never pre-empt an
    earlier check's (the table below breaks region bounds and provenance)."""
    source = int(table.pushes[0]["src_offset"]) + 1
    rejects(corrupt(table, "pushes", 0, src_offset=source), "sends bytes no earlier write landed")
    both = corrupt(table, "pushes", 0, src_offset=source, dst_offset=1 << 40)
    rejects(both, "runs past the end of region")


@pytest.fixture(scope="module")
def pulled_per_node():
    """The fixture's engines with a pull per node: each node reads the whole model."""
    ps = parts(SPECS, 2)
    workers = [Worker(f"i{i}r{r}", f"n{i}", f"i{i}", r) for i in range(2) for r in range(2)]
    demand = DirectDemand.of({w.worker_id: ps[w.tp_rank] for w in workers})
    return plan_routing(
        manifest(SPECS), Topology.of(workers), demand, params=PlanParams(pull="node")
    )


def test_an_unknown_pull_is_refused_by_name():
    with pytest.raises(InvariantViolation, match=r"pull must be one of single, node .* 'gpu'"):
        PlanParams(pull="gpu")


def test_a_pull_per_node_is_checked_per_node(table, pulled_per_node):
    t = pulled_per_node
    validate_routing_table(t)
    nodes = t.worker_node[t.reads["worker"]]
    assert sorted(set(nodes.tolist())) == [0, 1]
    # The same table claiming one pull for the fleet reads every byte twice.
    rejects(replace(t, params=PlanParams()), "single-pull violated: read #.* read the same bytes")
    # A node reading a byte twice is refused, even though the other node reads it too.
    i = int(np.flatnonzero(nodes == 0)[0])
    r = t.reads[i : i + 1].copy()
    r["dst_region"] = 0
    staged = np.zeros(1, t.region_sizes.dtype)
    staged[0] = (r["worker"][0], 0, 1 << 20)
    doubled = replace(
        t,
        reads=np.sort(np.concatenate([t.reads, r]), order=["worker", "batch"], kind="stable"),
        region_sizes=np.concatenate([t.region_sizes, staged]),
    )
    rejects(doubled, "single-pull violated: .* read the same bytes")
    # A node that leaves its share to the other node's read is refused: its total is short.
    rejects(replace(table, params=PlanParams(pull="node")), "single-pull violated: reads on node")
