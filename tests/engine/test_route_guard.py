"""Who may reach /mooncake/* and how much they may send: the startup decision
(:func:`engine_ext.security.route_tokens`) and the body limit, over HTTP through the router."""

from __future__ import annotations

import ipaddress
from argparse import Namespace
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import given
from hypothesis import strategies as st

from engine_ext.receiver import Receiver, ServedRecord
from engine_ext.routes import build_router
from engine_ext.security import is_loopback, route_tokens
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.settings import Settings
from tests.engine.test_receiver_routes import RecordingBackend

LIMIT = 160
EXTENSION = "--worker-extension-cls mooncake_rl.Ext"
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
keys = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3)


def reachable_v6(address: ipaddress.IPv6Address) -> bool:
    mapped = address.ipv4_mapped
    return not address.is_loopback and (mapped is None or mapped not in LOOPBACK)


loopback_hosts = st.one_of(
    st.ip_addresses(network="127.0.0.0/8").map(str),
    st.sampled_from(["::1", "[::1]", "localhost", "LocalHost", "::ffff:127.0.0.1"]),
)
reachable_hosts = st.one_of(
    st.ip_addresses(v=4).filter(lambda a: a not in LOOPBACK).map(str),
    st.ip_addresses(v=6).filter(reachable_v6).map(str),
    st.sampled_from([None, "", "0.0.0.0", "::", "[::]", "engine-0.cluster", "localhost.evil"]),
)


@given(loopback_hosts)
def test_loopback_may_stay_open(host: str) -> None:
    assert is_loopback(host)
    assert route_tokens(host, None, [], insecure=False) == ()


@given(reachable_hosts)
def test_beyond_loopback_needs_a_token_or_insecure(host: str | None) -> None:
    assert not is_loopback(host)
    with pytest.raises(ConfigurationError) as refused:
        route_tokens(host, None, [], insecure=False)
    message = str(refused.value)
    assert f"binds {repr(host) if host else 'all interfaces'}, which other hosts" in message
    for fix in ("MOONCAKE_RL_AUTH_TOKEN", "--api-key", "MOONCAKE_RL_INSECURE=1"):
        assert fix in message
    assert route_tokens(host, None, [], insecure=True) == ()
    assert route_tokens(host, "", [""], insecure=True) == ()  # empty strings are unset


@given(st.one_of(loopback_hosts, reachable_hosts), keys, st.booleans())
def test_api_keys_guard_anywhere_and_the_settings_token_wins(
    host: str | None, api_keys: list[str], insecure: bool
) -> None:
    assert route_tokens(host, None, api_keys, insecure) == tuple(api_keys)
    assert route_tokens(host, "mine", api_keys, insecure) == ("mine",)


def test_insecure_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().insecure is False
    monkeypatch.setenv("MOONCAKE_RL_INSECURE", "1")
    monkeypatch.setenv("MOONCAKE_RL_MAX_BODY_BYTES", "1024")
    assert (Settings().insecure, Settings().max_body_bytes) == (True, 1024)
    assert Settings.model_fields["max_body_bytes"].default == 256 << 20


def client(
    token: str | tuple[str, ...] | None = None,
) -> tuple[httpx.AsyncClient, Receiver, RecordingBackend]:
    backend = RecordingBackend()
    receiver = Receiver(backend, "m", ServedRecord(1))

    async def get_receiver(request: object) -> Receiver:
        return receiver

    app = FastAPI()
    app.include_router(build_router(get_receiver, token, max_body_bytes=LIMIT))
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://engine"), receiver, backend


def drain_body(size: int) -> bytes:
    """A valid drain request padded with JSON whitespace to exactly ``size`` bytes."""
    body = b'{"session": "' + b"a" * 32 + b'", "holder": "h", "mode": "wait"}'
    return body + b" " * (size - len(body))


async def chunks(body: bytes, size: int = 10) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def assert_too_large(
    response: httpx.Response, receiver: Receiver, backend: RecordingBackend
) -> None:
    assert response.status_code == 413
    assert response.json() == {
        "error": "body_too_large",
        "detail": f"request body exceeds {LIMIT} bytes; raise MOONCAKE_RL_MAX_BODY_BYTES on "
        "the engine if a legitimate prepare body is this large",
    }
    assert receiver.state.value == "serving" and backend.calls == []


@pytest.mark.parametrize(
    "content,headers",
    [
        pytest.param(drain_body(LIMIT + 1), {}, id="declared-honestly"),
        pytest.param(drain_body(LIMIT), {"content-length": str(LIMIT + 1)}, id="declared-over"),
        pytest.param(drain_body(LIMIT + 1), {"content-length": "2"}, id="declared-under"),
        pytest.param(chunks(drain_body(LIMIT + 1)), {}, id="chunked"),
    ],
)
async def test_bodies_over_the_limit_are_refused_unread(content, headers) -> None:
    http, receiver, backend = client()
    async with http:
        response = await http.post("/mooncake/drain", content=content, headers=headers)
    assert_too_large(response, receiver, backend)


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_of_exactly_the_limit_is_read(chunked: bool) -> None:
    http, receiver, backend = client()
    body = drain_body(LIMIT)
    async with http:
        response = await http.post("/mooncake/drain", content=chunks(body) if chunked else body)
    assert response.status_code == 200 and response.json()["state"] == "open"
    assert receiver.state.value == "open" and backend.calls == []  # opened, nothing paused


async def test_any_of_several_tokens_opens_the_routes() -> None:
    http, _, _ = client(("k1", "k2"))
    async with http:
        for token, status in (("k1", 200), ("k2", 200), ("k3", 401), ("", 401)):
            headers = {"authorization": f"Bearer {token}"}
            assert (await http.get("/mooncake/status", headers=headers)).status_code == status
        assert (await http.get("/mooncake/status")).status_code == 401


@pytest.mark.parametrize(
    "qualname,refusal",
    [
        (None, "VLLM_PLUGINS=mooncake needs the worker extension: add " + EXTENSION),
        ("", "VLLM_PLUGINS=mooncake needs the worker extension: add " + EXTENSION),
        ("collections.OrderedDict", "--worker-extension-cls collections.OrderedDict is not"),
        ("mooncake_rl.Ext", None),
        ("engine_ext.vllm.worker.MooncakeWorkerExtension", None),
    ],
)
def test_vllm_needs_the_worker_extension(qualname: str | None, refusal: str | None) -> None:
    pytest.importorskip("vllm")
    from engine_ext.vllm.plugins import require_worker_extension

    if refusal is None:
        require_worker_extension(qualname)
        return
    with pytest.raises(ConfigurationError) as refused:
        require_worker_extension(qualname)
    assert str(refused.value).startswith(refusal) and EXTENSION in str(refused.value)


def test_vllm_api_keys_are_the_ones_vllm_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from engine_ext.vllm.plugins import vllm_api_keys

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert vllm_api_keys(Namespace(api_key=["k1", "", "k2"])) == ["k1", "k2"]
    assert vllm_api_keys(Namespace(api_key=None)) == ["from-env"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert vllm_api_keys(Namespace(api_key=None)) == []
