"""A segment holder: a ``mooncake_client`` process that lends its memory to the Store.

SegmentHolder.start --> mooncake_client (TCP, free port) mounts ``segment_bytes`` --> ready
when its log says it serves; its segment name is what trainers prefer for locality
"""

from __future__ import annotations

import re
from pathlib import Path

from mooncake_rl.services.master import DEFAULT_CLUSTER_ID
from mooncake_rl.services.processes import (
    ManagedProcess,
    Service,
    check_system_libraries,
    free_port,
    master_binary,
    service_log_dir,
)

_SEGMENT_PORT = re.compile(rb"Successfully created client on port (\d+)")
_SERVICE_UP = re.compile(rb"Starting real client service on ")


class SegmentHolder(Service):
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
        log = service_log_dir(self.log_dir) / f"mooncake_client.{port}.log"
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
