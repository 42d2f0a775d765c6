"""Which trainer rank publishes which tensor: deterministic, byte-balanced across nodes.

Every rank folds the same (name, nbytes) sequence through :class:`PublisherLoads` and so
computes the same answer without talking to the others. Each tensor goes to the node with
the fewest bytes so far, then to that node's rank with the fewest bytes; ties break by node
label and rank. Node totals therefore differ by at most the largest single tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mooncake_rl.errors import InvariantViolation


@dataclass(frozen=True)
class TrainerTopology:
    """Trainer ranks ``0..n-1`` and the node label each runs on."""

    nodes_by_rank: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.nodes_by_rank or any(not node for node in self.nodes_by_rank):
            raise InvariantViolation("trainer topology needs at least one rank, each with a node")

    @classmethod
    def single(cls, node: str = "node0") -> TrainerTopology:
        return cls((node,))

    @property
    def world_size(self) -> int:
        return len(self.nodes_by_rank)

    def node_of(self, rank: int) -> str:
        return self.nodes_by_rank[rank]


@dataclass(frozen=True)
class PublisherLoads:
    """Bytes assigned so far per node and per rank; ``assign`` returns the next state."""

    topology: TrainerTopology
    node_bytes: Mapping[str, int] = field(default_factory=dict)
    rank_bytes: Mapping[int, int] = field(default_factory=dict)

    def assign(self, nbytes: int) -> tuple[int, PublisherLoads]:
        if nbytes <= 0:
            raise InvariantViolation(f"tensor size must be positive, got {nbytes}")
        nodes = sorted(set(self.topology.nodes_by_rank))
        node = min(nodes, key=lambda n: (self.node_bytes.get(n, 0), n))
        ranks = [r for r, n in enumerate(self.topology.nodes_by_rank) if n == node]
        rank = min(ranks, key=lambda r: (self.rank_bytes.get(r, 0), r))
        node_bytes = {**self.node_bytes, node: self.node_bytes.get(node, 0) + nbytes}
        rank_bytes = {**self.rank_bytes, rank: self.rank_bytes.get(rank, 0) + nbytes}
        return rank, PublisherLoads(self.topology, node_bytes, rank_bytes)


def assign_publishers(
    sizes: Iterable[tuple[str, int]], topology: TrainerTopology
) -> dict[str, int]:
    """Publisher rank per tensor name, for tensors in collective (iteration) order."""
    loads = PublisherLoads(topology)
    assignment: dict[str, int] = {}
    for name, nbytes in sizes:
        if name in assignment:
            raise InvariantViolation(f"duplicate tensor name {name!r}")
        assignment[name], loads = loads.assign(nbytes)
    return assignment
