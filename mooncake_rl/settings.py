"""One settings object, read from ``MOONCAKE_RL_*`` environment variables; flags override.

Defaults work on loopback with an embedded master; a real cluster sets the master address
(``etcd://...`` and the cluster id for a durable Store),
an HTTP/etcd metadata URL (or ``P2PHANDSHAKE``), ``rdma`` and this host's reachable address.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from mooncake_rl.etcd import ETCD_SCHEME, parse_endpoints

MiB = 1 << 20


class Settings(BaseSettings):
    """Where the Store is, how this client talks to it, and how much memory it lends."""

    model_config = SettingsConfigDict(env_prefix="MOONCAKE_RL_", frozen=True, extra="forbid")

    master: str = Field(
        "127.0.0.1:50051",
        description="host:port of mooncake_master, or etcd://h:p;h:p of a durable Store's etcd",
    )
    cluster_id: str = Field(
        "mooncake_cluster",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="the durable Store's cluster id (the masters' --cluster_id); the native "
        "client reads it as MC_STORE_CLUSTER_ID",
    )
    failover_s: float = Field(
        30.0,
        ge=0,
        description="how long a Store call keeps retrying while the master's leader changes",
    )
    etcd_quota_bytes: int = Field(
        2 << 30,
        gt=0,
        description="the durable Store's etcd --quota-backend-bytes (etcd does not report it): "
        "what status and the out-of-space error measure against",
    )
    metadata: str = Field(
        "P2PHANDSHAKE",
        description="metadata URL (http://host:port/metadata, etcd://...) or P2PHANDSHAKE",
    )
    protocol: Literal["tcp", "rdma"] = "tcp"
    hostname: str = Field("127.0.0.1", description="address other clients reach this one at")
    node: str = Field("node0", description="node label used for NIC accounting")
    auth_token: SecretStr | None = Field(None, description="bearer token for /mooncake/* routes")
    router_api_key: SecretStr | None = Field(
        None, description="bearer key of the request router's worker API (--router-api-key)"
    )
    insecure: bool = Field(
        False,
        description="let an engine bound beyond loopback serve /mooncake/* without a token",
    )
    max_body_bytes: int = Field(
        256 * MiB,
        gt=0,
        description=(
            "largest /mooncake/* request body an engine reads; a prepare body carries the "
            "routing slices of every worker of the engine, so it grows with the model"
        ),
    )
    rdma_devices: str = Field("", description="comma-separated RDMA devices (rdma only)")
    segment_bytes: int = Field(
        256 * MiB, ge=0, description="memory this client lends the Store (0: lends none)"
    )
    local_segment: str | None = Field(
        None, description="node-local segment to prefer when this client lends none itself"
    )
    buffer_bytes: int = Field(64 * MiB, gt=0, description="client-local transfer buffer")
    batch_bytes: int = Field(
        64 * MiB,
        gt=0,
        description="bytes per pipeline batch of the plans a coordinator builds "
        "(`mooncake-rl update --batch-bytes` overrides)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "warning",
        description="this project's and Mooncake's native log level; below info, a native "
        "client's setup logs to mooncake-native.log in log_dir (mooncake_rl.native_logs)",
    )
    log_dir: Path | None = Field(None, description="where logs go (default: $TMPDIR or /tmp)")
    plan_dir: Path | None = Field(
        None,
        description="a node-local folder for copies of the routing tables kept in the Store: "
        "the next coordinator on this node maps its table from here instead of reading it "
        "over the network (a 1T MoE's table is ~185 MB); unset: the Store only",
    )
    lease_ttl_s: float = Field(
        60.0, gt=0, description="serving lease lifetime; engines renew at 1/3"
    )
    retire_grace_s: float = Field(
        10.0,
        ge=0,
        description="GC spares a generation this long after it stopped being active",
    )
    auto_rebuild: bool = Field(
        True,
        description="an engine whose commit failed reloads the Store's active generation "
        "by itself (POST /mooncake/rebuild does it on request)",
    )
    staging_watermark_bytes: int = Field(
        256 * MiB,
        gt=0,
        description="an engine worker's staging bytes in flight; a coordinator refuses plans "
        "whose batches it cannot hold twice (reported with the worker's placement)",
    )
    staging_budget_bytes: int | None = Field(
        None,
        gt=0,
        description="the most device memory an engine worker stages one update in; more "
        "stages in (pinned) host memory and lands from there. Default: the device's free "
        "memory. A budget below one batch of the plan is refused at prepare",
    )
    rpc_timeout_s: float = Field(
        600.0,
        gt=0,
        description="how long an engine's API process waits for every worker rank to answer "
        "one update call: a hung rank must not hold the receiver (and its session) forever",
    )

    transport: Literal["store", "broadcast", "cpu_serialize", "auto"] = Field(
        "store",
        description="how updates reach engines: the Store path (default), NCCL/gloo "
        "broadcast, CPU serialization, or auto (broadcast to engines disjoint from the "
        "train pool, CPU serialization to colocated ones)",
    )
    gpu_ids: str = Field(
        "",
        description="this engine's physical GPU ids, one per rank in rank order, "
        "comma-separated: declares the topology where CUDA cannot report UUIDs",
    )
    train_gpus: str = Field(
        "", description="the train pool's physical GPU ids, comma-separated (trainer side)"
    )
    assert_mixed_transport: bool = Field(
        False, description="an auto update must produce both broadcast and CPU legs"
    )
    cpu_handoff: Literal["auto", "shm", "http"] = Field(
        "auto",
        description="how CPU-serialized buckets reach an engine: shared memory when it runs "
        "on this host (auto), or always one of shm / http",
    )
    rendezvous_port: int = Field(
        29600, gt=1024, lt=65536, description="first port a broadcast group's TCP store claims"
    )
    broadcast_timeout_s: float = Field(
        300.0, gt=0, description="how long a broadcast group waits for a member or a bucket"
    )
    claim_lease_s: float = Field(
        60.0, ge=2, description="a rendezvous port claim's lease; its holder renews at 1/3"
    )

    @field_validator("master")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value.startswith(ETCD_SCHEME):
            parse_endpoints(value)
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"master must be host:port or etcd://h:p;h:p, got {value!r}")
        return value

    def client_env(self) -> dict[str, str]:
        """The ``MOONCAKE_RL_*`` variables that give a child process this Store client's
        settings (the secret token stays out: children need no route access)."""
        keys = ("master", "cluster_id", "metadata", "protocol", "hostname", "node", "rdma_devices")
        env = {f"MOONCAKE_RL_{k.upper()}": str(getattr(self, k)) for k in keys}
        if self.local_segment:
            env["MOONCAKE_RL_LOCAL_SEGMENT"] = self.local_segment
        return env

    def with_overrides(self, **overrides: Any) -> Settings:
        """Return a copy with the non-``None`` overrides applied (how CLI flags win)."""
        given = {key: value for key, value in overrides.items() if value is not None}
        return self.model_validate({**self.model_dump(), **given}) if given else self
