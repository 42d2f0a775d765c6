"""One ``mooncake_master``: in memory with its HTTP metadata server, or an HA member.

    MasterConfig (validated) --EmbeddedMaster.start--> mooncake_master on free loopback
    ports --> ready when its RPC port accepts calls (and, in memory, its metadata answers)

A plain master keeps its state in memory; the pytest fixtures use it. An HA member logs
every change to etcd, so a standby or a restart replays it (:mod:`.durable`).
"""

from __future__ import annotations

import http.client
import json
import re
from dataclasses import dataclass
from pathlib import Path

from mooncake_rl import etcd
from mooncake_rl.errors import ServiceError
from mooncake_rl.services.processes import (
    ManagedProcess,
    Service,
    accepts_connections,
    check_system_libraries,
    free_ports,
    master_binary,
    service_log_dir,
)

P2P_HANDSHAKE = "P2PHANDSHAKE"


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


class EmbeddedMaster(Service):
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

    def stop(self) -> None:
        """This process's parked clients of this master first (a client that lends no
        memory is parked at close, :func:`mooncake_rl.store.close_parked`), then the master."""
        from mooncake_rl.store import close_parked

        if self.started and self.config.etcd is None:
            close_parked(self.master_address)
        super().stop()

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
        return accepts_connections(self.config.host, self.rpc_port) and self._metadata_answers()

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
        log = service_log_dir(self.config.log_dir) / f"mooncake_master.{self.rpc_port}.log"
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
