"""The only package that imports ``mooncake.store``: a thin, typed Store client.

    settings --> the master (or a durable Store's etcd and leader) answers, a native client
    is set up or unparked (:mod:`.native`) --> buffers registered, calls ride a leader
    change (:mod:`.connection`) --> records and byte ranges read (:mod:`.reads`), objects
    and records written (:mod:`.writes`), keys removed (:mod:`.client`) --> close: parked
    for the next client when it lends no memory to a durable Store (:mod:`.native`)

:class:`StoreClient` (:mod:`.client`) is all of these in one. Negative return codes become
:mod:`mooncake_rl.errors` exceptions naming the operation and key; successful reads and puts
add to :data:`mooncake_rl.counters.COUNTERS`.
"""

from mooncake_rl.store.client import StoreClient, regex_literal
from mooncake_rl.store.native import close_parked, exit_process, loopback_transport_env
from mooncake_rl.store.reads import DESCRIPTOR_BATCH, RangeRead

__all__ = [
    "DESCRIPTOR_BATCH",
    "RangeRead",
    "StoreClient",
    "close_parked",
    "exit_process",
    "loopback_transport_env",
    "regex_literal",
]
