"""Start a pinned router (``vllm-router`` or ``sglang-router``) as a child process, for tests,
``mooncake-rl bench load`` and local setups; production routers run on their own."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.router.adapters import RouterError, RouterKind, RouterSpec, open_router
from mooncake_rl.services import ManagedProcess, free_ports

INSTALL_HINT = "install the router extra: pip install 'mooncake-rl[router]'"


def router_command(
    kind: RouterKind, host: str, port: int, metrics_port: int, api_key: str | None = None
) -> list[str]:
    """The command line of a round-robin router with no workers yet; ``api_key`` guards its
    worker API (sglang-router's control plane: vllm-router 0.1.17 has no such guard)."""
    common = ["--host", host, "--port", str(port), "--policy", "round_robin"]
    common += ["--prometheus-host", host, "--prometheus-port", str(metrics_port)]
    if api_key is not None:
        if kind != "sglang":
            raise ConfigurationError(
                f"{kind}-router does not guard its worker API with a key; use sglang-router "
                "(--control-plane-api-keys) or keep the router on a private network"
            )
        common += ["--control-plane-api-keys", f"mooncake-rl:mooncake-rl:admin:{api_key}"]
    if kind == "vllm":
        binary = Path(sys.executable).parent / "vllm-router"
        found = str(binary) if binary.exists() else shutil.which("vllm-router")
        if found is None:
            raise ConfigurationError(f"vllm-router is not installed; {INSTALL_HINT}")
        return [found, *common, "--worker-startup-timeout-secs", "60"]
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise ConfigurationError(f"sglang-router is not installed; {INSTALL_HINT}") from None
    return [sys.executable, "-m", "sglang_router.launch_router", *common]


class RouterProcess:
    """A router on a free loopback port; ``stop`` (or the ``with`` block's end) reaps it."""

    def __init__(
        self,
        kind: RouterKind,
        log_dir: Path,
        host: str = "127.0.0.1",
        api_key: str | None = None,
    ) -> None:
        self.kind = kind
        self.api_key = api_key
        self.port, metrics_port = free_ports(2, host)
        self.url = f"http://{host}:{self.port}"
        args = router_command(kind, host, self.port, metrics_port, api_key)
        log_dir.mkdir(parents=True, exist_ok=True)
        self._process = ManagedProcess(args, log_dir / f"{kind}-router.{self.port}.log")

    @property
    def spec(self) -> RouterSpec:
        return RouterSpec(self.url, self.kind, self.api_key)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _answers(self) -> bool:
        router = open_router(RouterSpec(self.url, self.kind, self.api_key, timeout_s=2.0))
        try:
            router.probe()
        except RouterError:
            return False
        finally:
            router.close()
        return True

    def start(self, timeout_s: float = 60.0) -> RouterProcess:
        try:
            self._process.spawn()
            self._process.wait_until(self._answers, f"{self.kind}-router", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._process.stop()

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
