"""Rollout cluster topology: workers, their nodes and engine instances.

NIC accounting is per node label, so the topology is what turns "bytes pushed" into "bytes
that crossed a NIC". Which worker of a node relays a chunk is the router's choice
(``route.py`` spreads relays over the node's GPUs), not part of the topology.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

from mooncake_rl.errors import InvariantViolation


@dataclass(frozen=True)
class Worker:
    """One rollout worker (one GPU process of an engine).

    ``engine_instance`` groups the workers of one engine (its TP ranks); workers without one
    are single-worker instances. ``tp_rank`` is informative; in direct mode it must agree
    with the rank of the worker's placement part. ``segment``: the Mooncake Store segment on
    the worker's node, if any (its client's local segment); objects announced in it are read
    on this node without crossing a NIC (locality hints).
    """

    worker_id: str
    node: str
    engine_instance: str | None = None
    tp_rank: int | None = None
    segment: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise InvariantViolation(f"worker_id must be a non-empty string: {self.worker_id!r}")
        if not isinstance(self.node, str) or not self.node:
            raise InvariantViolation(f"worker {self.worker_id} needs a node label")
        if self.engine_instance is not None and (
            not isinstance(self.engine_instance, str) or not self.engine_instance
        ):
            raise InvariantViolation(f"worker {self.worker_id}: bad engine_instance")
        if self.tp_rank is not None and (type(self.tp_rank) is not int or self.tp_rank < 0):
            raise InvariantViolation(f"worker {self.worker_id}: bad tp_rank {self.tp_rank!r}")
        if self.segment is not None and (not isinstance(self.segment, str) or not self.segment):
            raise InvariantViolation(f"worker {self.worker_id}: bad segment {self.segment!r}")


@dataclass(frozen=True)
class Topology:
    """Workers, sorted by id."""

    workers: tuple[Worker, ...]

    def __post_init__(self) -> None:
        workers = tuple(sorted(self.workers, key=lambda w: w.worker_id))
        if not workers:
            raise InvariantViolation("topology has no workers")
        if not all(isinstance(w, Worker) for w in workers):
            raise InvariantViolation("topology workers must be Worker values")
        ids = [w.worker_id for w in workers]
        duplicate = next((a for a, b in pairwise(ids) if a == b), None)
        if duplicate is not None:
            raise InvariantViolation(f"duplicate worker id {duplicate}")
        homes: dict[str, str] = {}
        for w in workers:
            if w.segment is not None and homes.setdefault(w.segment, w.node) != w.node:
                raise InvariantViolation(
                    f"segment {w.segment} is on node {homes[w.segment]} and on node {w.node}"
                )
        object.__setattr__(self, "workers", workers)

    @classmethod
    def of(cls, workers: Iterable[Worker]) -> Topology:
        return cls(tuple(workers))

    @cached_property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(w.worker_id for w in self.workers)

    @cached_property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({w.node for w in self.workers}))

    @cached_property
    def worker_index(self) -> dict[str, int]:
        return {w.worker_id: i for i, w in enumerate(self.workers)}

    @cached_property
    def node_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.nodes)}

    @cached_property
    def worker_node(self) -> tuple[int, ...]:
        """Node index of every worker, in worker order."""
        return tuple(self.node_index[w.node] for w in self.workers)

    @cached_property
    def segment_node(self) -> dict[str, int]:
        """Node index of every segment a worker declared."""
        return {w.segment: self.node_index[w.node] for w in self.workers if w.segment}

    @cached_property
    def instances(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(instance id, worker indices) sorted by instance id; lone workers are instances."""
        groups: dict[str, list[int]] = {}
        for i, w in enumerate(self.workers):
            key = w.engine_instance if w.engine_instance is not None else f"worker:{w.worker_id}"
            groups.setdefault(key, []).append(i)
        return tuple((k, tuple(v)) for k, v in sorted(groups.items()))

    @cached_property
    def digest(self) -> str:
        """SHA-256 over workers, nodes, instances, ranks and segments (routing-relevant)."""
        content = {
            "schema": "mooncake-rl/topology/v2",
            "workers": [
                [w.worker_id, w.node, w.engine_instance, w.tp_rank, w.segment] for w in self.workers
            ],
        }
        encoded = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(encoded).hexdigest()
