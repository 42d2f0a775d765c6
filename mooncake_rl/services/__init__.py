"""The Store's processes on free loopback ports: etcd, ``mooncake_master``s, segment holders.

    durable Store (``mooncake-rl master``'s default):
        etcd (:mod:`.etcd_cluster`, unless given one) --> N HA masters logging every change
        to it (:mod:`.master`) --> one leads, named in etcd (:mod:`.durable`) --> clients dial
        ``etcd://...`` and follow the leader
    plain master: one in-memory :class:`EmbeddedMaster` with HTTP metadata (the fixtures')
    segment holders (:mod:`.holder`) lend node memory to either

Every child runs under :mod:`.processes`: its own process group, SIGTERM when its parent
dies, stopped always.
"""

from mooncake_rl.services.durable import (
    ETCD_CONNECT_S,
    DurableConfig,
    DurableStore,
    require_etcd,
)
from mooncake_rl.services.etcd_cluster import EmbeddedEtcd, EtcdMember, etcd_members
from mooncake_rl.services.holder import SegmentHolder
from mooncake_rl.services.master import (
    DEFAULT_CLUSTER_ID,
    P2P_HANDSHAKE,
    EmbeddedMaster,
    MasterConfig,
)
from mooncake_rl.services.processes import (
    ManagedProcess,
    Service,
    Stopped,
    StopSignals,
    check_system_libraries,
    free_port,
    free_ports,
    master_binary,
    missing_system_libraries,
    serve_until_stopped,
    wait_for,
)

__all__ = [
    "DEFAULT_CLUSTER_ID",
    "ETCD_CONNECT_S",
    "P2P_HANDSHAKE",
    "DurableConfig",
    "DurableStore",
    "EmbeddedEtcd",
    "EmbeddedMaster",
    "EtcdMember",
    "ManagedProcess",
    "MasterConfig",
    "SegmentHolder",
    "Service",
    "StopSignals",
    "Stopped",
    "check_system_libraries",
    "etcd_members",
    "free_port",
    "free_ports",
    "master_binary",
    "missing_system_libraries",
    "require_etcd",
    "serve_until_stopped",
    "wait_for",
]
