"""What the durable Store keeps in etcd, read through etcd's JSON gateway (``/v3/kv/range``).

Endpoints string (``h:p;h:p``) → :func:`parse_endpoints` → one HTTP POST per question to the
first member that answers → decoded keys and values. Mooncake's HA masters elect a leader by
holding ``mooncake-store/<cluster_id>/master_view`` (its RPC ``host:port``) on an etcd lease,
and write their operation log under ``/oplog/<cluster_id>/``. Used by the services that start
the Store (is etcd up, who leads), by the Store client (does the cluster it was told to use
exist, is etcd out of space), by ``mooncake-rl status`` (how big the log grew), and by the
serving leases of a durable Store (:mod:`mooncake_rl.generations.leases`): the one thing this
project writes to etcd itself, as keys on etcd leases, because a keep-alive adds nothing to
etcd's history while a renewed Store record adds to the never-pruned operation log.
"""

from __future__ import annotations

import base64
import http.client
import json
from dataclasses import dataclass

from mooncake_rl.errors import ConfigurationError, EtcdOutOfSpace

ETCD_SCHEME = "etcd://"
VIEW_PREFIX = "mooncake-store/"
VIEW_SUFFIX = "/master_view"
OPLOG_PREFIX = "/oplog/"


def parse_endpoints(endpoints: str) -> tuple[str, ...]:
    """``h:p;h:p`` (an ``etcd://`` prefix allowed) as ``("h:p", ...)``; refuses anything else."""
    body = endpoints.removeprefix(ETCD_SCHEME)
    parsed = tuple(part.strip() for part in body.split(";") if part.strip())
    for endpoint in parsed:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigurationError(
                f"etcd endpoint {endpoint!r} in {endpoints!r} is not host:port; "
                "give them as host:port;host:port"
            )
    if not parsed:
        raise ConfigurationError(f"no etcd endpoint in {endpoints!r}; give host:port;host:port")
    return parsed


def view_key(cluster_id: str) -> str:
    return f"{VIEW_PREFIX}{cluster_id}{VIEW_SUFFIX}"


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _prefix_end(prefix: str) -> str:
    """The exclusive end of the key range starting with ``prefix`` (etcd's convention)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return _b64(bytes(raw))


def _post(endpoint: str, path: str, body: dict[str, object], timeout_s: float) -> dict:
    host, _, port = endpoint.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise OSError(f"HTTP {response.status}: {payload[:200]!r}")
        return json.loads(payload)
    finally:
        connection.close()


def _ask(endpoints: str, path: str, body: dict[str, object], timeout_s: float) -> dict:
    """The first member's answer; names every endpoint when none answers."""
    failures = []
    for endpoint in parse_endpoints(endpoints):
        try:
            return _post(endpoint, path, body, timeout_s)
        except (OSError, ValueError) as error:
            failures.append(f"{endpoint}: {error}")
    raise ConfigurationError(
        f"no etcd member answers at {endpoints} ({'; '.join(failures)}); start etcd there "
        "or point --etcd / MOONCAKE_RL_MASTER=etcd://... at a running cluster"
    )


def healthy(endpoint: str, timeout_s: float = 1.0) -> bool:
    """Whether one member serves reads (its gateway answers a range request)."""
    try:
        _post(endpoint, "/v3/kv/range", {"key": _b64("health")}, timeout_s)
    except (OSError, ValueError):
        return False
    return True


def get(endpoints: str, key: str, timeout_s: float = 2.0) -> str | None:
    """The value of ``key``, or ``None`` when it is absent."""
    reply = _ask(endpoints, "/v3/kv/range", {"key": _b64(key)}, timeout_s)
    kvs = reply.get("kvs") or []
    return base64.b64decode(kvs[0].get("value", "")).decode() if kvs else None


def leader(endpoints: str, cluster_id: str) -> str | None:
    """The RPC ``host:port`` of the master leading ``cluster_id``; ``None`` mid-election."""
    return get(endpoints, view_key(cluster_id))


def clusters(endpoints: str, timeout_s: float = 2.0) -> tuple[str, ...]:
    """Every cluster id that has a leader in this etcd right now."""
    body = {"key": _b64(VIEW_PREFIX), "range_end": _prefix_end(VIEW_PREFIX), "keys_only": True}
    reply = _ask(endpoints, "/v3/kv/range", body, timeout_s)
    keys = (base64.b64decode(kv["key"]).decode() for kv in reply.get("kvs") or [])
    return tuple(
        key.removeprefix(VIEW_PREFIX).removesuffix(VIEW_SUFFIX)
        for key in keys
        if key.endswith(VIEW_SUFFIX)
    )


def has_log(endpoints: str, cluster_id: str, timeout_s: float = 2.0) -> bool:
    """Whether ``cluster_id`` has an operation log here (its masters ran, maybe mid-election)."""
    prefix = f"{OPLOG_PREFIX}{cluster_id}/"
    body = {"key": _b64(prefix), "range_end": _prefix_end(prefix), "count_only": True}
    return int(_ask(endpoints, "/v3/kv/range", body, timeout_s).get("count", 0)) > 0


@dataclass(frozen=True)
class Usage:
    """How much of etcd the Store uses: the whole database and the keys of one cluster."""

    db_bytes: int
    quota_bytes: int
    keys: int

    def __post_init__(self) -> None:
        if self.db_bytes < 0 or self.quota_bytes <= 0 or self.keys < 0:
            raise ValueError(f"invalid etcd usage {self}")

    @property
    def quota_fraction(self) -> float:
        return self.db_bytes / self.quota_bytes

    def warning(self) -> str | None:
        """What ``mooncake-rl status`` says once etcd nears its quota; ``None`` before."""
        if self.quota_fraction < ATTENTION_FRACTION:
            return None
        return (
            f"etcd is {self.quota_fraction:.0%} full: at its quota it refuses writes and the "
            f"Store's masters stop logging changes (a failover would lose them). {WAY_OUT}"
        )

    def describe(self) -> str:
        return (
            f"{self.db_bytes:,} bytes of its {self.quota_bytes:,}-byte quota "
            f"({self.quota_fraction:.1%}), {self.keys:,} keys"
        )


ATTENTION_FRACTION = 0.8
"""Past this share of its quota, ``mooncake-rl status`` warns: etcd stops taking writes at it."""
WAY_OUT = (
    "restart each etcd member with a larger --quota-backend-bytes (and MOONCAKE_RL_ETCD_QUOTA_"
    "BYTES to match), then clear the alarm (etcdctl alarm disarm); or move to a fresh Store "
    "(a new --cluster-id, or a fresh etcd), republish there, and delete the old /oplog/<id>/ "
    "prefix. Compaction and defragmentation free little: the log's keys stay live. See "
    "docs/etcd-growth.md"
)


def out_of_space_error(endpoints: str, used: Usage, what: str) -> EtcdOutOfSpace:
    """The error a write refused for lack of etcd space raises: the quota and the way out."""
    return EtcdOutOfSpace(
        f"{what}: etcd at {endpoints} is out of space (NOSPACE alarm; {used.describe()}): its "
        "database reached --quota-backend-bytes, so the Store's masters can no longer log "
        f"changes and a master failover would lose them. Way out: {WAY_OUT}"
    )


ETCD_DEFAULT_QUOTA = 2 << 30
"""etcd's default backend quota (``--quota-backend-bytes`` unset); its status does not say."""


def usage(endpoints: str, quota_bytes: int = ETCD_DEFAULT_QUOTA, timeout_s: float = 2.0) -> Usage:
    """The database size (``/v3/maintenance/status``) and the number of keys in etcd."""
    status = _ask(endpoints, "/v3/maintenance/status", {}, timeout_s)
    everything = {"key": _b64(b"\0"), "range_end": _b64(b"\0"), "count_only": True}
    counted = _ask(endpoints, "/v3/kv/range", everything, timeout_s)
    return Usage(int(status.get("dbSize", 0)), quota_bytes, int(counted.get("count", 0)))


def log_size(endpoints: str, cluster_id: str, timeout_s: float = 10.0) -> tuple[int, int]:
    """Keys and bytes (keys plus values) of ``cluster_id``'s operation log: what no
    compaction frees, since every key of it stays live."""
    prefix = f"{OPLOG_PREFIX}{cluster_id}/"
    body = {"key": _b64(prefix), "range_end": _prefix_end(prefix)}
    kvs = _ask(endpoints, "/v3/kv/range", body, timeout_s).get("kvs") or []
    sizes = (
        len(base64.b64decode(kv["key"])) + len(base64.b64decode(kv.get("value", ""))) for kv in kvs
    )
    return len(kvs), sum(sizes)


def out_of_space(endpoints: str, timeout_s: float = 2.0) -> bool:
    """Whether etcd raised its NOSPACE alarm: its database reached ``--quota-backend-bytes``
    and it refuses every write until the alarm is cleared."""
    reply = _ask(endpoints, "/v3/maintenance/alarm", {"action": "GET"}, timeout_s)
    return any(alarm.get("alarm") == "NOSPACE" for alarm in reply.get("alarms") or [])


def grant(endpoints: str, ttl_s: int, timeout_s: float = 2.0) -> int:
    """A fresh etcd lease of ``ttl_s`` seconds (etcd may raise it to its minimum); its id."""
    return int(_ask(endpoints, "/v3/lease/grant", {"TTL": ttl_s}, timeout_s)["ID"])


def keep_alive(endpoints: str, lease: int, timeout_s: float = 2.0) -> bool:
    """Restart ``lease``'s TTL; False when etcd no longer has it (it expired or was revoked,
    and its keys are gone). Adds no revision: nothing in etcd's history grows."""
    reply = _ask(endpoints, "/v3/lease/keepalive", {"ID": str(lease)}, timeout_s)
    return int(reply.get("result", {}).get("TTL", 0)) > 0


def put(endpoints: str, key: str, value: str, lease: int, timeout_s: float = 2.0) -> None:
    """Write ``key`` attached to ``lease``: etcd deletes it when the lease ends."""
    body = {"key": _b64(key), "value": _b64(value), "lease": str(lease)}
    _ask(endpoints, "/v3/kv/put", body, timeout_s)


def delete(endpoints: str, key: str, timeout_s: float = 2.0) -> None:
    _ask(endpoints, "/v3/kv/deleterange", {"key": _b64(key)}, timeout_s)


def prefixed(endpoints: str, prefix: str, timeout_s: float = 2.0) -> dict[str, str]:
    """Every key under ``prefix`` and its value."""
    body = {"key": _b64(prefix), "range_end": _prefix_end(prefix)}
    kvs = _ask(endpoints, "/v3/kv/range", body, timeout_s).get("kvs") or []
    return {
        base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
        for kv in kvs
    }
