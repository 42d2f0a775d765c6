"""Many HTTP engines for the coordinator's tests: one real uvicorn server, in a thread of the
test process, listening on one loopback port per engine.

The coordinator's client is what these tests exercise (connections, concurrency, failures),
so the engines are plain ASGI apps; ``engine_ext.routes`` is tested with its own receivers.
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
