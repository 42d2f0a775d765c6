"""Reader assignment: exactly one reader per range, balancing every node's NIC bytes.

A node's NIC load is the bytes its workers read from the Store plus the bytes they push to
other nodes; intra-node pushes ride local transports and cost nothing. A range consumed on
k nodes costs its reader's node ``k * length`` wherever it is read, so the assignment only
chooses *where*: the least-loaded node among those that consume the range, then its
least-loaded consuming worker (the read lands straight in that worker's destination).
Ranges longer than ``split_bytes`` are cut first, so one wide tensor spreads over several
readers. Greedy in decreasing cost, ties broken by name: deterministic, and the busiest
node exceeds the mean by at most one piece's cost when every node consumes everything.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan.merge import SourceRange


@dataclass(frozen=True)
class Topology:
    """Rollout workers and the node label each one runs on."""

    node_of: Mapping[str, str]

    def __post_init__(self) -> None:
        if not self.node_of or any(not w or not n for w, n in self.node_of.items()):
            raise InvariantViolation("topology needs workers with node labels")

    @property
    def nodes(self) -> list[str]:
        return sorted(set(self.node_of.values()))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(sorted(self.node_of.items())).encode()).hexdigest()


@dataclass(frozen=True)
class Assignment:
    range: SourceRange
    reader: str


def split_ranges(ranges: Iterable[SourceRange], split_bytes: int) -> list[SourceRange]:
    if split_bytes <= 0:
        raise InvariantViolation("split_bytes must be positive")
    pieces = []
    for source in ranges:
        for start in range(source.start, source.start + source.length, split_bytes):
            pieces.append(
                source.piece(start, min(split_bytes, source.start + source.length - start))
            )
    return pieces


def assign_readers(
    ranges: Iterable[SourceRange], topology: Topology, split_bytes: int
) -> list[Assignment]:
    node_load = dict.fromkeys(topology.nodes, 0)
    worker_load: dict[str, int] = dict.fromkeys(topology.node_of, 0)
    pieces = split_ranges(ranges, split_bytes)

    def fan_out_nodes(piece: SourceRange) -> list[str]:
        return sorted({topology.node_of[c.worker] for c in piece.consumers})

    order = sorted(pieces, key=lambda p: (-p.length * len(fan_out_nodes(p)), p.obj, p.start))
    assignments = []
    for piece in order:
        nodes = fan_out_nodes(piece)
        node = min(nodes, key=lambda n: (node_load[n], n))
        local = sorted({c.worker for c in piece.consumers if topology.node_of[c.worker] == node})
        reader = min(local, key=lambda w: (worker_load[w], w))
        node_load[node] += piece.length * len(nodes)
        worker_load[reader] += piece.length
        assignments.append(Assignment(piece, reader))
    assignments.sort(key=lambda a: (a.range.obj, a.range.start))
    return assignments


def nic_bytes(assignments: Iterable[Assignment], topology: Topology) -> dict[str, int]:
    load = dict.fromkeys(topology.nodes, 0)
    for assignment in assignments:
        nodes = {topology.node_of[c.worker] for c in assignment.range.consumers}
        load[topology.node_of[assignment.reader]] += assignment.range.length * len(nodes)
    return load
