"""Trainer side of one weight sync: every rank publishes its share, rank 0 announces.

VeRL's per-tensor generator is collective (FSDP all-gathers each tensor), so every trainer
rank walks all of it in the same order, also after a failure. Which rank puts which tensor
is the core's byte-balanced assignment over a :class:`TrainerTopology` gathered from
``torch.distributed``. Rank 0 picks the generation number and decides the outcome, and both
are broadcast, so every rank returns or raises the same way. Rank 0 also writes the outcome
as a small Store record keyed by the sync id, which is how the rollout side learns it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mooncake_rl.errors import MooncakeError, MooncakeRLError
from mooncake_rl.generations.assignment import TrainerTopology
from mooncake_rl.generations.chain import DeltaPolicy
from mooncake_rl.generations.keys import model_prefix, payload_key
from mooncake_rl.generations.packing import DEFAULT_PACK_BYTES
from mooncake_rl.generations.publisher import (
    DEFAULT_KEEP,
    GenerationPublisher,
    LastPublished,
    PublishFailed,
    PublishReport,
    abort_generation,
    delta_base,
    finalize_generation,
    start_attempt,
)
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.buckets import this_host_id
from mooncake_rl.transport.group import gpu_uuid

T = TypeVar("T")
logger = logging.getLogger(__name__)
# OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY: the record is absent or its put is still running.
NOT_WRITTEN_YET = (-704, -703)


class CollectiveFailed(MooncakeRLError):
    """A torch.distributed call between trainer ranks failed (a peer died or timed out)."""


class SyncTimedOut(MooncakeRLError):
    """The rollout side saw no outcome for this sync: the trainer never finished it."""


def sync_key(model: str, sync_id: str) -> str:
    """One record per sync, written once by trainer rank 0 (fresh key: puts never overwrite)."""
    return f"{model_prefix(model)}/verl-sync/{sync_id}"


@dataclass(frozen=True)
class SyncOutcome:
    """What trainer rank 0 decided for one sync; every rank and the rollout side see it."""

    sync_id: str
    ok: bool
    generation: int | None
    error: str | None = None
    global_steps: int | None = None
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    train_gpus: tuple[str, ...] = ()
    """The trainer ranks' CUDA UUIDs: the train pool non-Store transports classify by."""
    sender_host: str | None = None
    """Trainer rank 0's address: a broadcast's sender (and its TCP store) runs there."""
    sender_host_id: str | None = None
    """Trainer rank 0's host's boot id: on rollout rank 0's host, an ``auto`` update's CPU
    leg feeds the sender the buckets it read instead of the sender reading them again."""

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> SyncOutcome:
        body = json.loads(data)
        return cls(**{**body, "train_gpus": tuple(body.get("train_gpus", ()))})

    def metrics(self, prefix: str) -> dict[str, float]:
        """Merged by VeRL's manager into the trainer's step metrics (same on every rank)."""
        return {
            f"{prefix}/generation": float(self.generation or 0),
            f"{prefix}/tensors": float(self.tensors),
            f"{prefix}/bytes": float(self.bytes),
            f"{prefix}/publish_s": self.seconds,
        }


def wait_outcome(
    store: StoreClient, model: str, sync_id: str, timeout_s: float, poll_s: float = 0.05
) -> SyncOutcome:
    """Rollout side: poll until trainer rank 0 wrote this sync's outcome."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return SyncOutcome.decode(store.get_bytes(sync_key(model, sync_id)))
        except MooncakeError as error:
            if error.code not in NOT_WRITTEN_YET:
                raise
        if time.monotonic() >= deadline:
            raise SyncTimedOut(f"no outcome for sync {sync_id} of {model} within {timeout_s}s")
        time.sleep(poll_s)


class Collective:
    """The trainer's default torch.distributed group, or a single process without one."""

    def __init__(self) -> None:
        self.initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.initialized else 0
        self.world_size = dist.get_world_size() if self.initialized else 1

    def gather(self, value: T) -> list[T]:
        if self.world_size == 1:
            return [value]
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, value)
        except Exception as error:  # gloo and NCCL raise RuntimeError subclasses
            raise CollectiveFailed(f"all_gather_object on rank {self.rank}: {error}") from error
        return out

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank."""
        if self.world_size == 1:
            return value
        box: list[Any] = [value]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as error:
            raise CollectiveFailed(f"broadcast_object_list on rank {self.rank}: {error}") from error
        return box[0]


def _tracked(
    weights: Iterable[tuple[str, torch.Tensor]], errors: list[str], rank: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights, ending early (and noting why) if the producer raises."""
    iterator = iter(weights)
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except Exception as error:  # the trainer's generator failed: this sync is lost
            errors.append(f"rank {rank}: weight iterator raised {type(error).__name__}: {error}")
            return
        yield item


class TrainerSync:
    """One trainer rank's part of one sync: ``begin``, ``publish``, ``conclude``.

    ``begin`` and ``conclude`` run collectives and must run on the thread that owns the
    trainer's device and process group; ``publish`` only does Store I/O and may run in a
    worker thread while the weights are produced elsewhere.
    """

    def __init__(
        self,
        store: StoreClient,
        model: str,
        dtype: str,
        sync_id: str,
        *,
        collective: Collective,
        global_steps: int | None = None,
        timeout_s: float = 600.0,
        replica_num: int = 1,
        keep: int | None = DEFAULT_KEEP,
        pack_bytes: int = DEFAULT_PACK_BYTES,
        delta: DeltaPolicy | None = None,
        kept: LastPublished | None = None,
    ) -> None:
        self.store, self.model, self.dtype, self.sync_id = store, model, dtype, sync_id
        self.pack_bytes = pack_bytes
        self.delta, self.kept = delta, kept
        self.collective = collective
        self.global_steps = global_steps
        self.timeout_s = timeout_s
        self.replica_num, self.keep = replica_num, keep
        self._attempt: str | None = None  # rank 0: the attempt its claim names
        self.publisher: GenerationPublisher | None = None
        self.report: PublishReport | None = None
        self.errors: list[str] = []
        self.train_gpus: tuple[str, ...] = ()
        self._started = time.monotonic()

    @property
    def rank(self) -> int:
        return self.collective.rank

    def begin(self) -> int:
        """Agree on node labels and the generation number; raises on every rank alike."""
        proposal: tuple[int | None, str | None, tuple[int, int] | None] = (None, None, None)
        try:
            ranks = self.collective.gather((self.store.settings.node, gpu_uuid()))
            nodes = [node for node, _ in ranks]
            self.train_gpus = tuple(gpu for _, gpu in ranks if gpu is not None)
            if self.rank == 0:
                try:
                    base = delta_base(self.store, self.model, self.delta)
                    generation, self._attempt = start_attempt(self.store, self.model)
                    proposal = (generation, None, base)
                except MooncakeRLError as error:
                    proposal = (None, f"rank 0 could not pick a generation: {error}", None)
            generation, problem, base = self.collective.broadcast(proposal)
        except CollectiveFailed as error:
            generation, problem, base = None, str(error), None
        if generation is None:
            message = f"no generation started: {problem}"
            self._record(SyncOutcome(self.sync_id, False, None, message, self.global_steps))
            raise PublishFailed(message)
        self.publisher = GenerationPublisher(
            self.store,
            self.model,
            generation,
            self.rank,
            TrainerTopology(tuple(nodes)),
            self.dtype,
            replica_num=self.replica_num,
            attempt=self._attempt,
            pack_bytes=self.pack_bytes,
            delta_base=None if base is None else (base[0], base[1]),
            kept=self.kept,
        )
        return generation

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Put this rank's share; never raises (failures are settled in ``conclude``)."""
        assert self.publisher is not None, "begin() first"
        try:
            self.report = self.publisher.publish(_tracked(weights, self.errors, self.rank))
        except Exception as error:  # e.g. the report could not be written
            self.errors.append(f"rank {self.rank}: publish failed: {type(error).__name__}: {error}")

    def conclude(self) -> SyncOutcome:
        """Rank 0 announces or aborts; the outcome reaches every rank and the Store.

        A rank that loses contact with rank 0 raises :class:`CollectiveFailed` (it cannot
        know the outcome); rank 0 always knows it, since it decided it.
        """
        assert self.publisher is not None, "begin() first"
        local = (self.errors, self.report.put_bytes if self.report else 0)
        try:
            statuses = self.collective.gather(local)
        except CollectiveFailed as error:
            if self.rank != 0:
                raise
            statuses = [([str(error)], 0)]
        decided = self._decide(statuses) if self.rank == 0 else None
        try:
            outcome = self.collective.broadcast(decided)
        except CollectiveFailed:
            if decided is None:
                raise
            outcome = decided
        assert outcome is not None
        if not outcome.ok:
            # What this rank wrote is garbage now; rank 0 already removed what it iterated.
            names = (s.name for s in self.publisher.specs)
            self.store.remove([payload_key(self.publisher.group, n) for n in names], force=True)
        return outcome

    def _decide(self, statuses: list[tuple[list[str], int]]) -> SyncOutcome:
        assert self.publisher is not None and self.rank == 0
        generation = self.publisher.generation
        errors = [message for messages, _ in statuses for message in messages]
        if errors or self.report is None:
            abort_generation(self.store, self.model, generation, self.publisher.attempt or "")
            problem = "; ".join(errors) or "rank 0 wrote no report"
        else:
            try:
                finalize_generation(
                    self.publisher, self.report, timeout_s=self.timeout_s, keep=self.keep
                )
                problem = None
            except MooncakeRLError as error:  # PublishFailed (already aborted) or Store I/O
                problem = None if self._is_active(generation) else str(error)
        outcome = SyncOutcome(
            self.sync_id,
            problem is None,
            generation,
            None if problem is None else f"generation {generation} not announced: {problem}",
            self.global_steps,
            len(self.publisher.specs),
            sum(put for _, put in statuses),
            round(time.monotonic() - self._started, 4),
            self.train_gpus,
            self.store.settings.hostname,
            this_host_id(),
        )
        self._record(outcome)
        return outcome

    def _is_active(self, generation: int) -> bool:
        """Announce flips the active record before its last write: trust the Store."""
        try:
            record = GenerationRegistry(self.store, self.model).active()
        except MooncakeRLError:
            return False
        return record is not None and record.generation == generation

    def _record(self, outcome: SyncOutcome) -> None:
        """Rank 0 only. Best effort: without it the rollout side times out, nothing worse."""
        if self.rank != 0:
            return
        try:
            self.store.put_bytes(sync_key(self.model, self.sync_id), outcome.encode())
        except MooncakeRLError as error:
            logger.warning("could not record the outcome of sync %s: %s", self.sync_id, error)
