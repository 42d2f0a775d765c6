"""The adapters against real ``vllm-router`` and ``sglang-router`` binaries with real HTTP
workers: the add / remove / list cycle, what traffic reaches, and the refusals."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.router import RouterError, RouterSpec, open_router
from mooncake_rl.router.launch import RouterProcess
from mooncake_rl.services import free_port
from tests.router.conftest import HttpWorker

pytestmark = pytest.mark.timeout(180)


def served_by(router: RouterProcess, requests: int = 6) -> set[int]:
    """Which workers answered ``requests`` completions sent through the router."""
    seen = set()
    for _ in range(requests):
        response = httpx.post(
            f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30
        )
        assert response.status_code == 200, response.text
        seen.add(response.json()["worker"])
    return seen


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_add_remove_list_cycle_decides_where_traffic_goes(
    kind: str, start_router: Callable[[str], RouterProcess], http_workers: list[HttpWorker]
) -> None:
    running = start_router(kind)
    router = open_router(running.spec)
    first, second = http_workers[0], http_workers[1]
    try:
        router.probe()
        assert router.workers() == []
        router.add(first.url + "/")  # a trailing slash names the same engine
        router.add(first.url)  # adding a listed engine is fine
        router.add(second.url)
        assert sorted(router.workers()) == sorted([first.url, second.url])
        assert served_by(running) == {first.port, second.port}
        router.remove(first.url)
        router.remove(first.url)  # removing an absent engine is fine
        assert router.workers() == [second.url]
        assert served_by(running) == {second.port}  # no new request reaches the removed one
        router.remove(second.url)
        assert router.workers() == []
        empty = httpx.post(
            f"{running.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30
        )
        assert empty.status_code == 503
    finally:
        router.close()


def test_a_router_without_the_expected_api_fails_the_probe(
    start_router: Callable[[str], RouterProcess],
) -> None:
    """sglang-router has no ``/list_workers``. (vllm-router 0.1.17 also serves sglang's
    ``/workers`` API, so the sglang adapter works against it: no skew to detect there.)"""
    running = start_router("sglang")
    router = open_router(RouterSpec(running.url, "vllm"))
    try:
        with pytest.raises(RouterError, match="not a vllm-router worker API; is --router-kind"):
            router.probe()
    finally:
        router.close()


def test_an_unreachable_router_fails_the_probe() -> None:
    router = open_router(RouterSpec(f"http://127.0.0.1:{free_port()}", "vllm", timeout_s=2))
    try:
        with pytest.raises(RouterError, match="did not answer GET /list_workers"):
            router.probe()
    finally:
        router.close()


def test_adding_an_engine_that_never_becomes_healthy_fails(
    start_router: Callable[[str], RouterProcess],
) -> None:
    running = start_router("sglang")
    router = open_router(RouterSpec(running.url, "sglang", timeout_s=5))
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        with pytest.raises(RouterError, match=f"accepted adding {dead} but its list did not"):
            router.add(dead)
        assert router.workers() == []
    finally:
        router.close()


@pytest.mark.parametrize(
    ("url", "kind", "problem"),
    [
        ("127.0.0.1:8000", "vllm", "must start with http"),
        ("http://127.0.0.1:8000", "nginx", "is not one of vllm, sglang"),
    ],
)
def test_bad_router_specs_are_refused(url: str, kind: str, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        RouterSpec(url, kind)  # type: ignore[arg-type]
