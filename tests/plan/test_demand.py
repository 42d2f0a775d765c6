"""Declarations: destinations, direct demands and plan parameters validate their input."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan import (
    Destinations,
    DirectDemand,
    PlanParams,
    Topology,
    Worker,
    plan_routing,
)

from .helpers import Spec, manifest, parts

SPECS = [Spec("a", (8, 4), kind="split", dim=0), Spec("b", (4,))]


def test_destinations_validate():
    with pytest.raises(InvariantViolation, match="unknown region"):
        Destinations.of({"r": 8}, {"f": ("s", 0)})
    with pytest.raises(InvariantViolation, match="positive size"):
        Destinations.of({"r": 0}, {})
    with pytest.raises(InvariantViolation, match="bad destination region name"):
        Destinations.of({"staging": 8}, {})


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
