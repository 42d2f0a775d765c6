"""Causing update faults for real: a coordinator killed at a phase, a response dropped on the
wire, an engine killed, and the end state every scenario must reach.

- :func:`start_coordinator` runs ``Coordinator.update`` in its own process, which SIGKILLs
  itself when the update reports the named phase (nothing is cleaned up, as in a crash).
- :class:`DroppingProxy` sits between the coordinator and one engine and, when armed, lets
  a request through but closes the connection instead of returning the engine's response.
- :func:`kill_engine` SIGKILLs an engine's whole process group.
- :func:`wait_converged` is the end state: every engine serves, each one complete Store
  generation, and its greedy output equals that generation's reference.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator, UpdateFailed
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT
from tests.procs import CTX

TABLE: list[tuple[str, str, float, float]] = []
"""Rows of the update fault matrix: scenario, outcome, seconds to recover, bound."""


def _coordinate(
    settings: Settings,
    engines: list[str],
    model: str,
    kill_at: str | None,
    token: str | None,
    session_ttl_s: float,
    options: dict[str, Any],
    results: Any,
    together: Any,
) -> None:
    def progress(phase: str) -> None:
        if phase == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    with (
        StoreClient(settings) as store,
        Coordinator(
            store, engines, token=token, session_ttl_s=session_ttl_s, progress=progress
        ) as coordinator,
    ):
        if together is not None:
            together.wait(timeout=120)  # set up: the updates themselves start at once
        try:
            results.put(("ok", coordinator.update(model, **options).to_json()))
        except UpdateFailed as failed:
            results.put(("failed", failed.result.to_json()))


@dataclass
class CoordinatorRun:
    process: Any
    results: Any

    def outcome(self, timeout_s: float = 300.0) -> tuple[str, dict[str, Any]]:
        """("ok" | "failed", result) of an update that ran to its end."""
        status, result = self.results.get(timeout=timeout_s)
        self.process.join(timeout=30)
        return status, result

    def killed(self, timeout_s: float = 300.0) -> float:
        """Wait for the self-inflicted SIGKILL; the monotonic time it was seen."""
        self.process.join(timeout=timeout_s)
        assert self.process.exitcode == -signal.SIGKILL, (
            f"the coordinator was to die at its phase, exit code {self.process.exitcode}"
        )
        return time.monotonic()


def start_coordinator(
    settings: Settings,
    engines: Sequence[str],
    model: str,
    *,
    kill_at: str | None = None,
    token: str | None = None,
    session_ttl_s: float = 3.0,
    together: Any = None,
    **options: Any,
) -> CoordinatorRun:
    """``settings`` must lend no memory (``segment_bytes=0``): a killed process that lent
    some would take Store objects with it, a different fault. ``together``: a ``CTX``
    barrier the process waits at before its update (each process takes seconds to start)."""
    assert settings.segment_bytes == 0
    results = CTX.Queue()
    process = CTX.Process(
        target=_coordinate,
        args=(
            settings,
            list(engines),
            model,
            kill_at,
            token,
            session_ttl_s,
            options,
            results,
            together,
        ),
    )
    process.start()
    return CoordinatorRun(process, results)


def kill_engine(engine: VllmServer) -> None:
    """SIGKILL the engine's process group (API server and workers) and reap it."""
    process = engine._process
    assert process is not None and process.pid is not None
    os.killpg(process.pid, signal.SIGKILL)
    engine.stop()


class DroppingProxy:
    """A TCP forwarder in front of one engine; ``drop(path)`` arms it for one request.

    The armed request reaches the engine whole, which acts on it, but the client sees the
    connection close without a response: a response lost on the wire.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._armed: str | None = None
        self.dropped: list[str] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def drop(self, path: str) -> None:
        with self._lock:
            self._armed = path

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        head = client.recv(65536)
        with self._lock:
            armed = self._armed is not None and head.split(b" ", 2)[1:2] == [self._armed.encode()]
            if armed:
                self._armed = None
                self.dropped.append(head.split(b"\r\n", 1)[0].decode())
        upstream.sendall(head)
        threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
        if armed:  # let the engine answer, then hang up on the client instead
            upstream.recv(65536)
            for sock in (client, upstream):
                _hang_up(sock)
            return
        _pump(upstream, client)

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            _hang_up(sock)


def _hang_up(sock: socket.socket) -> None:
    """Shut down before closing: a close alone leaves the connection open while another
    thread is blocked reading the socket, and the peer would wait for ever."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@dataclass
class Convergence:
    seconds: float
    generations: dict[str, int] = field(default_factory=dict)


def wait_converged(
    engines: Mapping[str, VllmServer],
    reference: Callable[[dict[str, Any]], list[int]],
    since: float,
    bound_s: float,
) -> Convergence:
    """Every engine ready, holding no session, and serving one complete generation whose
    greedy output is that generation's reference (``reference(status)``, by the generation
    and incarnation the engine reports); seconds from ``since`` (the fault) until all were.
    (An engine whose session stages is ready too: it serves its old generation meanwhile.)"""
    deadline = since + bound_s
    pending = dict(engines)
    while pending:
        for label, engine in list(pending.items()):
            try:
                ready = httpx.get(f"{engine.url}/mooncake/ready", timeout=5).status_code == 200
                settled = ready and engine.mooncake("GET", "status").json()["session"] is None
            except httpx.HTTPError:
                settled = False
            if settled:
                del pending[label]
        if pending:
            assert time.monotonic() < deadline, (
                f"{sorted(pending)} not serving {bound_s}s after the fault: "
                + "; ".join(str(e.mooncake("GET", "status").json()) for e in pending.values())
            )
            time.sleep(0.1)
    converged = Convergence(time.monotonic() - since)
    for label, engine in engines.items():
        status = engine.mooncake("GET", "status").json()
        assert status["state"] == "serving" and status["session"] is None, status
        converged.generations[label] = status["generation"]
        assert engine.complete(PROMPT) == reference(status), (label, status)
    return converged


class Traffic(threading.Thread):
    """Greedy completions against every engine, one after another, until stopped: what
    each returned, to show an engine served (and with which output) while an update held
    it."""

    def __init__(self, engines: Mapping[str, VllmServer]) -> None:
        super().__init__(daemon=True)
        self.engines = engines
        self.outputs: list[tuple[str, list[int] | str]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            for label, engine in self.engines.items():
                try:
                    self.outputs.append((label, engine.complete(PROMPT, timeout=30)))
                except httpx.HTTPError as error:
                    self.outputs.append((label, f"{type(error).__name__}: {error}"))

    def stop(self) -> list[tuple[str, list[int] | str]]:
        self._done.set()
        self.join(60)
        return self.outputs
