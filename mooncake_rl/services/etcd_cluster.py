"""etcd members on loopback, for a durable Store that is given no etcd of its own.

    etcd_members(n) --> EtcdMember per free port pair --EmbeddedEtcd.spawn--> etcd processes
    --wait_ready--> a cluster whose endpoints the masters log to

Debian's ``etcd-server`` binary; the data directory is temporary and goes with the member.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mooncake_rl import etcd
from mooncake_rl.errors import ConfigurationError, ServiceError
from mooncake_rl.services.processes import ManagedProcess, Service, free_ports, service_log_dir

ETCD_INSTALL_HINT = "apt-get install -y etcd-server"


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


class EmbeddedEtcd(Service):
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
        if self.data_dir is None:  # a restarted member keeps its data and rejoins with it
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
        log = service_log_dir(self.log_dir) / f"etcd.{self.member.client_port}.log"
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

    def restart(self, timeout_s: float = 20.0) -> None:
        """Start a member that died again, from its own data: it rejoins its cluster and
        catches up from the others (a lone member's data is the whole log)."""
        process, self._process = self._process, None
        if process is not None:
            process.stop()
        self.spawn()
        self.wait_ready(timeout_s)

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            data_dir, self.data_dir = self.data_dir, None
            if data_dir is not None:
                shutil.rmtree(data_dir, ignore_errors=True)
