"""Client flags --> :class:`~mooncake_rl.settings.Settings` --> the short-lived Store client
a command opens.

Each flag overrides its ``MOONCAKE_RL_*`` variable; a flag left out keeps the variable's.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master", help="host:port of mooncake_master or etcd://h:p;h:p (MOONCAKE_RL_MASTER)"
    )
    parser.add_argument("--cluster-id", help="durable Store's cluster id (MOONCAKE_RL_CLUSTER_ID)")
    parser.add_argument("--metadata", help="metadata URL or P2PHANDSHAKE (MOONCAKE_RL_METADATA)")
    parser.add_argument("--protocol", choices=["tcp", "rdma"], help="(MOONCAKE_RL_PROTOCOL)")
    parser.add_argument("--hostname", help="this client's address (MOONCAKE_RL_HOSTNAME)")
    parser.add_argument("--node", help="node label for NIC accounting (MOONCAKE_RL_NODE)")
    parser.add_argument("--local-segment", help="segment to prefer (MOONCAKE_RL_LOCAL_SEGMENT)")


def settings_from(args: argparse.Namespace) -> Settings:
    keys = ("master", "cluster_id", "metadata", "protocol", "hostname", "node", "local_segment")
    return Settings().with_overrides(**{k: getattr(args, k, None) for k in keys})


@contextlib.contextmanager
def open_store(args: argparse.Namespace) -> Iterator[StoreClient]:
    """A CLI process is short-lived: it lends no memory, so nothing it writes dies with it;
    its client of a durable Store is parked at close and, run as the program, ends with the
    process (:func:`~mooncake_rl.store.exit_process`)."""
    with StoreClient(settings_from(args).with_overrides(segment_bytes=0)) as store:
        yield store
