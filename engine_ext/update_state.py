"""One worker's pending update, from prepare until commit or abort drops it.

Prepare fills it (the staging arena and its regions, the routing slice or a reception, the
session and the stages it declares, the update lease); each apply stage runs on its stage
thread and counts itself in ``ran``; ``expect`` keeps the post-landing check's reference;
commit lands from it. Commit, abort or a rebuild then drop it (registrations rolled back,
advertisement withdrawn) and release its update lease, commit once the serving lease moved
onto the generation; a newer prepare replaces it. The arena and a reception's buffer
outlive it, reused by the next update while the layout fits.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from engine_ext.admission import PeerBook, withdraw
from engine_ext.leases import lease_id, update_lease_id
from engine_ext.served import ServedRecord
from engine_ext.transport import Membership, Reception
from mooncake_rl.apply.wire import WorkerSlice
from mooncake_rl.apply.worker import ApplyWorker
from mooncake_rl.generations.leases import LeaseBook, lease_book
from mooncake_rl.protocol import PrepareRequest
from mooncake_rl.settings import Settings

if TYPE_CHECKING:
    from engine_ext.adapting import BuiltAdapter
    from engine_ext.delta import DeltaReception
    from engine_ext.landing import LandingCheck


class UpdateState:
    """One worker's pending update: its data-plane endpoint, staged regions, and how far
    the update's session got (``stages`` declared at prepare, ``ran`` of them in order)."""

    def __init__(self, worker_id: str) -> None:
        self.apply = ApplyWorker(Settings().with_overrides(segment_bytes=0), worker_id)
        self.arena: torch.Tensor | None = None
        self.sizes: dict[str, int] = {}
        # The arena's region order (``copied_into_order``): a change re-lays the arena out.
        self.order: list[str] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.slice: WorkerSlice | None = None
        # Live parameters received in place (direct mode), by region name.
        self.in_place: dict[str, torch.Tensor] = {}
        self.mode: str | None = None
        self.layout: list[dict[str, Any]] = []
        self.fallback: list[dict[str, Any]] = []
        self.generation: int | None = None
        self.record = ServedRecord()
        self.session: str | None = None
        self.stages = 0
        self.ran = 0
        self.peers: PeerBook | None = None
        # The post-landing check's reference, built once every stage ran (``expect``).
        self.check: LandingCheck | None = None
        # The Store path's staging canary (``engine_ext.written``): what unwritten bytes hold.
        self.canary: int | None = None
        # A broadcast or CPU-serialized delivery (instead of a routing slice); its buffer is
        # kept for the next one while the size fits.
        self.reception: Reception | None = None
        # A delta taken in place (``engine_ext.delta``): its reads, fetched changes, checksums.
        self.delta: DeltaReception | None = None
        # An adapter generation built for commit (``engine_ext.adapting``).
        self.adapter: BuiltAdapter | None = None
        self.received: torch.Tensor | None = None
        self.membership = Membership()
        # The last apply stage started, moving bytes on its own thread; ``collect`` answers
        # with its reply (again, until the next stage: TP ranks end at different polls).
        self.stage_runner = ThreadPoolExecutor(1, thread_name_prefix=f"mooncake-{worker_id}")
        self.running: Future[dict[str, Any]] | None = None
        # The update lease this worker wrote at prepare (``engine_ext.leases``): its book
        # and holder, until commit or abort releases it.
        self.lease: tuple[LeaseBook, str] | None = None

    def lease_update(self, engine_id: str, call: PrepareRequest) -> None:
        """Lease the generation this update brings, before anything reads it."""
        book = lease_book(self.apply.store, call.model)
        holder = update_lease_id(engine_id)
        book.renew(holder, call.generation, self.apply.settings.lease_ttl_s)
        self.lease = (book, holder)

    def end_lease(self, serving: tuple[str, int] | None = None) -> None:
        """Release the update lease; ``serving``: (engine id, generation) commit landed, onto
        which the serving lease moves first, so the generation is never unleased."""
        if self.lease is None:
            return
        book, holder = self.lease
        if serving is not None:
            engine_id, generation = serving
            book.renew(lease_id(engine_id), generation, self.apply.settings.lease_ttl_s)
        book.release(holder)
        self.lease = None

    @property
    def pending(self) -> bool:
        return (
            self.slice is not None
            or self.reception is not None
            or self.delta is not None
            or self.adapter is not None
        )

    def settle(self, keep: bool = False) -> None:
        """Wait out a running stage: nothing may deregister or reuse staging while a stage
        still writes it. Its reply is forgotten (the session is ending) unless ``keep``."""
        if self.running is not None:
            wait([self.running])
            if not keep:
                self.running = None

    def drop(self) -> None:
        """Forget the pending update: registrations rolled back, advertisement withdrawn."""
        self.settle()
        self.apply.rollback()
        if self.session is not None and self.slice is not None:  # a Store-path advert
            withdraw(self.apply.store, self.session, self.apply.worker_id)
        self.slice = self.generation = self.session = self.peers = self.reception = None
        self.delta = self.adapter = None
        self.check = self.canary = None
        self.stages = self.ran = 0
        self.in_place = {}
