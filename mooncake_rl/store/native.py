"""Settings --> checks that the Store answers --> a set-up native client; closed --> parked.

Before a native ``MooncakeDistributedStore`` is set up, the master (or a durable Store's etcd
and leader) must answer: Mooncake's own setup retries for minutes, or, for a cluster id
nobody leads, forever. A durable Store's client that lends no memory is parked at close for
the next client of the same settings, since the pinned wheel's close of one waits 30 s.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mooncake_rl import etcd
from mooncake_rl.affinity import unpinned_native_threads
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.native_logs import native_setup
from mooncake_rl.services import require_etcd
from mooncake_rl.settings import Settings

CLUSTER_ENV = "MC_STORE_CLUSTER_ID"


def loopback_transport_env(settings: Settings) -> None:
    """TCP on one machine needs Mooncake's loopback switches before a client starts."""
    if settings.protocol == "tcp":
        os.environ.setdefault("MC_FORCE_TCP", "1")
        if settings.hostname.startswith("127."):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", settings.hostname)


def require_master(settings: Settings, durable: bool) -> None:
    """The master, or a durable Store's etcd and leader, answers these settings."""
    if durable:
        _require_bound_etcd(settings.master)
        _require_cluster(settings)
        _set_cluster_env(settings.cluster_id)
    else:
        _require_reachable(settings.master)


def set_up(settings: Settings, durable: bool) -> Any:
    """A new native client set up with ``settings`` (after :func:`require_master`); a
    durable Store's first one binds this process to its etcd cluster."""
    from mooncake.store import MooncakeDistributedStore

    native = MooncakeDistributedStore()
    with unpinned_native_threads(), native_setup(settings):
        code = native.setup(
            settings.hostname,
            settings.metadata,
            settings.segment_bytes,
            settings.buffer_bytes,
            settings.protocol,
            settings.rdma_devices,
            settings.master,
        )
    if code != 0:
        raise ConfigurationError(
            f"Store setup failed ({code}): is mooncake_master reachable at "
            f"{settings.master} and metadata at {settings.metadata}?"
        )
    if durable and not _BOUND_ETCD:
        _BOUND_ETCD.append(_require_bound_etcd(settings.master))
    return native


def _require_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail fast with a clear message; Mooncake's own setup retries for minutes."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ConfigurationError(
            f"mooncake_master is not reachable at {address} ({error}); start one with "
            "`mooncake-rl master` or set MOONCAKE_RL_MASTER"
        ) from error


def _require_cluster(settings: Settings) -> None:
    """A durable Store's etcd answers and leads ``cluster_id`` (waiting out an election).

    Mooncake's client waits for a leader of its cluster id forever; a client whose id differs
    from the masters' would hang, so an id nobody leads or logged under is refused at once,
    naming the ids that etcd does lead.
    """
    endpoints = settings.master.removeprefix(etcd.ETCD_SCHEME)
    require_etcd(endpoints)
    wanted = settings.cluster_id
    deadline = time.monotonic() + settings.failover_s
    while etcd.leader(endpoints, wanted) is None:
        if not etcd.has_log(endpoints, wanted):
            others = ", ".join(repr(c) for c in etcd.clusters(endpoints)) or "none"
            raise ConfigurationError(
                f"no Store master runs cluster id {wanted!r} in etcd {endpoints} (clusters "
                f"there: {others}); set MOONCAKE_RL_CLUSTER_ID to the masters' --cluster_id"
            )
        if time.monotonic() >= deadline:
            raise ConfigurationError(
                f"no master of cluster {wanted!r} has led for {settings.failover_s:.0f}s "
                f"(etcd {endpoints}): start `mooncake-rl master --etcd {endpoints}`"
            )
        time.sleep(0.2)


def _set_cluster_env(cluster_id: str) -> None:
    """The native client reads its cluster id from the environment, once per process."""
    given = os.environ.setdefault(CLUSTER_ENV, cluster_id)
    if given != cluster_id:
        raise ConfigurationError(
            f"{CLUSTER_ENV}={given} disagrees with the cluster id {cluster_id!r} of these "
            f"settings; set MOONCAKE_RL_CLUSTER_ID={given} or unset {CLUSTER_ENV}"
        )


_BOUND_ETCD: list[frozenset[str]] = []
"""The etcd cluster this process's native clients met first (at most one entry)."""


def _require_bound_etcd(master: str) -> frozenset[str]:
    """The native client's etcd connection is one per process and keeps the first cluster it
    met (tried here: a client of a second etcd fails setup with -1 even after every client
    of the first closed); a client of another cluster is refused naming both, not at -1."""
    endpoints = frozenset(etcd.parse_endpoints(master))
    if _BOUND_ETCD and _BOUND_ETCD[0] != endpoints:
        raise ConfigurationError(
            f"this process's Store clients are bound to etcd {';'.join(sorted(_BOUND_ETCD[0]))} "
            f"(Mooncake's etcd client is one per process and keeps the first cluster it "
            f"met); connect to {master} from another process"
        )
    return endpoints


_PARKED: dict[tuple[object, ...], list[Any]] = defaultdict(list)
"""Idle native clients that lend no memory, by their setup arguments; referenced here so no
destructor joins their threads before the process ends."""
_PARKED_LOCK = threading.Lock()


def _setup_key(settings: Settings) -> tuple[object, ...]:
    return (
        settings.master,
        settings.cluster_id,
        settings.hostname,
        settings.metadata,
        settings.buffer_bytes,
        settings.protocol,
        settings.rdma_devices,
    )


def park(settings: Settings, native: Any) -> None:
    with _PARKED_LOCK:
        _PARKED[_setup_key(settings)].append(native)


def unpark(settings: Settings) -> Any | None:
    with _PARKED_LOCK:
        idle = _PARKED.get(_setup_key(settings))
        return idle.pop() if idle else None


def close_parked(master: str) -> int:
    """Really close every parked client of ``master`` (in parallel; a durable Store's take
    30 s): for a process that outlives a Store it ran, such as a test session, before it
    stops that Store. Returns how many were closed."""
    with _PARKED_LOCK:
        keys = [key for key in _PARKED if key[0] == master]
        natives = [native for key in keys for native in _PARKED.pop(key)]
    with ThreadPoolExecutor(max_workers=max(1, len(natives))) as pool:
        list(pool.map(lambda native: native.close(), natives))
    return len(natives)


def exit_process(code: int) -> int:
    """``code``, or, if a client is parked, end the process with it at once: the
    interpreter's teardown would run the parked clients' destructors, 30 s each."""
    if any(_PARKED.values()):
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code
