"""Declarations: destinations, direct demands and plan parameters validate their input."""

from __future__ import annotations

import itertools
import operator
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan import (
    Destinations,
    DirectDemand,
    PlanParams,
    Topology,
    Worker,
    plan_routing,
)
from mooncake_rl.plan.demand import Box, BoxPart, part_digest
from mooncake_rl.plan.stored import encode_table
from mooncake_rl.plan.targets import _named_regions

from .helpers import Spec, manifest, parts

SPECS = [Spec("a", (8, 4), kind="split", dim=0), Spec("b", (4,))]


def test_destinations_validate():
    with pytest.raises(InvariantViolation, match="unknown region"):
        Destinations.of({"r": 8}, {"f": ("s", 0)})
    with pytest.raises(InvariantViolation, match="positive size"):
        Destinations.of({"r": 0}, {})
    with pytest.raises(InvariantViolation, match="bad destination region name"):
        Destinations.of({"staging": 8}, {})


@pytest.mark.parametrize(
    ("regions", "fragments", "message"),
    [
        ({"a": 8, "": 8}, {}, "bad destination region name ''"),
        ({"a": 8, 3: 8}, {}, "bad destination region name 3"),
        ({"a": 8, "b": True}, {}, "region b needs a positive size, got True"),
        ({"a": 8, "b": 8.0}, {}, "region b needs a positive size, got 8.0"),
        ({"a": 8, "b": -1}, {}, "region b needs a positive size, got -1"),
        ({"a": 8}, {"f0": ("a", 0), "f1": ("b", 0)}, "fragment f1 maps to unknown region b"),
        ({"a": 8}, {"f0": ("a", 0), "f1": ("a", -4)}, "fragment f1 has bad base offset -4"),
        ({"a": 8}, {"f0": ("a", 0), "f1": ("a", False)}, "fragment f1 has bad base offset False"),
        ({"a": 8}, {"f0": ("a", 0), "f1": ("a", 2.0)}, "fragment f1 has bad base offset 2.0"),
        ({"a": 8}, {"f0": ("a", 0), 7: ("a", 0)}, "placement fragment id 7 is not a string"),
    ],
)
def test_destinations_name_the_first_bad_entry_among_good_ones(regions, fragments, message):
    with pytest.raises(InvariantViolation, match=re.escape(message)):
        Destinations.of(regions, fragments)


def test_destinations_must_fit_cover_and_not_overlap():
    ps = parts(SPECS, 1)
    ids = {f.tensor_id: f.placement_fragment_id for f in ps[0].fragments}
    topology = Topology.of([Worker("w", "n")])
    m = manifest(SPECS)

    def plan(regions, placed):
        demand = DirectDemand.of({"w": ps[0]}, {"w": Destinations.of(regions, placed)})
        return plan_routing(m, topology, demand)

    with pytest.raises(InvariantViolation, match="does not fit region"):
        plan({"p": 70}, {ids["a"]: ("p", 0), ids["b"]: ("p", 64)})
    with pytest.raises(InvariantViolation, match="no destination for placement fragment"):
        plan({"p": 72}, {ids["a"]: ("p", 0)})
    with pytest.raises(InvariantViolation, match="demands overlap"):
        plan({"p": 72}, {ids["a"]: ("p", 0), ids["b"]: ("p", 60)})
    table = plan({"p": 80}, {ids["a"]: ("p", 8), ids["b"]: ("p", 0)})
    assert sorted(int(r["dst_offset"]) for r in table.reads) == [0, 8]


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ((("a",), (8, 8)), "destination columns must have equal lengths"),
        ((("a",), (8,), ("f0", "f1"), ("a",), (0, 0)), "destination columns must have equal"),
        ((("a", "a"), (8, 8)), "destinations declare a region twice"),
        ((("a",), (8,), ("f", "f"), ("a", "a"), (0, 4)), "map a placement fragment twice"),
    ],
)
def test_destination_columns_that_disagree_are_refused(columns, message):
    with pytest.raises(InvariantViolation, match=message):
        Destinations(*columns)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_destinations_listed_in_any_order_give_one_digest_and_one_table(order):
    """A plan key's destination digest ignores the order an engine lists its regions and
    fragments in, so the table planned for that key must not depend on it either."""
    ps = parts(SPECS, 1)
    ids = {f.tensor_id: f.placement_fragment_id for f in ps[0].fragments}
    regions = [("ra", 4096), ("rb", 4096), ("unused", 8)]
    fragments = [(ids["a"], "ra", 64), (ids["b"], "rb", 0)]
    listed = [regions[i] for i in order]
    landing = fragments[::-1] if order[0] % 2 else fragments
    columns = [*zip(*listed, strict=True), *zip(*landing, strict=True)]
    dest = Destinations(*map(tuple, columns))
    baseline = Destinations.of(dict(regions), {f: (r, b) for f, r, b in fragments})
    assert dest.digest == baseline.digest
    topology = Topology.of([Worker("w", "n")])
    tables = [
        plan_routing(manifest(SPECS), topology, DirectDemand.of({"w": ps[0]}, {"w": d}))
        for d in (baseline, dest)
    ]
    assert encode_table(tables[0]).tobytes() == encode_table(tables[1]).tobytes()
    assert dest.region_names == ("ra", "rb", "unused")


def test_direct_demand_validates_parts_and_digest_is_generation_free():
    ps = parts(SPECS, 2)
    with pytest.raises(InvariantViolation, match="two placement parts"):
        DirectDemand((("w", ps[0]), ("w", ps[1])))
    with pytest.raises(InvariantViolation, match="without a part"):
        DirectDemand.of({"w": ps[0]}, {"x": Destinations.of({"r": 8}, {})})
    regenerated = [
        replace(p, weight_generation=9, participant_id=f"other{r}") for r, p in enumerate(ps)
    ]
    one = DirectDemand.of({"w0": ps[0], "w1": ps[1]})
    two = DirectDemand.of({"w0": regenerated[0], "w1": regenerated[1]})
    assert one.digest == two.digest
    assert DirectDemand.of({"w0": ps[1], "w1": ps[0]}).digest != one.digest


def test_tp_rank_must_agree_with_the_part():
    ps = parts(SPECS, 2)
    topology = Topology.of([Worker("w0", "n", "i", 1), Worker("w1", "n", "i", 0)])
    with pytest.raises(InvariantViolation, match="tp_rank 1 != part rank"):
        plan_routing(manifest(SPECS), topology, DirectDemand.of({"w0": ps[0], "w1": ps[1]}))


def test_params_validate():
    with pytest.raises(InvariantViolation, match="batch_bytes"):
        PlanParams(batch_bytes=0)
    with pytest.raises(InvariantViolation, match="balance_slack"):
        PlanParams(balance_slack=0.0)


def _as_boxes(part) -> BoxPart:
    return BoxPart(
        part.rank,
        part.tensors,
        tuple(
            Box(f.placement_fragment_id, f.tensor_id, f.global_offset, f.local_shape, f.nbytes)
            for f in part.fragments
        ),
    )


def test_a_box_part_digests_and_plans_exactly_as_its_contract_part():
    contract = parts(SPECS, 2, pieces=True)
    boxed = [_as_boxes(p) for p in reversed(contract)][::-1]  # any box order in
    assert [part_digest(p) for p in boxed] == [part_digest(p) for p in contract]
    topology = Topology.of([Worker("w0", "n0", "i", 0), Worker("w1", "n1", "i", 1)])
    m = manifest(SPECS)
    tables = [
        plan_routing(m, topology, DirectDemand.of({"w0": ps[0], "w1": ps[1]}))
        for ps in (contract, boxed)
    ]
    assert encode_table(tables[0]).tobytes() == encode_table(tables[1]).tobytes()


def test_ranks_reusing_box_ids_plan_as_ranks_with_their_own_ids():
    """Box ids are a rank's own names, and ranks may reuse them (``a/0``: the first box of
    ``a``, on every rank). Such ids are numbered at their first row, and the plan is the
    plan of ids named per rank, region for region. An id that means boxes of two sizes on
    two ranks is refused by name (each worker's region of that id has one size)."""
    contract = parts(SPECS, 2, pieces=True)
    topology = Topology.of([Worker("w0", "n0", "i", 0), Worker("w1", "n1", "i", 1)])
    own = {"w0": _as_boxes(contract[0]), "w1": _as_boxes(contract[1])}

    def reused(name):
        out, renamed = {}, {}
        for worker, part in own.items():
            boxes = sorted(part.fragments, key=lambda b: (b.tensor_id, b.global_offset))
            names = [name(worker, boxes.index(b), b) for b in boxes]
            renamed.update(
                {(worker, b.placement_fragment_id): n for b, n in zip(boxes, names, strict=True)}
            )
            out[worker] = BoxPart(
                part.rank,
                part.tensors,
                tuple(
                    b._replace(placement_fragment_id=n) for b, n in zip(boxes, names, strict=True)
                ),
            )
        return out, renamed

    alike, renamed = reused(lambda worker, i, box: f"{box.tensor_id}/{i}")
    assert len(set(renamed.values())) == len(renamed) // 2  # the second rank reuses each id

    def rows(table, names=lambda worker, region: region):
        worker_id = table.workers.__getitem__
        fields = ("dst_offset", "object", "src_offset", "length", "count")
        demands = {
            (
                worker_id(d["worker"]),
                names(worker_id(d["worker"]), table.regions[d["dst_region"]]),
                *(int(d[f]) for f in fields),
            )
            for d in table.demands
        }
        sizes = {
            (
                worker_id(r["worker"]),
                names(worker_id(r["worker"]), table.regions[r["region"]]),
                int(r["size"]),
            )
            for r in table.region_sizes
        }
        return demands, sizes

    m = manifest(SPECS)
    planned = rows(plan_routing(m, topology, DirectDemand.of(alike)))
    expected = rows(
        plan_routing(m, topology, DirectDemand.of(own)), lambda w, r: renamed.get((w, r), r)
    )
    assert planned == expected and len(planned[0]) == 8

    # Rank 1 names its boxes of b as rank 0 names its (larger) boxes of a.
    swapped, _ = reused(lambda worker, i, box: f"f{(i + 2 * (worker == 'w1')) % 4}")
    with pytest.raises(InvariantViolation, match=r"id f\d names boxes of \d+ and \d+ bytes"):
        plan_routing(m, topology, DirectDemand.of(swapped))


def test_a_box_part_refuses_boxes_the_contract_would_refuse():
    part = _as_boxes(parts(SPECS, 2, pieces=True)[0])
    a = next(b for b in part.fragments if b.tensor_id == "a")

    def with_box(box: Box) -> BoxPart:
        return BoxPart(part.rank, part.tensors, (*part.fragments, box))

    cases = {
        "out of bounds": a._replace(placement_fragment_id="x", global_offset=(7, 0)),
        "byte size mismatch": a._replace(placement_fragment_id="x", nbytes=a.nbytes + 1),
        "boxes of a overlap": a._replace(placement_fragment_id="x"),
        "declares box .* twice": a._replace(global_offset=(4, 0)),
        "does not declare": a._replace(placement_fragment_id="x", tensor_id="zzz"),
        "integers >= 0": a._replace(placement_fragment_id="x", global_offset=(-1, 0)),
        "integers >= 1": a._replace(placement_fragment_id="x", local_shape=(1.0, 4)),
        "rank mismatch": a._replace(placement_fragment_id="x", global_offset=(0,)),
    }
    for message, box in cases.items():
        with pytest.raises(InvariantViolation, match=message):
            with_box(box)
    with pytest.raises(InvariantViolation, match="must be TensorDescriptors"):
        BoxPart(part.rank, (*part.tensors, "c"), part.fragments)
    with pytest.raises(InvariantViolation, match="must be Boxes"):
        BoxPart(part.rank, part.tensors, (*part.fragments, tuple(a)))
    with pytest.raises(InvariantViolation, match="tensor b without a box"):
        BoxPart(part.rank, part.tensors, tuple(b for b in part.fragments if b.tensor_id != "b"))


def test_ranks_of_one_instance_must_describe_a_tensor_alike():
    """Equal descriptors may be distinct objects; unequal ones are refused by name."""
    ps = parts(SPECS, 2)
    topology = Topology.of([Worker("w0", "n", "i", 0), Worker("w1", "n", "i", 1)])

    def with_b(part, **changes):
        tensors = tuple(replace(t, **changes) if t.tensor_id == "b" else t for t in part.tensors)
        return replace(part, tensors=tensors)

    equal = DirectDemand.of({"w0": ps[0], "w1": with_b(ps[1])})
    assert with_b(ps[1]).tensors[1] is not ps[0].tensors[1]
    table = plan_routing(manifest(SPECS), topology, equal)
    assert table.totals.unique_demand_bytes == (8 * 4 + 4) * 2  # a and b, bf16
    other = DirectDemand.of({"w0": ps[0], "w1": with_b(ps[1], layout_fingerprint="other")})
    with pytest.raises(InvariantViolation, match="placement tensor descriptor mismatch: b"):
        plan_routing(manifest(SPECS), topology, other)


def test_a_rank_sharing_the_last_ranks_descriptors_does_not_hide_a_later_mismatch():
    """Ranks holding the very descriptor objects of the rank before are merged without a
    second look; a later rank that describes a tensor otherwise is still refused, and the
    shared objects plan the same table as equal copies."""
    ps = parts(SPECS, 4)
    topology = Topology.of([Worker(f"w{r}", "n", "i", r) for r in range(4)])
    shared = replace(ps[1], tensors=ps[0].tensors)
    assert all(map(operator.is_, shared.tensors, ps[0].tensors))
    same = plan_routing(
        manifest(SPECS),
        topology,
        DirectDemand.of({"w0": ps[0], "w1": shared, "w2": ps[2], "w3": ps[3]}),
    )
    copies = plan_routing(
        manifest(SPECS), topology, DirectDemand.of({f"w{r}": ps[r] for r in range(4)})
    )
    assert encode_table(same).tobytes() == encode_table(copies).tobytes()
    tensors = tuple(
        replace(t, layout_fingerprint="other") if t.tensor_id == "b" else t for t in ps[2].tensors
    )
    late = DirectDemand.of(
        {"w0": ps[0], "w1": shared, "w2": replace(ps[2], tensors=tensors), "w3": ps[3]}
    )
    with pytest.raises(InvariantViolation, match="placement tensor descriptor mismatch: b"):
        plan_routing(manifest(SPECS), topology, late)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 12).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.lists(st.integers(0, n - 1), max_size=20), min_size=1, max_size=3),
        )
    )
)
def test_region_names_keep_what_is_used_in_order(case: tuple[int, list[list[int]]]) -> None:
    """``_named_regions`` marks the ids in use instead of sorting them (a 1T MoE's table
    names 4.8M): the names used, staging first, and the ids renumbered densely in the same
    order, exactly as ``np.unique`` would give them."""
    count, columns = case
    names = ["staging", *(f"r{i}" for i in range(1, count))]
    ids = [np.array(column, np.int64) for column in columns]
    used, dense = np.unique(np.concatenate([np.zeros(1, np.int64), *ids]), return_inverse=True)
    kept, *renumbered = _named_regions(names, *ids)
    assert kept == tuple(names[i] for i in used.tolist())
    ends = np.cumsum([len(i) for i in ids])[:-1]
    for got, want in zip(renumbered, np.split(dense[1:], ends), strict=True):
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
