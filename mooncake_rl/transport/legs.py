"""The coordinator's side of the non-Store transports: one update's broadcast and CPU legs.

The coordinator drains, prepares and commits exactly as on the Store path; only the bytes
take another way. Prepare tells each engine how its tensors arrive (its group rank, or CPU
buckets); apply then runs the legs side by side:

- **broadcast**: the group's port is claimed in the Store first; every broadcast engine's
  apply (which joins the group and receives) is sent before the sender starts, and the
  claim is released only once the sender's teardown is acknowledged (its process exited).
- **cpu_serialize**: the coordinator reads the generation once, packs each bucket once, and
  hands it to every CPU engine: a shared-memory file on this host, an HTTP body otherwise.

Any failure takes the Store path's apply-failure route: every engine drops its staging and
serves its old generation.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.generations.registry import ActiveRecord
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.buckets import pack, shm_name, this_host_id, write_shm
from mooncake_rl.transport.claims import PortClaim, PortClaims
from mooncake_rl.transport.cursor import GroupLayout, broadcast_group
from mooncake_rl.transport.group import backend_for
from mooncake_rl.transport.modes import TransportMode
from mooncake_rl.transport.sender import (
    TEARDOWN_S,
    GroupKey,
    KeptSender,
    Sender,
    SenderLauncher,
    SenderProcess,
    SenderSpec,
)
from mooncake_rl.transport.source import Source, prefetched, read_buckets
from mooncake_rl.transport.topology import Classification


class LegFailed(MooncakeRLError):
    """A broadcast or CPU leg did not deliver to every engine of it."""

    def __init__(self, failed: Mapping[str, str]) -> None:
        self.failed = dict(failed)
        super().__init__("; ".join(f"{url}: {why}" for url, why in self.failed.items()))


class Caller(Protocol):
    """What the legs need of the coordinator: one engine call, and a raw bucket upload."""

    def call(self, url: str, path: str, body: Any) -> dict[str, Any]: ...
    def upload(self, url: str, params: Mapping[str, Any], data: bytes) -> dict[str, Any]: ...


def restricted(classification: Classification, kept: Sequence[str]) -> Classification:
    """The classification of the engines still in the update (others failed to prepare)."""
    broadcast = tuple(u for u in classification.broadcast if u in kept)
    return Classification(
        classification.mode,
        {u: classification.legs[u] for u in kept},
        broadcast,
        tuple(u for u in classification.cpu if u in kept),
        classification.per_engine if broadcast else 0,
    )


@dataclass(frozen=True)
class LegPlan:
    """The legs of one update over its current members (re-made when members drop out)."""

    classification: Classification
    source: Source
    group: GroupLayout | None
    port: int | None
    group_name: str
    backend: str
    sender_device: str
    timeout_s: float
    host: str
    key: GroupKey | None = None
    kept: bool = False
    """Whether the group (and its sender) is the one kept from an earlier update."""
    fed: bool = False
    """The CPU leg feeds the sender the buckets it read: the generation is read once."""

    def stages(self, url: str, buckets: int) -> int:
        return 1 if self.classification.legs[url] is TransportMode.BROADCAST else buckets

    def receive(self, url: str) -> dict[str, Any]:
        if self.classification.legs[url] is TransportMode.CPU_SERIALIZE:
            return {"transport": "cpu_serialize", "bucket_bytes": self.source.bucket_bytes}
        assert self.group is not None and self.port is not None
        return {
            "transport": "broadcast",
            "bucket_bytes": self.source.bucket_bytes,
            "group": {
                "host": self.host,
                "port": self.port,
                "world_size": self.group.world_size,
                "rank_offset": self.group.offsets[url],
                "name": self.group_name,
                "backend": self.backend,
                "timeout_s": self.timeout_s,
            },
        }


@dataclass
class LegFigures:
    """Per engine: its transport, the bytes its ranks received, and its seconds."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, url: str, transport: str, nbytes: int, seconds: float) -> None:
        row = self.rows.setdefault(url, {"transport": transport, "bytes": 0, "seconds": 0.0})
        row["bytes"] += nbytes
        row["seconds"] = round(row["seconds"] + seconds, 4)


class TransportLegs:
    """Plan, prepare bodies and apply for the broadcast and CPU legs of one session."""

    def __init__(
        self,
        caller: Caller,
        store: StoreClient,
        settings: Settings,
        record: ActiveRecord,
        classification: Classification,
        placements: Mapping[str, Mapping[str, Any]],
        launcher: SenderLauncher,
        *,
        session: str,
        holder: str,
        bucket_bytes: int,
    ) -> None:
        """``launcher``: where the broadcast sender runs (a child process of this one, or a
        trainer rank met through the Store)."""
        self.caller = caller
        self.store = store
        self.settings = settings
        self.record = record
        self.classification = classification
        self.placements = placements
        self.launcher = launcher
        self.session = session
        self.source = Source.of(record, bucket_bytes)
        self.buckets = 0
        self.figures = LegFigures()
        self.store_read_bytes = 0
        """Read by the CPU leg (this process) and the broadcast sender: each once."""
        self.holder = holder
        self.claim: PortClaim | None = None
        """The port of a new group: renewed from its claim on, through prepare, then while
        the sender lives."""
        self.kept: KeptSender | None = None
        """The sender (group, claim) kept from an earlier update of the same engine set."""
        self.group_name = uuid.uuid4().hex
        self._feed: Future[Sender] = Future()
        """The sender, once started, when the CPU leg feeds it (``LegPlan.fed``)."""

    # -- plan and prepare (driven by Coordinator._prepare) --------------------------------
    def plan_for(self, members: Sequence[str]) -> LegPlan:
        kept = [u for u in self.classification.legs if u in members]
        classification = restricted(self.classification, kept)
        group = None
        if classification.broadcast:
            group = broadcast_group(classification.broadcast, classification.per_engine, kept)
        on_cuda = all(
            str(w.get("device", "cpu")).startswith("cuda")
            for url in classification.broadcast
            for w in self.placements[url].get("workers", [])
        )
        device = self.launcher.device(on_cuda)
        key = None
        if classification.broadcast:
            key = GroupKey(
                tuple((u, self._processes(u)) for u in classification.broadcast),
                classification.per_engine,
                device,
            )
            self._hold_group(key)
        port = self.kept.claim.port if self.kept else self.claim.port if self.claim else None
        return LegPlan(
            classification,
            self.source,
            group,
            port,
            self.kept.name if self.kept else self.group_name,
            backend_for(torch.device(device)),
            device,
            self.settings.broadcast_timeout_s,
            self.launcher.host,
            key,
            self.kept is not None,
            bool(classification.broadcast and classification.cpu and self.launcher.same_host),
        )

    def _processes(self, url: str) -> tuple[str, ...]:
        return tuple(str(w.get("process")) for w in self.placements[url].get("workers", []))

    def _hold_group(self, key: GroupKey) -> None:
        """Take the sender kept for ``key`` (the same engines, processes and device), or
        claim a port for a new group; a kept sender for other members is ended."""
        if self.kept is not None and self.kept.key == key:
            return
        if self.kept is not None:
            self.kept.end()
        keeper = self.launcher.keeper
        self.kept = keeper.take(key) if keeper is not None else None
        if self.kept is None and self.claim is None:
            claims = PortClaims(
                self.store,
                self.launcher.host,
                owner=self.holder,
                lease_s=self.settings.claim_lease_s,
            )
            self.claim = claims.claim(self.settings.rendezvous_port, alive=lambda: True)

    def body_for(self, url: str, plan: LegPlan, base: Mapping[str, Any]) -> dict[str, Any]:
        if not self.buckets:
            layout, _ = read_buckets(self.store, self.source)
            self.buckets = len(layout.buckets)
        return {
            **base,
            "mode": "compat",
            "stages": plan.stages(url, self.buckets),
            "workers": {},
            "receive": plan.receive(url),
        }

    # -- apply -----------------------------------------------------------------------------
    def apply(self, plan: LegPlan) -> None:
        """Run both legs side by side; raise :class:`LegFailed` naming every engine that
        did not receive its whole generation."""
        legs: list[Callable[[], dict[str, str]]] = []
        if plan.classification.broadcast:
            legs.append(lambda: self._broadcast(plan))
        if plan.classification.cpu:
            legs.append(lambda: self._cpu(plan))
        with ThreadPoolExecutor(max_workers=2) as pool:
            failed: dict[str, str] = {}
            for outcome in [pool.submit(leg) for leg in legs]:
                failed.update(outcome.result())
        if failed:
            raise LegFailed(failed)

    def close(self) -> None:
        """Free the port claim of a broadcast that never started a sender; a kept sender
        that was not used goes back to its keeper (its group is intact)."""
        if self.claim is not None:
            self.claim.release()
            self.claim = None
        keeper = self.launcher.keeper
        if self.kept is not None and keeper is not None:
            keeper.keep(self.kept)
        self.kept = None

    def _broadcast(self, plan: LegPlan) -> dict[str, str]:
        assert plan.group is not None and plan.port is not None and plan.key is not None
        engines = list(plan.classification.broadcast)
        body = {"session": self.session, "generation": self.record.generation, "stage": 0}
        started = time.perf_counter()
        failed: dict[str, str] = {}
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            # Receivers first: each apply joins the group (or keeps it) and waits for the
            # sender.
            applies = {
                pool.submit(self.caller.call, url, "apply", {**body, "peers": {}}): url
                for url in engines
            }
            try:
                sender, claim = self._sender(plan)
            except BaseException as error:
                self._feed.set_exception(error)  # the CPU leg reads for itself alone
                raise
            if plan.fed:
                self._feed.set_result(sender)
            pending: set[Future[Any]] = {*applies, sender.future}
            while pending:
                done, pending = wait(pending, return_when="FIRST_COMPLETED")
                for future in done:
                    error = future.exception()
                    if error is None:
                        if future in applies:
                            seconds = time.perf_counter() - started
                            replies = future.result().get("workers", [])
                            nbytes = sum(w.get("received_bytes", 0) for w in replies)
                            url = applies[future]
                            self.figures.add(url, "broadcast", nbytes, seconds)
                            self.figures.rows[url].update(port=plan.port, group_kept=plan.kept)
                        continue
                    failed[applies.get(future, "sender")] = str(error)
                    # Nobody waits out the group timeout for a member that is gone.
                    sender.kill()
        if sender.future.exception() is None:
            self.store_read_bytes += int(sender.future.result().get("read_bytes", 0))
        keeper = self.launcher.keeper
        if not failed and keeper is not None and isinstance(sender, SenderProcess):
            keeper.keep(KeptSender(plan.key, sender, claim, plan.group_name))
        else:
            # A failed group is never reused: its members may be gone.
            sender.kill()
            if not claim.release_after(sender.ended, teardown_timeout_s=TEARDOWN_S):
                sender.kill()
                claim.release_after(sender.ended, teardown_timeout_s=TEARDOWN_S)
        if "sender" in failed:
            # The engines report why they stopped receiving; the sender's reason is the cause.
            cause = failed.pop("sender")
            failed = {u: f"{why} (sender: {cause})" for u, why in failed.items()} or {
                u: f"sender: {cause}" for u in engines
            }
        return failed

    def _sender(self, plan: LegPlan) -> tuple[Sender, PortClaim]:
        """The kept sender, sending this generation, or a new one; this update owns both."""
        assert plan.group is not None and plan.port is not None
        if self.kept is not None:
            kept, self.kept = self.kept, None
            kept.sender.send(self.source, plan.fed)
            return kept.sender, kept.claim
        assert self.claim is not None
        sender = self.launcher.start(
            SenderSpec(
                self.source,
                plan.host,
                plan.port,
                plan.group.world_size,
                plan.group_name,
                plan.timeout_s,
                plan.sender_device,
                plan.fed,
            )
        )
        claim, self.claim = self.claim, None
        claim.hold(sender.alive)
        return sender, claim

    def _cpu(self, plan: LegPlan) -> dict[str, str]:
        engines = list(plan.classification.cpu)
        handoff = {url: self._handoff(url) for url in engines}
        feed = self._feed.result() if plan.fed and self._feed.exception() is None else None
        layout, buckets = read_buckets(self.store, self.source)
        self.store_read_bytes += sum(t.nbytes for t in layout.tensors)
        failed: dict[str, str] = {}
        # The next bucket is read and packed while this one is handed off.
        packed = prefetched((bucket, pack(tensors)) for bucket, tensors in buckets)
        try:
            with ThreadPoolExecutor(len(engines)) as pool, contextlib.closing(packed):
                for bucket, data in packed:
                    self._hand_all(plan, feed, pool, handoff, failed, bucket.index, data)
                    if len(failed) == len(engines) and feed is None:
                        break
        except BaseException:
            if feed is not None:
                feed.kill()  # it would wait for buckets that never come
            raise
        return failed

    def _hand_all(
        self,
        plan: LegPlan,
        feed: Sender | None,
        pool: ThreadPoolExecutor,
        handoff: Mapping[str, str],
        failed: dict[str, str],
        index: int,
        data: bytes,
    ) -> None:
        """One bucket to every CPU engine still receiving (and to a fed sender)."""
        name = shm_name(self.session, index)
        shared = feed is not None or "shm" in handoff.values()
        path = write_shm(name, data) if shared else None
        taken = feed.offer(index, name) if feed is not None else None
        body = {
            "session": self.session,
            "generation": self.record.generation,
            "stage": index,
            "peers": {},
        }
        try:
            calls = {
                pool.submit(self._hand, url, handoff[url], body, name, data): url
                for url in handoff
                if url not in failed
            }
            for call, url in calls.items():
                try:
                    replies, seconds = call.result()
                except Exception as error:
                    failed[url] = str(error)
                    continue
                nbytes = sum(w.get("received_bytes", 0) for w in replies)
                self.figures.add(url, "cpu_serialize", nbytes, seconds)
        finally:
            if taken is not None:  # a sender that fails or wedges fails its own leg
                wait([taken], timeout=plan.timeout_s)
            if path is not None:
                os.unlink(path)

    def _hand(
        self, url: str, handoff: str, body: dict[str, Any], name: str, data: bytes
    ) -> tuple[list[dict[str, Any]], float]:
        """One bucket to one engine; its workers' replies and this engine's own seconds."""
        started = time.perf_counter()
        if handoff == "shm":
            shm = {**body, "bucket": {"shm": name, "nbytes": len(data)}}
            reply = self.caller.call(url, "apply", shm)
        else:
            params = {k: body[k] for k in ("session", "generation", "stage")}
            reply = self.caller.upload(url, params, data)
        return reply.get("workers", []), time.perf_counter() - started

    def _handoff(self, url: str) -> str:
        if self.settings.cpu_handoff != "auto":
            return self.settings.cpu_handoff
        workers = self.placements[url].get("workers", [])
        same = workers and all(w.get("host_id") == this_host_id() for w in workers)
        return "shm" if same and this_host_id() else "http"
