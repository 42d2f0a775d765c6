"""Real routers and small real HTTP workers, always torn down."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from mooncake_rl.router.launch import RouterProcess
from mooncake_rl.services import ManagedProcess, free_port

pytest.importorskip("vllm_router")
pytest.importorskip("sglang_router")


class HttpWorker:
    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "tests.router.http_worker", str(self.port)]
        self._process = ManagedProcess(args, log_dir / f"worker.{self.port}.log")

    def start(self) -> HttpWorker:
        try:
            self._process.spawn()
            self._process.wait_until(self._healthy, "http worker", 30.0)
        except BaseException:
            self.stop()
            raise
        return self

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self._process.stop()


@pytest.fixture(scope="module")
def http_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[HttpWorker]]:
    log_dir = tmp_path_factory.mktemp("http-workers")
    started: list[HttpWorker] = []
    try:
        for _ in range(3):
            started.append(HttpWorker(log_dir).start())
        yield started
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture
def start_router(
    tmp_path: Path,
) -> Iterator[Callable[..., RouterProcess]]:
    started: list[RouterProcess] = []

    def start(kind: str, api_key: str | None = None) -> RouterProcess:
        router = RouterProcess(kind, tmp_path / "routers", api_key=api_key)  # type: ignore[arg-type]
        started.append(router)
        return router.start()

    try:
        yield start
    finally:
        for router in started:
            router.stop()
