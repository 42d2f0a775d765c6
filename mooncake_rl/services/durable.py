"""The durable Store: etcd and HA masters that log every change to it, one of them leading.

etcd (embedded unless --etcd names one) --> N EmbeddedMasters with the operation log
--> one leads, named in etcd --> clients dial ``etcd://...`` and follow the leader;
a standby that takes over replays the log, so no object is lost with a master
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from mooncake_rl import etcd
from mooncake_rl.errors import ConfigurationError, ServiceError
from mooncake_rl.services.etcd_cluster import EmbeddedEtcd, etcd_members
from mooncake_rl.services.master import (
    DEFAULT_CLUSTER_ID,
    P2P_HANDSHAKE,
    EmbeddedMaster,
    MasterConfig,
)
from mooncake_rl.services.processes import Lifecycle, Service, wait_for

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


GIVEN_LOOK_S = 2.0
"""How often ``heal`` asks each member of a given etcd whether it answers."""
LEADER_WAIT_S = 30.0
"""How long ``heal`` waits for a leader before it replaces standbys."""


class DurableStore(Lifecycle):
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
        self._silent: set[str] = set()
        """Members of a given etcd (``--etcd``) that stopped answering: not ours to restart."""
        self._looked_at = -math.inf

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
    def services(self) -> list[Service]:
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

    def heal(self) -> list[str]:
        """Restart what died: embedded etcd members, then masters; what happened, for the log."""
        return [*self.restart_dead_members(), *self.replace_dead_masters()]

    def restart_dead_members(self) -> list[str]:
        """Restart each embedded etcd member that died, or name each member of a given etcd
        that stopped answering, then replace every standby master.

        A standby that followed the log through a member that died misses every later entry
        (seen here: a leader killed afterwards handed over to such a standby, and what was
        published after the member's death was lost); a fresh standby reads the log through
        a live member. The leader keeps leading throughout.
        """
        lost, back = self._given_members()
        for member in self.etcd:
            code = member.poll()
            if code is None:
                continue
            member.restart()
            lost.append(
                f"etcd member {member.endpoint} exited with code {code} (see "
                f"{member.log_path}); restarted from its data"
            )
        events = [*lost, *back]
        if not lost:
            return events
        try:
            leader = self.wait_for_leader(LEADER_WAIT_S)
        except (ServiceError, ConfigurationError) as error:  # no quorum: nothing reads the log
            return [*events, f"standbys kept: {error}"]
        for index, master in enumerate(self.masters):
            if master is not leader:
                fresh = self._replace(index)
                events.append(
                    f"standby {master.rpc_address} replaced by {fresh.rpc_address}: it reads "
                    "the log through a live member"
                )
        return events

    def _given_members(self) -> tuple[list[str], list[str]]:
        """Members of a given etcd (``--etcd``) that stopped answering since the last look,
        and those that answer again; looked at every ``GIVEN_LOOK_S`` at most."""
        if self.config.etcd is None or time.monotonic() - self._looked_at < GIVEN_LOOK_S:
            return [], []
        self._looked_at = time.monotonic()
        lost, back = [], []
        for endpoint in etcd.parse_endpoints(self.endpoints):
            answers = etcd.healthy(endpoint)
            if not answers and endpoint not in self._silent:
                self._silent.add(endpoint)
                lost.append(
                    f"etcd member {endpoint} (given with --etcd) stopped answering: it is not "
                    "ours to restart, restart it where it runs; the Store serves while a "
                    "majority of its members answers"
                )
            elif answers and endpoint in self._silent:
                self._silent.discard(endpoint)
                back.append(f"etcd member {endpoint} (given with --etcd) answers again")
        return lost, back

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
            fresh = self._replace(index)
            events.append(
                f"mooncake_master {master.rpc_address} exited with code {code} (see {log}); "
                f"standby {fresh.rpc_address} started in its place"
            )
        return events

    def _replace(self, index: int) -> EmbeddedMaster:
        """Stop master ``index`` and start a fresh standby in its place."""
        self.masters[index].stop()
        fresh = EmbeddedMaster(self.config.master_config(self.endpoints))
        self.masters[index] = fresh
        fresh.start()
        return fresh

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

    @property
    def started(self) -> bool:
        return bool(self.masters)


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
