"""Many HTTP engines for the coordinator's tests: one real uvicorn server, in a thread of the
test process, listening on one loopback port per engine.

The coordinator's client is what these tests exercise (connections, concurrency, failures,
the order of its calls), so the engines are plain ASGI apps; ``engine_ext.routes`` is
tested with its own receivers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from mooncake_rl.apply.wire import decode_slice
from mooncake_rl.generations.catalog import specs_of
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.protocol import PROTOCOL_VERSION, reported_placement, without_boxes
from mooncake_rl.store import StoreClient

Reply = tuple[int, Any]
Handler = Callable[[str, str, bytes, dict[str, str]], Awaitable[Reply]]
"""(engine URL, path, body, headers) -> (status, JSON reply), on the server's loop."""


@contextmanager
def fleet(count: int, handler: Handler) -> Iterator[list[str]]:
    """``count`` engine URLs served by ``handler`` until the block ends."""
    sockets = [socket.create_server(("127.0.0.1", 0), backlog=4096) for _ in range(count)]
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in sockets]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        url = f"http://127.0.0.1:{scope['server'][1]}"
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        path = scope["path"] + (
            f"?{scope['query_string'].decode()}" if scope["query_string"] else ""
        )
        status, reply = await handler(url, path, body, headers)
        data = json.dumps(reply).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": data})

    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=sockets)))
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the fleet's server did not start")
            threading.Event().wait(0.01)
        yield urls
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        for s in sockets:
            s.close()
        assert not thread.is_alive(), "the fleet's server did not stop"


class FakeEngines:
    """Engines that describe simulated placements of the Store's active generation and
    accept every call, keeping the calls in order with their bodies."""

    def __init__(self, model: str, placements: dict[str, list[dict[str, Any]]]) -> None:
        self.model = model
        self.placements = placements
        self.urls: dict[str, str] = {}  # served URL -> simulated engine
        self.calls: list[tuple[str, str, Any]] = []
        self.protocol: dict[str, int] = {}  # simulated engine -> another protocol it reports

    @classmethod
    def of(
        cls, store: StoreClient, model: str, cluster: list[tuple[str, int]], watermark: int
    ) -> FakeEngines:
        """Direct-mode placements of ``model``'s active generation on ``cluster``."""
        registry = GenerationRegistry(store, model)
        manifest = registry.load_manifest(registry.active().generation)
        placements = simulated_engines(specs_of(manifest), cluster, "direct")
        return cls(
            model,
            {
                url: [{**reported_placement(w), "staging_watermark_bytes": watermark} for w in ws]
                for url, ws in placements.items()
            },
        )

    async def handle(self, url: str, path: str, content: bytes, _: object) -> tuple[int, Any]:
        route = path.removeprefix("/mooncake/")  # with its query
        path, _, query = route.partition("?")
        body = json.loads(content) if content else None
        self.calls.append((url, route, body))
        workers = self.placements[self.urls[url]]
        described = [without_boxes(w) for w in workers] if query == "boxes=false" else workers
        protocol = self.protocol.get(self.urls[url], PROTOCOL_VERSION)
        replies: dict[str, Any] = {
            "status": {"state": "serving", "protocol": protocol},
            "placement": {
                "model": self.model,
                "generation": 0,
                "fence": 0,
                "protocol": protocol,
                "workers": described,
            },
            "prepare": {
                "workers": [
                    {"worker_id": w["worker_id"], "node": w["node"], "endpoint": "e", "regions": {}}
                    for w in workers
                ]
            },
            "apply": {
                "workers": [
                    {"worker_id": w["worker_id"], "store_read_bytes": 0, "pushed_bytes": 0}
                    | {"seconds": 0.0}
                    for w in workers
                ]
            },
            "abort": {"state": "serving"},
        }
        return 200, replies.get(path, {})

    def batches(self) -> list[int]:
        """Bytes each prepared batch reads, over every worker slice the engines received."""
        return [
            sum(read.length for read in batch.reads)
            for _, path, body in self.calls
            if path == "prepare"
            for worker in body["workers"].values()
            for stage in decode_slice(worker["slice"]).stages
            for batch in stage
        ]

    def paths(self) -> set[str]:
        return {path for _, path, _ in self.calls}
