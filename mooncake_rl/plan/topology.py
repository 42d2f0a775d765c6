"""Rollout cluster topology: workers, their nodes, engine instances, and node delegates.

NIC accounting is per node label, so the topology is what turns "bytes pushed" into "bytes
that crossed a NIC". Each node has one delegate: the worker that receives one copy of a
tensor for the whole node in compat mode (and the preferred relay in direct mode).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

from mooncake_rl.errors import InvariantViolation


@dataclass(frozen=True)
class Worker:
    """One rollout worker (one GPU process of an engine).

    ``engine_instance`` groups the workers of one engine (its TP ranks); workers without one
    are single-worker instances. ``tp_rank`` is informative; in direct mode it must agree
    with the rank of the worker's placement part.
    """

    worker_id: str
    node: str
    engine_instance: str | None = None
    tp_rank: int | None = None

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


@dataclass(frozen=True)
class Topology:
    """Workers sorted by id, plus delegate overrides (node -> worker id).

    Without an override a node's delegate is its lowest worker id (string order), so the
    choice is deterministic and survives restarts of other nodes.
    """

    workers: tuple[Worker, ...]
    delegate_overrides: tuple[tuple[str, str], ...] = ()

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
        overrides = dict(self.delegate_overrides)
        if len(overrides) != len(self.delegate_overrides):
            raise InvariantViolation("delegate overrides name a node twice")
        node_of = {w.worker_id: w.node for w in workers}
        for node, worker_id in overrides.items():
            if node_of.get(worker_id) != node:
                raise InvariantViolation(
                    f"delegate override {worker_id} for node {node} is not a worker on that node"
                )
        object.__setattr__(self, "workers", workers)
        object.__setattr__(self, "delegate_overrides", tuple(sorted(overrides.items())))

    @classmethod
    def of(cls, workers: Iterable[Worker], delegates: Mapping[str, str] | None = None) -> Topology:
        return cls(tuple(workers), tuple((delegates or {}).items()))

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
    def delegates(self) -> tuple[int, ...]:
        """Worker index of every node's delegate, in node order."""
        overrides = dict(self.delegate_overrides)
        chosen: dict[str, int] = {}
        for i, w in enumerate(self.workers):
            chosen.setdefault(w.node, i)
        for node, worker_id in overrides.items():
            chosen[node] = self.worker_index[worker_id]
        return tuple(chosen[n] for n in self.nodes)

    def delegate(self, node: str) -> str:
        """Worker id of the delegate of ``node``."""
        if node not in self.node_index:
            raise InvariantViolation(f"unknown node {node}")
        return self.worker_ids[self.delegates[self.node_index[node]]]

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
        """SHA-256 over workers, nodes, instances, ranks and delegates (routing-relevant)."""
        content = {
            "schema": "mooncake-rl/topology/v1",
            "workers": [[w.worker_id, w.node, w.engine_instance, w.tp_rank] for w in self.workers],
            "delegates": [self.worker_ids[i] for i in self.delegates],
        }
        encoded = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(encoded).hexdigest()
