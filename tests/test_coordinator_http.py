"""The coordinator's control calls survive servers that drop idle keep-alive connections.

uvicorn closes a connection idle for 5 s; a client that reuses it at that moment gets a
reset. The server below makes the race certain: it answers the first request on each
connection and resets the connection on a second one.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from mooncake_rl.coordinator import Coordinator
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for

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
