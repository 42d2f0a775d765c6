"""Rendezvous port claims against a real Mooncake master: collisions re-pick, release only
after the sender resolved, a wedged sender keeps its claim until it is gone, expired claims
are taken over by exactly one contender, and a cancel after resolution still releases."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import FrameType

import pytest

from mooncake_rl.errors import ConfigurationError, InvariantViolation
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.transport import ClaimRecord, NoFreePort, PortClaim, PortClaims, port_key
from mooncake_rl.transport.claims import takeover_key
from tests.conftest import settings_for

PORT = 40000
LEASE_S = 2.0


@pytest.fixture(scope="module")
def store(master: EmbeddedMaster) -> Iterator[StoreClient]:
    """The client whose segment holds the claim records (the master itself holds none)."""
    with StoreClient(settings_for(master)) as client:
        yield client


@pytest.fixture
def host() -> str:
    """A host of its own per test: no bind test (not this machine), no shared keys."""
    return f"test-{uuid.uuid4().hex[:12]}"


def owner_claims(store: StoreClient, host: str, owner: str, lease_s: float = 30.0) -> PortClaims:
    return PortClaims(store, host, owner=owner, lease_s=lease_s)


def record(store: StoreClient, key: str) -> dict[str, object]:
    return json.loads(store.get_bytes(key))["record"]


def exists(store: StoreClient, key: str) -> bool:
    return store.exists([key])[0]


def expired_record(store: StoreClient, key: str, nonce: str) -> None:
    now = time.time()
    store.create_exclusive(key, ClaimRecord("dead", nonce, now - 60, now - 30, 30.0).encode())


def test_a_claim_is_a_json_record_under_its_port_key(store: StoreClient, host: str) -> None:
    before = time.time()
    claim = owner_claims(store, host, "trainer-0").claim(PORT)
    assert (claim.port, claim.owner) == (PORT, "trainer-0")
    assert claim.key == port_key(host, PORT) == f"mooncake-rl/ports/{host}/{PORT}"
    sealed = json.loads(store.get_bytes(claim.key))
    assert set(sealed) == {"record", "sha256"}
    body = sealed["record"]
    assert set(body) == {"owner", "nonce", "claimed_at", "expires_at", "lease_s"}
    assert body["owner"] == "trainer-0" and body["lease_s"] == 30.0
    assert before <= body["claimed_at"] <= time.time()  # type: ignore[operator]
    assert body["expires_at"] == body["claimed_at"] + 30.0  # type: ignore[operator]
    claim.release()
    assert not exists(store, claim.key)
    claim.release()  # idempotent


def test_a_contested_port_re_picks_past_the_claim(store: StoreClient, host: str) -> None:
    first = owner_claims(store, host, "sync-a").claim(PORT)
    second = owner_claims(store, host, "sync-b").claim(PORT)
    third = owner_claims(store, host, "sync-c").claim(PORT)
    assert (first.port, second.port, third.port) == (PORT, PORT + 1, PORT + 2)
    assert record(store, second.key)["owner"] == "sync-b"
    second.release()
    assert owner_claims(store, host, "sync-d").claim(PORT).port == PORT + 1
    for claim in (first, third):
        claim.release()


def test_no_free_port_counts_what_was_in_the_way(store: StoreClient, host: str) -> None:
    held = [owner_claims(store, host, "holder").claim(PORT + i) for i in range(2)]
    with pytest.raises(NoFreePort) as raised:
        owner_claims(store, host, "late").claim(PORT, attempts=2)
    assert str(raised.value) == (
        f"no rendezvous port free on {host} in {PORT}..{PORT + 1}: 2 claimed by other owners, "
        "0 bound by other processes. Start past them (MOONCAKE_RL_RENDEZVOUS_PORT), or wait "
        "for stale claims to expire (lease 30s)"
    )
    for claim in held:
        claim.release()


@pytest.mark.parametrize("start", ["free", "expired"])
def test_concurrent_owners_from_one_start_port_get_distinct_ports(
    master: EmbeddedMaster, store: StoreClient, host: str, start: str
) -> None:
    """Six owners on two clients (one lending no memory, like a trainer rank) race: the
    clients race in the Store (as processes would), threads sharing a client take turns.
    From an expired claim, one of them takes it over."""
    if start == "expired":
        expired_record(store, port_key(host, PORT), uuid.uuid4().hex)
    with StoreClient(settings_for(master, segment_bytes=0)) as other:
        clients = [store, other]
        ready = threading.Barrier(6)

        def contend(i: int) -> PortClaim:
            claims = owner_claims(clients[i % 2], host, f"sync-{i}")
            ready.wait()
            return claims.claim(PORT)

        with ThreadPoolExecutor(6) as pool:
            won = list(pool.map(contend, range(6)))
        assert sorted(c.port for c in won) == list(range(PORT, PORT + 6))
        for claim in won:
            assert record(store, claim.key)["owner"] == claim.owner
            claim.release()


def test_a_late_contender_cannot_undo_a_takeover(store: StoreClient, host: str) -> None:
    """Two contenders read the same expired claim; the slow one resumes only after the fast
    one took the port over (the interleaving is forced by stalling the slow one's Store
    client right after that read). It must re-pick, not remove the new owner's record."""
    key = port_key(host, PORT)
    expired_record(store, key, "n1")
    read_stale, taken = threading.Event(), threading.Event()

    class Stalled:
        """The slow contender's client: stalls after its first read of the claim."""

        def __getattr__(self, name: str) -> object:
            return getattr(store, name)

        def get_bytes(self, read: str) -> bytes:
            data = store.get_bytes(read)
            if read == key and not read_stale.is_set():
                read_stale.set()
                taken.wait(10)
            return data

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(owner_claims(Stalled(), host, "slow").claim, PORT)  # type: ignore[arg-type]
        assert read_stale.wait(10)
        fast = owner_claims(store, host, "fast").claim(PORT)
        taken.set()
        late = slow.result(10)
    assert (fast.port, late.port) == (PORT, PORT + 1)
    assert record(store, key)["owner"] == "fast"
    fast.release()
    late.release()


@pytest.mark.parametrize("outcome", ["result", "exception"])
def test_release_after_the_sender_resolved(store: StoreClient, host: str, outcome: str) -> None:
    claim = owner_claims(store, host, "trainer-0").claim(PORT, alive=lambda: True)

    def sender() -> None:
        time.sleep(0.2)
        if outcome == "exception":
            raise RuntimeError("NCCL broadcast failed")

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(sender)
        assert exists(store, claim.key)
        assert claim.release_after(future, teardown_timeout_s=10.0) is True
    assert future.done()
    assert not exists(store, claim.key)


def test_wedged_sender_keeps_its_claim_until_it_is_gone(
    store: StoreClient, host: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A sender that never resolves may still host its TCP store: its claim is neither
    deleted nor left to lapse while it may be live; once it is gone the claim expires and
    another owner takes the port over (exactly the expired record, nothing else)."""
    gone = threading.Event()
    claims = owner_claims(store, host, "wedged", lease_s=LEASE_S)
    claim = claims.claim(PORT, alive=lambda: not gone.is_set())
    claimed_at = time.monotonic()
    wedged: Future[object] = Future()
    with caplog.at_level(logging.WARNING, logger="mooncake_rl.transport.claims"):
        assert claim.release_after(wedged, teardown_timeout_s=0.3) is False
    assert time.monotonic() - claimed_at < 2.0
    assert f"rendezvous port {PORT} stays claimed by wedged" in caplog.text
    assert "is renewed while the sender may be live" in caplog.text
    assert exists(store, claim.key)
    nonce = record(store, claim.key)["nonce"]

    time.sleep(max(0.0, claimed_at + LEASE_S + 0.5 - time.monotonic()))  # past the first lease
    other = owner_claims(store, host, "next", lease_s=LEASE_S)
    beside = other.claim(PORT)
    assert beside.port == PORT + 1  # still claimed: renewal kept it alive
    beside.release()

    gone.set()  # the sender is gone: renewal stops at its next tick, the lease runs out
    while record(store, claim.key)["expires_at"] > time.time():  # type: ignore[operator]
        time.sleep(0.1)
    taken = other.claim(PORT)
    assert taken.port == PORT
    body = record(store, claim.key)
    assert body["owner"] == "next" and body["nonce"] != nonce
    assert not exists(store, takeover_key(claim.key, str(nonce), 0))
    claim.release()  # lapsed: must not delete the new owner's record
    assert record(store, claim.key)["owner"] == "next"
    taken.release()
    assert not exists(store, claim.key)


def test_a_holder_never_renews_over_another_owners_record(
    store: StoreClient, host: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Renewal reads before it writes: a record that is no longer this holder's (here
    replaced behind its back) ends the claim instead of being overwritten, and release
    leaves it alone."""
    claim = owner_claims(store, host, "holder", lease_s=1.0).claim(PORT, alive=lambda: True)
    now = time.time()
    store.upsert_bytes(claim.key, ClaimRecord("other", "n2", now, now + 30, 30.0).encode())
    with caplog.at_level(logging.ERROR, logger="mooncake_rl.transport.claims"):
        deadline = time.monotonic() + 5
        while "lost the claim" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert f"lost the claim of rendezvous port {PORT} (another owner's record" in caplog.text
    claim.release()
    assert record(store, claim.key)["owner"] == "other"
    store.remove([claim.key], force=True)


def test_a_live_takeover_marker_makes_others_re_pick(store: StoreClient, host: str) -> None:
    """Someone is taking over the expired claim right now: nobody else may."""
    key = port_key(host, PORT)
    expired_record(store, key, "n1")
    now = time.time()
    marker = ClaimRecord("taker", "m0", now, now + 30, 30.0)
    store.create_exclusive(takeover_key(key, "n1", 0), marker.encode())
    claim = owner_claims(store, host, "late").claim(PORT)
    assert claim.port == PORT + 1
    assert record(store, key)["nonce"] == "n1"
    claim.release()
    store.remove([key, takeover_key(key, "n1", 0)], force=True)


def test_a_marker_left_by_a_dead_taker_expires(store: StoreClient, host: str) -> None:
    """A taker that died between its marker and its record leaves both; the next contender
    uses the next marker, and cleans up every marker of the record it replaced."""
    key = port_key(host, PORT)
    expired_record(store, key, "n1")
    now = time.time()
    dead = ClaimRecord("dead-taker", "m0", now - 60, now - 30, 30.0)
    store.create_exclusive(takeover_key(key, "n1", 0), dead.encode())
    claim = owner_claims(store, host, "next").claim(PORT)
    assert claim.port == PORT
    assert record(store, key)["owner"] == "next"
    assert not any(store.exists([takeover_key(key, "n1", i) for i in range(4)]))
    claim.release()


def tampered() -> bytes:
    """An expired record whose checksum no longer matches (edited, or torn by a racing read)."""
    sealed = json.loads(ClaimRecord("dead", "n1", 0.0, 1.0, 1.0).encode())
    sealed["record"]["owner"] = "someone"
    return json.dumps(sealed).encode()


@pytest.mark.parametrize("data", [b"not json", b'{"owner": "x"}', tampered()])
def test_a_record_that_is_not_a_claim_is_never_taken_over(
    store: StoreClient, host: str, caplog: pytest.LogCaptureFixture, data: bytes
) -> None:
    key = port_key(host, PORT)
    store.create_exclusive(key, data)
    with caplog.at_level(logging.WARNING, logger="mooncake_rl.transport.claims"):
        claim = owner_claims(store, host, "next").claim(PORT)
    assert claim.port == PORT + 1
    assert f"{key} is not a port claim record" in caplog.text
    claim.release()
    store.remove([key], force=True)


class Interrupted:
    """Deliver a real signal to the main thread while it waits in ``release_after``; the
    handler runs there, between the wait's lock acquisitions, exactly like Ctrl-C would."""

    def __init__(self, sender: Future[object], *, resolve_first: bool) -> None:
        self.sender = sender
        self.resolve_first = resolve_first

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.resolve_first:
            self.sender.set_result(None)
        raise KeyboardInterrupt

    def __enter__(self) -> Interrupted:
        self.previous = signal.signal(signal.SIGUSR1, self.handler)
        self.timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.join()
        signal.signal(signal.SIGUSR1, self.previous)


def test_an_interrupt_after_the_sender_resolved_still_releases(
    store: StoreClient, host: str
) -> None:
    """The sender resolves, and in the same instant the waiting thread is interrupted (the
    signal handler resolves the future, then raises): the claim must still be deleted."""
    claim = owner_claims(store, host, "trainer-0").claim(PORT, alive=lambda: True)
    sender: Future[object] = Future()
    with Interrupted(sender, resolve_first=True), pytest.raises(KeyboardInterrupt):
        claim.release_after(sender, teardown_timeout_s=10.0)
    assert sender.done()
    assert not exists(store, claim.key)


def test_an_interrupt_before_the_sender_resolved_keeps_the_claim(
    store: StoreClient, host: str
) -> None:
    claim = owner_claims(store, host, "trainer-0").claim(PORT, alive=lambda: True)
    sender: Future[object] = Future()
    with Interrupted(sender, resolve_first=False), pytest.raises(KeyboardInterrupt):
        claim.release_after(sender, teardown_timeout_s=10.0)
    assert not sender.done()
    assert exists(store, claim.key)
    claim.release()
    assert not exists(store, claim.key)


def test_context_manager_releases(store: StoreClient, host: str) -> None:
    with owner_claims(store, host, "trainer-0").claim(PORT) as claim:
        assert exists(store, claim.key)
    assert not exists(store, claim.key)
    with pytest.raises(InvariantViolation, match=f"claim of rendezvous port {PORT} is released"):
        claim.hold(lambda: True)


def test_a_port_bound_on_this_host_is_skipped(store: StoreClient) -> None:
    """Claims do not stop other programs: a local port somebody listens on is passed over.
    A remote host's ports cannot be tested from here, so there only the Store decides."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        local = owner_claims(store, "127.0.0.1", f"local-{uuid.uuid4().hex}").claim(busy)
        assert local.port > busy
        local.release()
        remote = owner_claims(store, f"test-{uuid.uuid4().hex[:12]}", "remote").claim(busy)
        assert remote.port == busy
        remote.release()


@pytest.mark.parametrize(
    ("host", "owner", "lease_s", "message"),
    [
        ("a/b", "o", 30.0, "rendezvous host 'a/b' must be a host name or IP address"),
        ("h", "", 30.0, "a claim needs an owner"),
        ("h", "o", 0.0, "claim lease must be positive, got 0.0"),
    ],
)
def test_bad_claim_settings_are_refused(
    store: StoreClient, host: str, owner: str, lease_s: float, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        PortClaims(store, host, owner=owner, lease_s=lease_s)


@pytest.mark.parametrize(("start", "attempts"), [(0, 1), (65536, 1), (PORT, 0)])
def test_bad_start_ports_are_refused(
    store: StoreClient, host: str, start: int, attempts: int
) -> None:
    with pytest.raises(ConfigurationError, match="MOONCAKE_RL_RENDEZVOUS_PORT"):
        owner_claims(store, host, "o").claim(start, attempts=attempts)
