"""A broadcast sender in another process, met through the Store: the VeRL trainer's rank 0.

The coordinator (rollout rank 0) cannot start a process on a trainer node, and the sender
belongs there: trainer rank 0 holds a train-pool GPU, so its NCCL group never holds a
receiver's GPU. Both sides know one slot id (the sync id). The coordinator posts the
sender's spec once it has claimed the port and the receivers are joining; the trainer,
waiting in its ``finalize``, posts a heartbeat from then on, runs the sender, then posts
its outcome. When the update ends the coordinator closes the slot, which also ends the wait
of a trainer that was never needed; the trainer removes the records, or, if its heartbeat
stopped (it died), the coordinator sweeps them. Records are JSON, never pickle.

**Fed through the slot.** Trainer rank 0 and rollout rank 0 often share a host (VeRL puts
both on the first node). There, in an ``auto`` update, the coordinator's CPU leg feeds the
sender as it feeds a child sender: each bucket it read goes to ``/dev/shm`` once, its
``offer`` record names the file, and the sender's ``taken`` record says it read it. The
generation is then read from the Store once, not once per leg.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

from mooncake_rl.errors import MooncakeError, MooncakeRLError, ObjectNotFound
from mooncake_rl.generations.keys import NAMESPACE
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.buckets import this_host_id
from mooncake_rl.transport.sender import Sender, SenderFailed, SenderSpec, send
from mooncake_rl.transport.source import Source

logger = logging.getLogger(__name__)

BEAT_S = 1.0
"""How often a running sender says it is alive."""
STALE_BEATS = 5
"""Heartbeats missed before the coordinator counts the sender as gone."""
POLL_S = 0.05
RECORDS = ("spec", "beat", "outcome", "closed", "offer", "taken")
"""A slot's records; ``beat`` (index 1) moves while its trainer lives, ``closed`` (3) last;
``offer`` and ``taken``: the bucket fed last and the bucket read last."""


def slot_key(slot: str, record: str) -> str:
    return f"{NAMESPACE}/senders/{slot}/{record}"


def _read(store: StoreClient, key: str) -> dict[str, Any] | None:
    try:
        return json.loads(store.get_bytes(key))
    except ObjectNotFound:
        return None


@dataclass(frozen=True)
class SlotLauncher:
    """The coordinator's side: the sender runs wherever :func:`serve_slot` waits on ``slot``."""

    store: StoreClient
    slot: str
    host: str
    """The sender's address (trainer rank 0's ``MOONCAKE_RL_HOSTNAME``)."""
    host_id: str = ""
    """The sender's host's boot id (:func:`this_host_id`); unknown: not this host."""

    @property
    def keeper(self) -> None:
        """None: the trainer's sender serves one sync (its slot)."""
        return None

    @property
    def same_host(self) -> bool:
        """Whether the trainer shares this host's ``/dev/shm`` (the CPU leg can feed it);
        otherwise it reads the Store itself."""
        return bool(self.host_id) and self.host_id == this_host_id()

    def device(self, receivers_on_cuda: bool) -> str:
        return "cuda" if receivers_on_cuda else "cpu"  # "cuda": the sender's own GPU

    def start(self, spec: SenderSpec) -> Sender:
        return RemoteSender(self.store, self.slot, spec)

    def close(self) -> None:
        close_slot(self.store, self.slot)


def close_slot(store: StoreClient, slot: str) -> None:
    """End the slot (the coordinator, when the update ends): a waiting trainer returns and
    removes the slot's records. A trainer whose heartbeat stopped (its process died) never
    will: its records are swept here, so no dead sender's slot outlives its sync."""
    try:
        store.upsert_bytes(slot_key(slot, "closed"), b"{}")
        _sweep_if_gone(store, slot)
    except MooncakeError as error:
        logger.warning("mooncake: could not close sender slot %s: %s", slot, error)


def _sweep_if_gone(store: StoreClient, slot: str) -> None:
    """Wait until the trainer removed the slot's records, or remove them once its heartbeat
    has not moved for ``STALE_BEATS`` beats. A trainer that never beat may not have reached
    its wait yet: its ``closed`` record stays for it (it returns at once and clears it)."""
    keys = [slot_key(slot, record) for record in RECORDS]
    last = _read(store, keys[1])
    moved = time.monotonic()
    while any(store.exists(keys)):
        beat = _read(store, keys[1])
        if beat != last:
            last, moved = beat, time.monotonic()
        if time.monotonic() - moved >= STALE_BEATS * BEAT_S:
            gone = keys if last is not None else [k for k in keys if k != keys[3]]
            store.remove(gone, force=True)
            if last is not None:
                logger.warning("mooncake: swept sender slot %s: its trainer is gone", slot)
            return
        time.sleep(POLL_S)


class RemoteSender:
    """The remote sender as the coordinator sees it: resolved by its outcome record, or
    failed once its heartbeat stops (its process, and so its TCP store, is gone)."""

    def __init__(self, store: StoreClient, slot: str, spec: SenderSpec) -> None:
        self.store, self.slot, self.spec = store, slot, spec
        self.future: Future[dict[str, Any]] = Future()
        self.ended = self.future  # its group is dropped once it reports
        self._posted = time.monotonic()
        self._last_beat: float | None = None
        self._beats: int | None = None
        self._taken: dict[int, Future[None]] = {}
        self._lock = threading.Lock()
        self.future.add_done_callback(self._fail_offers)
        store.create_exclusive(slot_key(slot, "spec"), json.dumps(asdict(spec)).encode())
        threading.Thread(target=self._watch, name=f"sender-{slot[:8]}", daemon=True).start()

    def offer(self, index: int, shm: str) -> Future[None]:
        taken: Future[None] = Future()
        with self._lock:
            if self.future.done():
                taken.set_exception(SenderFailed("the remote sender has ended"))
                return taken
            self._taken[index] = taken
        offer = {"index": index, "shm": shm}
        self.store.upsert_bytes(slot_key(self.slot, "offer"), json.dumps(offer).encode())
        return taken

    def _fail_offers(self, ended: Future[dict[str, Any]]) -> None:
        """The sender ended (reported or failed): no offer still pending will be read."""
        with self._lock:
            pending, self._taken = self._taken, {}
        for taken in pending.values():
            taken.set_exception(SenderFailed("the remote sender ended before it read its bucket"))

    def _resolve_taken(self) -> None:
        with self._lock:
            if not self._taken:
                return
        read = _read(self.store, slot_key(self.slot, "taken"))
        with self._lock:
            done = [i for i in self._taken if read is not None and i <= read.get("index", -1)]
            resolved = [self._taken.pop(i) for i in done]
        for taken in resolved:
            taken.set_result(None)

    def _watch(self) -> None:
        while not self.future.done():
            self._resolve_taken()
            outcome = _read(self.store, slot_key(self.slot, "outcome"))
            if outcome is not None:
                self._resolve_taken()  # the last bucket read before the outcome came
                if outcome.get("ok"):
                    self.future.set_result(outcome["report"])
                else:
                    self.future.set_exception(SenderFailed(f"remote sender: {outcome['error']}"))
                return
            beat = _read(self.store, slot_key(self.slot, "beat"))
            if beat is not None and beat.get("n") != self._beats:
                self._beats, self._last_beat = beat.get("n"), time.monotonic()
            if not self.alive():
                self.future.set_exception(
                    SenderFailed(
                        f"remote sender of slot {self.slot} stopped answering (no heartbeat "
                        f"for {STALE_BEATS * BEAT_S:g}s, or none within "
                        f"{self.spec.timeout_s:g}s of the spec): its process is gone"
                    )
                )
                return
            time.sleep(POLL_S if self._taken else POLL_S * 4)

    def alive(self) -> bool:
        if self.future.done():
            return False
        now = time.monotonic()
        if self._last_beat is None:
            return now - self._posted < self.spec.timeout_s
        return now - self._last_beat < STALE_BEATS * BEAT_S

    def kill(self) -> None:
        """Nothing to kill from here: a failed receiver closes the group's connections, and
        the sender then fails and posts its outcome."""


def serve_slot(
    store: StoreClient, slot: str, settings: Settings, timeout_s: float
) -> dict[str, Any] | None:
    """The trainer's side: wait for the slot's spec (or its closing), run the sender, post a
    heartbeat throughout and the outcome after. Returns the report, or None when the
    update needed no sender. Never raises for the sender's own failure: the coordinator
    reports it, and the trainer's step must go on."""
    deadline = time.monotonic() + timeout_s
    done = threading.Event()

    def beat() -> None:
        count = 0
        while not done.wait(BEAT_S):
            count += 1
            try:
                store.upsert_bytes(slot_key(slot, "beat"), json.dumps({"n": count}).encode())
            except MooncakeError as error:
                logger.warning("mooncake: sender heartbeat failed: %s", error)

    # Beating from the start of the wait to the slot's end: the coordinator tells a dead
    # trainer (whose records it must sweep) from a slow one.
    store.upsert_bytes(slot_key(slot, "beat"), json.dumps({"n": 0}).encode())
    beating = threading.Thread(target=beat, name=f"sender-beat-{slot[:8]}", daemon=True)
    beating.start()
    try:
        return _serve(store, slot, settings, deadline)
    finally:
        done.set()
        beating.join()
        if _read(store, slot_key(slot, "closed")) is not None:  # this side reads last
            store.remove([slot_key(slot, record) for record in RECORDS], force=True)


def _serve(
    store: StoreClient, slot: str, settings: Settings, deadline: float
) -> dict[str, Any] | None:
    while (spec_body := _read(store, slot_key(slot, "spec"))) is None:
        if _closed(store, slot, deadline):
            return None
        time.sleep(POLL_S)
    spec = SenderSpec(**{**spec_body, "source": Source(**spec_body["source"])})
    report: dict[str, Any] | None = None
    try:
        report = send(spec, settings, SlotFeed(store, slot, deadline) if spec.fed else None)
        outcome: dict[str, Any] = {"ok": True, "report": report}
    except (MooncakeRLError, RuntimeError) as error:
        logger.error("mooncake: the broadcast sender failed: %s", error)
        outcome = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    store.upsert_bytes(slot_key(slot, "outcome"), json.dumps(outcome).encode())
    while not _closed(store, slot, deadline):  # the coordinator reads the outcome first
        time.sleep(POLL_S)
    return report


@dataclass(frozen=True)
class SlotFeed:
    """The trainer's end of a fed slot: offers and answers are the slot's records."""

    store: StoreClient
    slot: str
    deadline: float

    def offered(self) -> object:
        """The offer of a bucket not read yet; None once the slot closed or the wait ended."""
        key = slot_key(self.slot, "taken")
        last = (_read(self.store, key) or {}).get("index", -1)
        while True:
            offer = _read(self.store, slot_key(self.slot, "offer"))
            if offer is not None and offer.get("index", -1) > last:
                return offer
            if _closed(self.store, self.slot, self.deadline):
                return None
            time.sleep(POLL_S / 5)

    def taken(self, index: int) -> None:
        body = json.dumps({"index": index}).encode()
        self.store.upsert_bytes(slot_key(self.slot, "taken"), body)


def _closed(store: StoreClient, slot: str, deadline: float) -> bool:
    """The coordinator closed the slot, or the wait is over."""
    if _read(store, slot_key(slot, "closed")) is not None:
        return True
    if time.monotonic() >= deadline:
        logger.warning("mooncake: sender slot %s not closed in time; left to its owner", slot)
        return True
    return False
