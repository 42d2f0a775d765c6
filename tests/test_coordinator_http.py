"""The coordinator's HTTP fan-out against real servers.

- Control calls survive servers that drop idle keep-alive connections: uvicorn closes a
  connection idle for 5 s, and a client that reuses it at that moment gets a reset. The
  raw server below makes the race certain: it answers the first request on each
  connection and resets the connection on a second one.
- A phase has every engine's call in flight at once; with a bound on calls in flight, one
  slow engine holds one slot and delays nobody else; lease renewals have slots of their own.
- An engine that refuses connections or answers an error is reported on its own; the rest
  of the phase goes on. Idempotent calls are retried after a reset, others are not.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_rl.coordinator import Coordinator, EngineRequestFailed, SessionLease
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for
from tests.fleet import fleet

STATUS = {"state": "serving", "generation": 7}


def _serve_once_per_connection(listener: socket.socket, stop: threading.Event) -> None:
    body = json.dumps(STATUS).encode()
    while not stop.is_set():
        try:
            connection, _ = listener.accept()
        except TimeoutError:  # the listener's timeout lets the loop see ``stop``
            continue
        connection.settimeout(None)
        with connection:
            connection.recv(65536)
            connection.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\nconnection: keep-alive\r\n\r\n".encode()
                + body
            )
            if connection.recv(65536):  # a second request on this connection: reset it
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.fixture
def resetting_server() -> Iterator[str]:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    thread = threading.Thread(target=_serve_once_per_connection, args=(listener, stop))
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()
        assert not thread.is_alive(), "test server thread did not stop"


def test_every_control_call_opens_a_fresh_connection(
    master: EmbeddedMaster, resetting_server: str
) -> None:
    store = StoreClient(settings_for(master, segment_bytes=0))
    try:
        with Coordinator(store, [resetting_server]) as coordinator:
            for _ in range(3):
                assert coordinator.status() == {resetting_server: STATUS}
    finally:
        store.close()


@pytest.fixture
def store(master: EmbeddedMaster) -> Iterator[StoreClient]:
    with StoreClient(settings_for(master, segment_bytes=0)) as client:
        yield client


class Engines:
    """What the fleet's engines saw: each call's (path, seconds since ``start``, body)."""

    def __init__(self, delays: dict[str, float] | None = None) -> None:
        self.delays = delays or {}  # seconds before replying, by route
        self.slow: dict[str, float] = {}  # seconds before replying, by engine URL
        self.refusing: dict[str, tuple[int, Any]] = {}  # an error reply, by engine URL
        self.seen: dict[str, list[tuple[str, float, bytes]]] = defaultdict(list)
        self.headers: list[dict[str, str]] = []
        self.start = time.perf_counter()

    async def handle(
        self, url: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, Any]:
        route = path.removeprefix("/mooncake/")
        self.seen[url].append((route, time.perf_counter() - self.start, body))
        self.headers.append(headers)
        await asyncio.sleep(self.slow.get(url, 0.0) if route != "renew" else 0.0)
        await asyncio.sleep(self.delays.get(route.split("?")[0], 0.0))
        if url in self.refusing:
            return self.refusing[url]
        parsed = json.loads(body) if headers.get("content-type") == "application/json" else None
        return 200, {"url": url, "route": route, "body": parsed}

    def arrivals(self, route: str) -> dict[str, list[float]]:
        return {
            url: [t for r, t, _ in calls if r == route]
            for url, calls in self.seen.items()
            if any(r == route for r, _, _ in calls)
        }


def test_a_phase_has_every_engines_call_in_flight_at_once(store: StoreClient) -> None:
    """200 engines that each take 2 s: the phase takes about 2 s, and each gets its body."""
    engines = Engines({"drain": 2.0})
    with fleet(200, engines.handle) as urls, Coordinator(store, urls) as coordinator:
        started = time.perf_counter()
        ok, failed = coordinator._all(urls, "POST", "drain", {u: {"to": u} for u in urls})
        seconds = time.perf_counter() - started
    assert not failed and sorted(ok) == sorted(urls)
    assert all(reply["body"] == {"to": url} for url, reply in ok.items())
    assert seconds < 10, f"200 calls of 2 s each took {seconds:.1f} s: not all in flight"
    arrived = [t for times in engines.arrivals("drain").values() for t in times]
    assert max(arrived) - min(arrived) < 1.5  # every call sent before the first answered


def test_a_slow_engine_holds_one_slot_and_delays_no_other(store: StoreClient) -> None:
    """At most 3 calls in flight; one engine takes 3 s: the 40 others are all served meanwhile."""
    engines = Engines({"apply": 0.02})
    with (
        fleet(41, engines.handle) as urls,
        Coordinator(store, urls, max_connections=3) as coordinator,
    ):
        slow, fast = urls[0], urls[1:]
        engines.slow[slow] = 3.0
        engines.start = time.perf_counter()
        ok, failed = coordinator._all(urls, "POST", "apply", {u: {"stage": 0} for u in urls})
        seconds = time.perf_counter() - engines.start
    assert not failed and len(ok) == 41
    arrivals = engines.arrivals("apply")
    assert max(t for url in fast for t in arrivals[url]) < 2.0  # none waited for the slow one
    assert 3.0 <= seconds < 5.0


def test_lease_renewals_are_not_queued_behind_a_phase(store: StoreClient) -> None:
    """The phase's only slot is held by a 3 s call; renewals (every 0.5 s) still go out,
    to every held engine, and stop with the session."""
    engines = Engines({"apply": 3.0})
    with (
        fleet(2, engines.handle) as urls,
        Coordinator(store, urls, max_connections=1) as coordinator,
    ):
        engines.start = time.perf_counter()
        lease = SessionLease(coordinator, 1.5)
        lease.held.update(urls)
        try:
            ok, _ = coordinator._all(urls, "POST", "apply", {u: {"stage": 0} for u in urls})
        finally:
            lease.stop()
        stopped = time.perf_counter() - engines.start
        time.sleep(1.2)
    assert len(ok) == 2
    renewals = engines.arrivals("renew")
    for url in urls:
        during = [t for t in renewals[url] if t < 3.0]
        assert len(during) >= 4, f"{url} renewed at {renewals[url]} during a 6 s phase"
        assert all(t < stopped + 0.1 for t in renewals[url])  # none after stop()
        assert all(
            json.loads(b) == {"session": lease.id} for r, _, b in engines.seen[url] if r == "renew"
        )


def test_a_failed_engine_is_reported_and_the_others_go_on(store: StoreClient) -> None:
    """One engine refuses connections, one answers 409: both are reported with what
    ``EngineRequestFailed`` carries; the other engines' calls succeed."""
    closed = socket.create_server(("127.0.0.1", 0))
    gone = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    engines = Engines()
    with fleet(5, engines.handle) as urls:
        busy = urls[0]
        engines.refusing[busy] = (409, {"error": "session_busy", "detail": "held by x"})
        everyone = [gone, *urls]
        with Coordinator(store, everyone) as coordinator:
            ok, failed = coordinator._all(everyone, "POST", "drain", {u: {} for u in everyone})
            statuses = coordinator.status()
    assert sorted(ok) == sorted(urls[1:])
    assert set(failed) == {gone, busy}
    refused = failed[gone]
    assert (refused.url, refused.path, refused.status, refused.code) == (
        gone,
        "/mooncake/drain",
        0,
        None,
    )
    assert (failed[busy].status, failed[busy].code) == (409, "session_busy")
    assert failed[busy].body == {"error": "session_busy", "detail": "held by x"}
    assert "error" in statuses[gone] and statuses[urls[1]]["route"] == "status"


def test_the_token_rides_every_call_and_an_upload_carries_raw_bytes(store: StoreClient) -> None:
    engines = Engines()
    with (
        fleet(2, engines.handle) as urls,
        Coordinator(store, urls, token="s3cret") as coordinator,
    ):
        coordinator.status()
        reply = coordinator.upload(urls[0], {"session": "s", "generation": 3, "stage": 1}, b"\0\1")
        coordinator.call(urls[1], "commit", {"session": "s"})
    assert all(h["authorization"] == "Bearer s3cret" for h in engines.headers)
    assert reply["route"] == "bucket?session=s&generation=3&stage=1"
    _, _, body = engines.seen[urls[0]][-1]
    assert body == b"\0\1" and engines.headers[-2]["content-type"] == "application/octet-stream"
    assert engines.seen[urls[1]][-1][0] == "commit"
    assert engines.headers[-1]["content-type"] == "application/json"


def _reset_first_request(listener: socket.socket, stop: threading.Event, seen: list[bytes]) -> None:
    """Reset the first connection as its request arrives (no reply); answer later ones."""
    body = json.dumps(STATUS).encode()
    while not stop.is_set():
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        connection.settimeout(None)
        with connection:
            seen.append(connection.recv(65536))
            if len(seen) == 1:
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                continue
            connection.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                + body
            )


@pytest.mark.parametrize("retry", [True, False])
def test_only_idempotent_calls_are_sent_again_after_a_reset(
    store: StoreClient, retry: bool
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    seen: list[bytes] = []
    thread = threading.Thread(target=_reset_first_request, args=(listener, stop, seen))
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with Coordinator(store, [url]) as coordinator:
            ok, failed = coordinator._all([url], "POST", "commit", {url: {}}, retry=retry)
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()
    if retry:
        assert ok == {url: STATUS} and not failed and len(seen) == 2
    else:
        assert not ok and len(seen) == 1
        assert isinstance(failed[url], EngineRequestFailed) and failed[url].status == 0


def test_engines_are_reached_through_the_environments_proxy(
    store: StoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HTTP_PROXY`` carries calls to engines that ``NO_PROXY`` does not exempt."""
    engines = Engines()
    with fleet(2, engines.handle) as (proxy, direct):
        monkeypatch.setenv("HTTP_PROXY", proxy)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        behind = "http://engine.invalid:8000"  # resolvable by no one but the proxy
        with Coordinator(store, [behind, direct]) as coordinator:
            statuses = coordinator.status()
    assert statuses[behind]["url"] == proxy and statuses[direct]["url"] == direct
    assert any(h["host"] == "engine.invalid:8000" for h in engines.headers)
