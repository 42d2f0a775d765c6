"""The Store's processes on free loopback ports: etcd, ``mooncake_master``s, segment holders.

Durable Store (:class:`DurableStore`, the default of ``mooncake-rl master``): an etcd
(:class:`EmbeddedEtcd`, unless given one) → N HA masters logging every change to it
(:class:`EmbeddedMaster` with ``etcd``) → one of them leads, named in etcd → clients dial
``etcd://...`` and follow the leader. A plain master (:class:`EmbeddedMaster` alone) keeps
its state in memory and serves HTTP metadata; the pytest fixtures use it. Each child runs
in its own process group and receives SIGTERM if its parent dies (``PR_SET_PDEATHSIG``), so
neither a failed test nor a killed CLI leaves one behind. Foreground commands stop on
SIGTERM/SIGINT through :class:`StopSignals` and :func:`serve_until_stopped`: the signal handler
only records the signal, and the main thread stops the children outside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

from mooncake_rl import etcd
from mooncake_rl.errors import ConfigurationError, ServiceError

SYSTEM_LIBRARIES = ("libibverbs.so.1", "librdmacm.so.1", "libnuma.so.1")
INSTALL_HINT = "apt-get install -y libibverbs1 librdmacm1 libnuma1"
ETCD_INSTALL_HINT = "apt-get install -y etcd-server"
P2P_HANDSHAKE = "P2PHANDSHAKE"


def free_ports(count: int, host: str = "127.0.0.1") -> tuple[int, ...]:
    """``count`` distinct TCP ports nobody listens on right now (the kernel picks them).

    Every socket stays bound until all are picked. The kernel picks each port at random
    from about 14,000, so three picked one after another repeat one for about 1 master
    start in 5,000, and that master then dies binding it.
    """
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return tuple(int(sock.getsockname()[1]) for sock in sockets)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    return free_ports(1, host)[0]


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
    """Runs in the child before exec: its own process group, SIGTERM when the parent dies.

    A process group, not a new session: Linux gives every session its own scheduling
    autogroup, and a group's CPU share is split across cores by where its load runs. A
    pinned engine rank in a session whose load sits on other cores then gets almost no time
    on its own core beside another session's busy pinned worker (seen as a TP rank runnable
    but starved for tens of seconds mid-update). Children share the caller's session, so
    threads compete one to one.
    """
    os.setpgid(0, 0)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class ManagedProcess:
    """A child in its own process group that dies with its parent; ``stop`` always reaps.

    Construct it, keep the reference, then :meth:`spawn` inside the ``try`` whose handler
    calls ``stop``: whatever fails after the fork, the child is recorded here and reaped.
    """

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.returncode: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        if self._process is not None or self.returncode is not None:
            raise ServiceError(f"{self.args[0]} already spawned")
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                env=self.env,
            )

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Poll ``ready``; raise :class:`Stopped` once a stop signal was recorded."""
        wait_for(ready, what, timeout_s, [self])

    def poll(self) -> int | None:
        """The exit code once the child has exited (it is then reaped), else ``None``."""
        return self._process.poll() if self._process is not None else self.returncode

    def wait(self, timeout_s: float | None = None) -> int:
        """Poll until the child exits; ``TimeoutError`` after ``timeout_s``.

        Polling instead of a blocking ``Popen.wait`` means this frame never sits inside
        ``waitpid`` holding subprocess's waitpid lock, so nothing that interrupts it (a signal
        handler, another thread) can deadlock on that lock while reaping the same child.
        """
        process = self._process
        if process is None:
            raise ServiceError("process not started")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (code := process.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"pid {process.pid} still running after {timeout_s}s")
            time.sleep(0.05)
        return code

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the process group; escalate to SIGKILL; always reap.

        Every wait here is bounded, so a stop can never hang on a child or on the waitpid lock.
        """
        process = self._process
        if process is None:
            return
        try:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            raise ServiceError(
                f"pid {process.pid} survived SIGKILL for {timeout_s}s; see {self.log_path}"
            ) from error
        finally:
            if process.returncode is not None:
                self.returncode, self._process = process.returncode, None


def wait_for(
    ready: Callable[[], bool], what: str, timeout_s: float, needed: Sequence[ManagedProcess]
) -> None:
    """Poll ``ready`` while every ``needed`` child runs; :class:`Stopped` on a stop signal."""
    deadline = time.monotonic() + timeout_s
    logs = ", ".join(str(process.log_path) for process in needed)
    while time.monotonic() < deadline:
        StopSignals.raise_if_stopped()
        for process in needed:
            if not process.is_running():
                raise ServiceError(
                    f"{what}: {process.args[0]} exited early; see {process.log_path}"
                )
        if ready():
            return
        time.sleep(0.05)
    raise ServiceError(f"{what} not healthy after {timeout_s}s; see {logs}")


def _accepts(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def _log_dir(configured: Path | None) -> Path:
    directory = configured or Path(os.environ.get("TMPDIR", "/tmp"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class _Service:
    """Context-manager plumbing shared by the embedded services."""

    name = "service"
    _process: ManagedProcess | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.is_running()

    def poll(self) -> int | None:
        """The child's exit code if it exited on its own, ``None`` while it runs."""
        if self._process is None:
            raise ServiceError("service not started")
        return self._process.poll()

    @property
    def log_path(self) -> Path | None:
        return self._process.log_path if self._process is not None else None

    def wait(self, timeout_s: float | None = None) -> int:
        if self._process is None:
            raise ServiceError("service not started")
        return self._process.wait(timeout_s)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.stop()

    def start(self) -> Self:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start() if self._process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class Stopped(BaseException):
    """A stop signal arrived while services were still starting (like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGTERM and SIGINT as a flag that ordinary code polls.

    The handler never raises or stops anything: a Python handler runs on the main thread
    between any two bytecodes, for example inside ``Popen`` between fork and exec (the child
    is then lost, unkilled and unreaped) or inside a ``Popen.wait`` that holds subprocess's
    waitpid lock (stopping children from there deadlocked ``mooncake-rl master``, issue 14).
    It records the signal; a start in progress sees it in :meth:`ManagedProcess.wait_until`,
    which raises :class:`Stopped` so the caller's ``with`` blocks stop what did start, and a
    running service sees it in :func:`serve_until_stopped`.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    _recorded: int | None = None
    """The signal recorded by the active instance (there is one per process: the CLI's)."""

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}

    @property
    def signum(self) -> int | None:
        return StopSignals._recorded

    @staticmethod
    def _handle(signum: int, frame: FrameType | None) -> None:
        StopSignals._recorded = signum

    @staticmethod
    def raise_if_stopped() -> None:
        if StopSignals._recorded is not None:
            raise Stopped(StopSignals._recorded)

    def __enter__(self) -> Self:
        StopSignals._recorded = None
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        StopSignals._recorded = None
        return exc_type is Stopped  # a stop during startup is a clean stop


def serve_until_stopped(
    services: Sequence[_Service],
    stop: StopSignals,
    poll_s: float = 0.1,
    tick: Callable[[], None] | None = None,
) -> int:
    """Keep services in the foreground until a stop signal (returns 0).

    Polls with a short sleep instead of blocking in ``waitpid``, so a signal is seen within
    ``poll_s`` and the caller stops the services in ordinary code. A service that exits on its
    own raises :class:`ServiceError` naming its log; the caller's ``with`` stops the others.
    ``tick`` runs every poll (a durable Store replaces its dead masters there).
    """
    while stop.signum is None:
        if tick is not None:
            tick()
        for service in services:
            code = service.poll()
            if code is not None:
                raise ServiceError(
                    f"{service.name} exited with code {code}; see {service.log_path}"
                )
        time.sleep(poll_s)
    return 0


_CLUSTER_ID = re.compile(r"[A-Za-z0-9_-]+")
DEFAULT_CLUSTER_ID = "mooncake_cluster"
"""Mooncake's own default (masters' ``--cluster_id``, clients' ``MC_STORE_CLUSTER_ID``): a
master restarted against the same etcd with the same id replays the operation log."""


@dataclass(frozen=True)
class MasterConfig:
    """One ``mooncake_master``: in memory with HTTP metadata, or HA with its log in ``etcd``."""

    host: str = "127.0.0.1"
    rpc_port: int = 0
    metadata_port: int = 0
    metrics_port: int = 0
    lease_ttl_ms: int = 10_000
    client_ttl_s: int = 10
    log_dir: Path | None = None
    etcd: str | None = None
    cluster_id: str = DEFAULT_CLUSTER_ID

    def __post_init__(self) -> None:
        if self.lease_ttl_ms <= 0 or self.client_ttl_s <= 0:
            raise ValueError("lease_ttl_ms and client_ttl_s must be positive")
        if self.etcd is not None:
            etcd.parse_endpoints(self.etcd)
        if not _CLUSTER_ID.fullmatch(self.cluster_id):
            raise ValueError(
                f"cluster_id must be letters, digits, - and _; got {self.cluster_id!r}"
            )


class EmbeddedMaster(_Service):
    """A running ``mooncake_master``: with its HTTP metadata server, or as an HA member.

    An HA member (``config.etcd`` set) keeps every object's metadata in etcd's operation log
    and serves no metadata itself (it would die with it): its clients use P2PHANDSHAKE. It is
    "started" once it runs; whether it leads is :class:`DurableStore`'s question.
    """

    name = "mooncake_master"

    def __init__(self, config: MasterConfig | None = None) -> None:
        self.config = config or MasterConfig()
        self.rpc_port = self.metadata_port = self.metrics_port = 0
        self._process = None

    @property
    def cluster_id(self) -> str:
        return self.config.cluster_id

    @property
    def rpc_address(self) -> str:
        """This process's own RPC endpoint (what an HA leader writes into etcd)."""
        return f"{self.config.host}:{self.rpc_port}"

    @property
    def master_address(self) -> str:
        """What clients dial: this process, or the HA cluster's etcd."""
        return f"{etcd.ETCD_SCHEME}{self.config.etcd}" if self.config.etcd else self.rpc_address

    @property
    def metadata_url(self) -> str:
        if self.config.etcd:
            return P2P_HANDSHAKE
        return f"http://{self.config.host}:{self.metadata_port}/metadata"

    def _mode_args(self) -> list[str]:
        if self.config.etcd:
            return [
                "--enable_ha=true",
                "--enable_oplog=true",
                f"--ha_backend_connstring={self.config.etcd}",
                f"--cluster_id={self.config.cluster_id}",
            ]
        return [
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.config.host}",
            f"--http_metadata_server_port={self.metadata_port}",
        ]

    def serves(self) -> bool:
        """An HA member that leads and has left its warm-up (its ``/health`` says so).

        A new leader accepts RPCs during a warm-up of one etcd lease (5 s) before it serves;
        what a client mounts or writes in that time is not all in the operation log.
        """
        connection = http.client.HTTPConnection(self.config.host, self.metrics_port, timeout=1)
        try:
            connection.request("GET", "/health")
            health = json.loads(connection.getresponse().read())
        except (OSError, ValueError):
            return False
        finally:
            connection.close()
        return health.get("role") == "leader" and health.get("service_ready") is True

    def _ready(self) -> bool:
        if self.config.etcd:
            return True
        return _accepts(self.config.host, self.rpc_port) and self._metadata_answers()

    def start(self, timeout_s: float = 20.0) -> EmbeddedMaster:
        if self._process is not None:
            raise ServiceError("master already started")
        check_system_libraries()
        binary = master_binary()
        host = self.config.host
        rpc, metadata, metrics = free_ports(3, host)
        self.rpc_port = self.config.rpc_port or rpc
        self.metadata_port = self.config.metadata_port or metadata
        self.metrics_port = self.config.metrics_port or metrics
        args = [
            str(binary),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={host}",
            *self._mode_args(),
            f"--metrics_host={host}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.config.lease_ttl_ms}",
            f"--client_ttl={self.config.client_ttl_s}",
        ]
        log = _log_dir(self.config.log_dir) / f"mooncake_master.{self.rpc_port}.log"
        # Its own file: INFO there (elections, log replay) whatever level the caller's env asks.
        self._process = ManagedProcess(args, log, {"GLOG_minloglevel": "0"})
        try:
            self._process.spawn()
            self._process.wait_until(self._ready, "mooncake_master", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _metadata_answers(self) -> bool:
        connection = http.client.HTTPConnection(self.config.host, self.metadata_port, timeout=1)
        try:
            connection.request("GET", "/metadata?key=mooncake-rl-health")
            return connection.getresponse().status in (200, 404)
        except OSError:
            return False
        finally:
            connection.close()


@dataclass(frozen=True)
class EtcdMember:
    """One member of an etcd cluster on ``host``: its name and its client and peer ports."""

    name: str
    host: str
    client_port: int
    peer_port: int

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


def etcd_members(count: int, host: str = "127.0.0.1") -> tuple[EtcdMember, ...]:
    """``count`` members on free ports (an odd count: a quorum survives ``count // 2`` losses)."""
    if count < 1 or count % 2 == 0:
        raise ValueError(f"an etcd cluster needs an odd number of members, got {count}")
    ports = free_ports(2 * count, host)
    return tuple(
        EtcdMember(f"mooncake-rl-{index}", host, ports[2 * index], ports[2 * index + 1])
        for index in range(count)
    )


class EmbeddedEtcd(_Service):
    """One etcd member of ``cluster``; its data lives in a temp dir removed at stop.

    :meth:`spawn` starts it and :meth:`wait_ready` waits for it: the members of a cluster
    are all spawned before any is waited for, since none answers before a quorum runs.
    """

    name = "etcd"

    def __init__(
        self,
        member: EtcdMember,
        cluster: Sequence[EtcdMember],
        log_dir: Path | None = None,
        quota_bytes: int | None = None,
    ) -> None:
        self.member = member
        self.cluster = tuple(cluster)
        self.log_dir = log_dir
        self.quota_bytes = quota_bytes
        self.data_dir: Path | None = None
        self._process = None

    @property
    def endpoint(self) -> str:
        return self.member.endpoint

    def spawn(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise ConfigurationError(
                f"the durable Store needs etcd; install it: {ETCD_INSTALL_HINT} (or `make sysdeps`)"
            )
        self.data_dir = Path(tempfile.mkdtemp(prefix="mooncake-rl-etcd-"))
        client_url = f"http://{self.endpoint}"
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.cluster)
        args = [
            binary,
            f"--name={self.member.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={self.member.peer_url}",
            f"--initial-advertise-peer-urls={self.member.peer_url}",
            f"--initial-cluster={initial}",
            *([f"--quota-backend-bytes={self.quota_bytes}"] if self.quota_bytes else []),
        ]
        log = _log_dir(self.log_dir) / f"etcd.{self.member.client_port}.log"
        self._process = ManagedProcess(args, log)
        self._process.spawn()

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        if self._process is None:
            raise ServiceError("etcd not spawned")
        self._process.wait_until(lambda: etcd.healthy(self.endpoint), "etcd", timeout_s)

    def start(self, timeout_s: float = 20.0) -> EmbeddedEtcd:
        try:
            self.spawn()
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            data_dir, self.data_dir = self.data_dir, None
            if data_dir is not None:
                shutil.rmtree(data_dir, ignore_errors=True)


ETCD_CONNECT_S = 3.0
"""How long ``--etcd`` may take to answer before the start fails naming it."""


@dataclass(frozen=True)
class DurableConfig:
    """The durable Store: ``masters`` HA masters logging to ``etcd`` (``None``: start an
    ``etcd_members``-member cluster on loopback)."""

    host: str = "127.0.0.1"
    masters: int = 2
    etcd: str | None = None
    etcd_members: int = 1
    cluster_id: str = DEFAULT_CLUSTER_ID
    lease_ttl_ms: int = 10_000
    client_ttl_s: int = 10
    log_dir: Path | None = None
    etcd_quota_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.masters < 1:
            raise ConfigurationError(f"--masters must be at least 1, got {self.masters}")
        if self.etcd_members < 1 or self.etcd_members % 2 == 0:
            raise ConfigurationError(
                f"--etcd-members must be odd (1, 3, 5: a majority survives), got "
                f"{self.etcd_members}"
            )
        if self.etcd_quota_bytes is not None and self.etcd_quota_bytes <= 0:
            raise ConfigurationError(
                f"--etcd-quota-bytes must be positive, got {self.etcd_quota_bytes}"
            )
        self.master_config()  # validates the rest

    def master_config(self, endpoints: str | None = None) -> MasterConfig:
        return MasterConfig(
            host=self.host,
            lease_ttl_ms=self.lease_ttl_ms,
            client_ttl_s=self.client_ttl_s,
            log_dir=self.log_dir,
            etcd=endpoints or self.etcd,
            cluster_id=self.cluster_id,
        )


class DurableStore:
    """etcd (embedded unless given) and ``masters`` HA masters, one of which leads.

    Clients dial ``etcd://<endpoints>`` with ``MC_STORE_CLUSTER_ID`` set to ``cluster_id``
    and follow the leader themselves; a standby that takes over replays the operation log,
    so every object survives the leader's death. Started means a leader serves.
    """

    def __init__(self, config: DurableConfig | None = None) -> None:
        self.config = config or DurableConfig()
        self.etcd: list[EmbeddedEtcd] = []
        self.endpoints = ""
        self.masters: list[EmbeddedMaster] = []

    @property
    def master_address(self) -> str:
        return f"{etcd.ETCD_SCHEME}{self.endpoints}"

    @property
    def metadata_url(self) -> str:
        return P2P_HANDSHAKE

    @property
    def cluster_id(self) -> str:
        return self.config.cluster_id

    @property
    def services(self) -> list[_Service]:
        """Every process this object runs (for :func:`serve_until_stopped`)."""
        return [*self.etcd, *self.masters]

    def start(self, timeout_s: float = 30.0) -> Self:
        try:
            if self.config.etcd is None:
                self._start_etcd()
            else:
                self.endpoints = self.config.etcd
                require_etcd(self.endpoints)
            for _ in range(self.config.masters):
                master = EmbeddedMaster(self.config.master_config(self.endpoints))
                self.masters.append(master)
                master.start()
            self.wait_for_leader(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_etcd(self) -> None:
        cluster = etcd_members(self.config.etcd_members, self.config.host)
        self.etcd = [
            EmbeddedEtcd(member, cluster, self.config.log_dir, self.config.etcd_quota_bytes)
            for member in cluster
        ]
        for member in self.etcd:
            member.spawn()
        for member in self.etcd:
            member.wait_ready()
        self.endpoints = ";".join(member.endpoint for member in self.etcd)

    def leader_address(self) -> str | None:
        """The RPC endpoint etcd names as leader, ``None`` mid-election."""
        return etcd.leader(self.endpoints, self.cluster_id)

    def leader(self) -> EmbeddedMaster | None:
        """Which of our masters leads (``None`` mid-election or when another process does)."""
        address = self.leader_address()
        return next((m for m in self.masters if m.rpc_address == address), None)

    def wait_for_leader(self, timeout_s: float = 30.0) -> EmbeddedMaster:
        """The leader of our masters, once etcd names a live one that accepts calls."""
        found: list[EmbeddedMaster] = []

        def serving() -> bool:
            if not any(master.is_running() for master in self.masters):
                logs = ", ".join(str(master.log_path) for master in self.masters)
                raise ServiceError(f"every master of {self.cluster_id!r} exited; see {logs}")
            leader = self.leader()
            if leader is None or not leader.is_running():
                return False
            found[:] = [leader]
            return leader.serves()

        needed = [m._process for m in self.etcd if m._process and len(self.etcd) == 1]
        wait_for(serving, f"leader of Store cluster {self.cluster_id!r}", timeout_s, needed)
        return found[0]

    def replace_dead_masters(self) -> list[str]:
        """Start a fresh standby for each master that died; what happened, for the log.

        A killed leader's standby takes over by itself; starting a new standby in its place
        keeps the Store able to survive the next loss too.
        """
        events = []
        for index, master in enumerate(self.masters):
            code = master.poll()
            if code is None:
                continue
            log = master.log_path
            master.stop()
            fresh = EmbeddedMaster(self.config.master_config(self.endpoints))
            self.masters[index] = fresh
            fresh.start()
            events.append(
                f"mooncake_master {master.rpc_address} exited with code {code} (see {log}); "
                f"standby {fresh.rpc_address} started in its place"
            )
        return events

    def stop(self) -> None:
        """This process's parked clients of the Store, then the masters (their clients'
        leases in etcd lapse), then etcd; always all."""
        from mooncake_rl.store import close_parked

        try:
            if self.endpoints:
                close_parked(self.master_address)
            for master in reversed(self.masters):
                master.stop()
        finally:
            for member in self.etcd:
                member.stop()

    def __enter__(self) -> Self:
        return self.start() if not self.masters else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def require_etcd(endpoints: str, timeout_s: float = ETCD_CONNECT_S) -> None:
    """Fail within ``timeout_s`` naming the endpoints when no member of them answers."""
    members = etcd.parse_endpoints(endpoints)
    deadline = time.monotonic() + timeout_s
    while not any(etcd.healthy(member, timeout_s=0.5) for member in members):
        if time.monotonic() >= deadline:
            raise ConfigurationError(
                f"no etcd answers at {endpoints} after {timeout_s:.0f}s; start etcd there, or "
                "leave --etcd out to run one embedded"
            )
        time.sleep(0.1)


_SEGMENT_PORT = re.compile(rb"Successfully created client on port (\d+)")
_SERVICE_UP = re.compile(rb"Starting real client service on ")


class SegmentHolder(_Service):
    """A standalone Mooncake client (``mooncake_client``) lending a node's memory to the Store.

    Trainer ranks prefer this node-local segment; because it outlives them, a crashed trainer
    rank or a short-lived ``mooncake-rl publish`` loses no announced generation.
    """

    name = "mooncake_client"

    def __init__(
        self,
        master_address: str,
        metadata_url: str,
        segment_bytes: int,
        host: str = "127.0.0.1",
        log_dir: Path | None = None,
        cluster_id: str = DEFAULT_CLUSTER_ID,
    ) -> None:
        if segment_bytes <= 0:
            raise ValueError("segment_bytes must be positive")
        self.cluster_id = cluster_id
        self.master_address = master_address
        self.metadata_url = metadata_url
        self.segment_bytes = segment_bytes
        self.host = host
        self.log_dir = log_dir
        self.segment = ""
        self._process = None

    def start(self, timeout_s: float = 30.0) -> SegmentHolder:
        check_system_libraries()
        binary = master_binary().parent / "mooncake_client"
        port = free_port(self.host)
        args = [
            str(binary),
            f"--host={self.host}",
            f"--port={port}",
            f"--global_segment_size={self.segment_bytes}",
            "--local_buffer_size=16MB",
            f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_url}",
            "--protocol=tcp",
        ]
        # Readiness is read from INFO lines of its log, whatever level the caller's env asks.
        env = {
            "MC_FORCE_TCP": "1",
            "MC_TCP_BIND_ADDRESS": self.host,
            "GLOG_minloglevel": "0",
            "MC_LOG_LEVEL": "INFO",
            "MC_STORE_CLUSTER_ID": self.cluster_id,
        }
        log = _log_dir(self.log_dir) / f"mooncake_client.{port}.log"
        self._process = ManagedProcess(args, log, env)
        try:
            self._process.spawn()
            self._process.wait_until(self._ready, "mooncake_client", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        assert self._process is not None
        text = self._process.log_path.read_bytes()
        found = _SEGMENT_PORT.search(text)
        if found is None or _SERVICE_UP.search(text) is None:
            return False
        self.segment = f"{self.host}:{int(found.group(1))}"
        return True
