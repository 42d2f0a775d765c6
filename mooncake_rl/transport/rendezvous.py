"""A broadcast sender in another process, met through the Store: the VeRL trainer's rank 0.

The coordinator (rollout rank 0) cannot start a process on a trainer node, and the sender
belongs there: trainer rank 0 holds a train-pool GPU, so its NCCL group never holds a
receiver's GPU. Both sides know one slot id (the sync id). The coordinator posts the
sender's spec once it has claimed the port and the receivers are joining; the trainer,
waiting in its ``finalize``, posts a heartbeat from then on, runs the sender, then posts
its outcome. When the update ends the coordinator closes the slot, which also ends the wait
of a trainer that was never needed; the trainer removes the records, or, if its heartbeat
stopped (it died), the coordinator sweeps them. Records are JSON, never pickle.
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
from mooncake_rl.transport.sender import Sender, SenderFailed, SenderSpec, send
from mooncake_rl.transport.source import Source

logger = logging.getLogger(__name__)

BEAT_S = 1.0
"""How often a running sender says it is alive."""
STALE_BEATS = 5
"""Heartbeats missed before the coordinator counts the sender as gone."""
POLL_S = 0.05
RECORDS = ("spec", "beat", "outcome", "closed")
"""A slot's records; ``beat`` (index 1) moves while its trainer lives, ``closed`` (3) last."""


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

    @property
    def keeper(self) -> None:
        """None: the trainer's sender serves one sync (its slot)."""
        return None

    @property
    def same_host(self) -> bool:
        """False: the trainer reads the Store itself (no shared memory with this host)."""
        return False

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
        store.create_exclusive(slot_key(slot, "spec"), json.dumps(asdict(spec)).encode())
        threading.Thread(target=self._watch, name=f"sender-{slot[:8]}", daemon=True).start()

    def _watch(self) -> None:
        while not self.future.done():
            outcome = _read(self.store, slot_key(self.slot, "outcome"))
            if outcome is not None:
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
            time.sleep(POLL_S * 4)

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
        report = send(spec, settings)
        outcome: dict[str, Any] = {"ok": True, "report": report}
    except (MooncakeRLError, RuntimeError) as error:
        logger.error("mooncake: the broadcast sender failed: %s", error)
        outcome = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    store.upsert_bytes(slot_key(slot, "outcome"), json.dumps(outcome).encode())
    while not _closed(store, slot, deadline):  # the coordinator reads the outcome first
        time.sleep(POLL_S)
    return report


def _closed(store: StoreClient, slot: str, deadline: float) -> bool:
    """The coordinator closed the slot, or the wait is over."""
    if _read(store, slot_key(slot, "closed")) is not None:
        return True
    if time.monotonic() >= deadline:
        logger.warning("mooncake: sender slot %s not closed in time; left to its owner", slot)
        return True
    return False
