"""Embedded ``mooncake_master`` with its HTTP metadata server, on free loopback ports.

One class serves ``mooncake-rl master`` (foreground) and the pytest fixture. The child runs
in its own process group and receives SIGTERM if its parent dies (``PR_SET_PDEATHSIG``), so
neither a failed test nor a killed CLI leaves a master behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from mooncake_rl.errors import ConfigurationError, ServiceError

SYSTEM_LIBRARIES = ("libibverbs.so.1", "librdmacm.so.1", "libnuma.so.1")
INSTALL_HINT = "apt-get install -y libibverbs1 librdmacm1 libnuma1"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def master_binary() -> Path:
    """The ``mooncake_master`` shipped in the Mooncake wheel, else one on ``PATH``."""
    try:
        import mooncake
    except ImportError as error:  # pragma: no cover - exercised only without the wheel
        raise ConfigurationError(
            "the Mooncake wheel is not installed: pip install mooncake-transfer-engine-non-cuda"
        ) from error
    shipped = Path(mooncake.__file__).parent / "mooncake_master"
    found = shipped if shipped.exists() else shutil.which("mooncake_master")
    if found is None:
        raise ConfigurationError("mooncake_master not found in the Mooncake wheel or on PATH")
    binary = Path(found)
    if not os.access(binary, os.X_OK):
        raise ConfigurationError(f"{binary} is not executable: chmod +x {binary}")
    return binary


def missing_system_libraries() -> list[str]:
    """Libraries Mooncake's native code links against that the loader cannot find."""
    missing = []
    for name in SYSTEM_LIBRARIES:
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    return missing


def check_system_libraries() -> None:
    missing = missing_system_libraries()
    if missing:
        raise ConfigurationError(
            f"Mooncake needs {', '.join(missing)} even for TCP; install them: {INSTALL_HINT}"
        )


def _die_with_parent() -> None:
    """Runs in the child before exec: its own process group, SIGTERM when the parent dies."""
    os.setsid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass(frozen=True)
class MasterConfig:
    host: str = "127.0.0.1"
    rpc_port: int = 0
    metadata_port: int = 0
    metrics_port: int = 0
    lease_ttl_ms: int = 10_000
    client_ttl_s: int = 10
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.lease_ttl_ms <= 0 or self.client_ttl_s <= 0:
            raise ValueError("lease_ttl_ms and client_ttl_s must be positive")


@dataclass
class EmbeddedMaster:
    """A running ``mooncake_master``; use as a context manager or call start/stop."""

    config: MasterConfig = field(default_factory=MasterConfig)
    rpc_port: int = 0
    metadata_port: int = 0
    metrics_port: int = 0
    log_path: Path | None = None
    _process: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        return f"{self.config.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.config.host}:{self.metadata_port}/metadata"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, timeout_s: float = 20.0) -> EmbeddedMaster:
        if self._process is not None:
            raise ServiceError("master already started")
        check_system_libraries()
        binary = master_binary()
        host = self.config.host
        self.rpc_port = self.config.rpc_port or free_port(host)
        self.metadata_port = self.config.metadata_port or free_port(host)
        self.metrics_port = self.config.metrics_port or free_port(host)
        log_dir = self.config.log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"mooncake_master.{self.rpc_port}.log"
        args = [
            str(binary),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_host={host}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.config.lease_ttl_ms}",
            f"--client_ttl={self.config.client_ttl_s}",
        ]
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise ServiceError(f"mooncake_master exited early; see {self.log_path}")
            if self._accepts(self.rpc_port) and self._metadata_answers():
                return
            time.sleep(0.05)
        raise ServiceError(f"mooncake_master not healthy after {timeout_s}s; see {self.log_path}")

    def _accepts(self, port: int) -> bool:
        with (
            contextlib.suppress(OSError),
            socket.create_connection((self.config.host, port), timeout=0.5),
        ):
            return True
        return False

    def _metadata_answers(self) -> bool:
        connection = http.client.HTTPConnection(self.config.host, self.metadata_port, timeout=1)
        try:
            connection.request("GET", "/metadata?key=mooncake-rl-health")
            return connection.getresponse().status in (200, 404)
        except OSError:
            return False
        finally:
            connection.close()

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the master's process group; escalate to SIGKILL; always reap."""
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def wait(self) -> int:
        """Block until the master exits (foreground ``mooncake-rl master``)."""
        if self._process is None:
            raise ServiceError("master not started")
        return self._process.wait()

    def __enter__(self) -> EmbeddedMaster:
        return self.start() if self._process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
