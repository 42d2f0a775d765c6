"""Consume-side planning: pure, deterministic functions from (generation manifest, demands,
topology) to a routing table that reads every demanded byte from the Store exactly once
(or, with ``PlanParams(pull="node")``, once per rollout node that consumes it).

Public API (what the apply pipeline uses):
``plan_routing`` -> ``RoutingTable`` (cached in a ``PlanCache``), ``bind`` -> keys for one
generation, ``validate_routing_table`` (prepare), and the declarations ``Worker``,
``Topology``, ``CompatDemand``, ``DirectDemand``, ``Destinations``, ``PlanParams``.
"""

from mooncake_rl.generations.keys import payload_key as object_key
from mooncake_rl.plan.cache import PlanCache, PlanKey
from mooncake_rl.plan.demand import (
    COMPAT_REGION,
    STAGING_REGION,
    CompatDemand,
    CompatLayout,
    Destinations,
    DirectDemand,
    compat_layout,
)
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.planner import plan_key, plan_routing
from mooncake_rl.plan.source import source_digest, source_layout
from mooncake_rl.plan.table import (
    DEMAND_DTYPE,
    PUSH_DTYPE,
    READ_DTYPE,
    REGION_DTYPE,
    BoundRoutingTable,
    RecordBatch,
    RoutingTable,
    Totals,
    bind,
)
from mooncake_rl.plan.topology import Topology, Worker
from mooncake_rl.plan.validate import validate_routing_table

__all__ = [
    "COMPAT_REGION",
    "DEMAND_DTYPE",
    "PUSH_DTYPE",
    "READ_DTYPE",
    "REGION_DTYPE",
    "STAGING_REGION",
    "BoundRoutingTable",
    "CompatDemand",
    "CompatLayout",
    "Destinations",
    "DirectDemand",
    "PlanCache",
    "PlanKey",
    "PlanParams",
    "RecordBatch",
    "RoutingTable",
    "Topology",
    "Totals",
    "Worker",
    "bind",
    "compat_layout",
    "object_key",
    "plan_key",
    "plan_routing",
    "source_digest",
    "source_layout",
    "validate_routing_table",
]
