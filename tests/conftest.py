"""Fixtures that start real Mooncake services and always tear them down."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import psutil
import pytest
from mooncake.reshard.weight import StoredFragment

from mooncake_rl.generations.catalog import ROLLOUT_DTYPES
from mooncake_rl.generations.keys import payload_key
from mooncake_rl.generations.packing import pack_name
from mooncake_rl.services import DurableStore, EmbeddedMaster, MasterConfig, SegmentHolder
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

TEST_LEASE_TTL_MS = 500
READ_LEASE_S = 5.5
"""Past Mooncake's read lease on freshly written or read objects (non-forced removal
refuses an object under one: OBJECT_HAS_LEASE)."""
os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs at INFO by default


@pytest.fixture(scope="session")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    log_dir = tmp_path_factory.mktemp("master-logs")
    with EmbeddedMaster(MasterConfig(lease_ttl_ms=TEST_LEASE_TTL_MS, log_dir=log_dir)) as running:
        yield running


def settings_for(
    master: EmbeddedMaster | DurableStore, node: str = "node0", **overrides: object
) -> Settings:
    """Client settings pointing at the embedded master or durable Store; small segments to
    keep tests light."""
    values: dict[str, object] = {
        "master": master.master_address,
        "cluster_id": master.cluster_id,
        "metadata": master.metadata_url,
        "node": node,
        "segment_bytes": 64 << 20,
        "buffer_bytes": 16 << 20,
        "batch_bytes": 1 << 20,
        "staging_watermark_bytes": 4 << 20,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def holders(
    master: EmbeddedMaster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], SegmentHolder]]:
    """Node-local segment holders (one ``mooncake_client`` per node label), started on demand."""
    log_dir = tmp_path_factory.mktemp("holder-logs")
    started: dict[str, SegmentHolder] = {}

    def holder(node: str) -> SegmentHolder:
        if node not in started:
            started[node] = SegmentHolder(
                master.master_address, master.metadata_url, 96 << 20, log_dir=log_dir
            ).start()
        return started[node]

    try:
        yield holder
    finally:
        for running in started.values():
            running.stop()


def trainer_settings(
    master: EmbeddedMaster | DurableStore, holder: SegmentHolder, node: str
) -> Settings:
    """A trainer rank that lends no memory and prefers its node's segment holder."""
    return settings_for(master, node, segment_bytes=0, local_segment=holder.segment)


@pytest.fixture
def settings(master: EmbeddedMaster) -> Settings:
    return settings_for(master)


_LEFT_BEHIND: list[str] = []
"""Under pytest-xdist, in the controller: the processes its workers found left behind."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any process we started outlived the tests. Under pytest-xdist each
    worker checks its own children (the controller's are the workers, which may still be
    exiting) and reports what it killed, and the controller fails the run on it."""
    config = session.config
    if hasattr(config, "workerinput") or config.getoption("dist", "no") == "no":
        leftovers = [p for p in psutil.Process().children(recursive=True) if p.is_running()]
        leftovers = [p for p in leftovers if p.status() != psutil.STATUS_ZOMBIE]
        named = [p for p in leftovers if "resource_tracker" not in " ".join(p.cmdline())]
        for process in named:
            _LEFT_BEHIND.append(f"pid {process.pid}: {' '.join(process.cmdline())[:120]}")
            process.kill()
        if hasattr(config, "workerinput"):
            config.workeroutput["left_behind"] = _LEFT_BEHIND  # sent once this hook returns
            return
    if _LEFT_BEHIND:
        print("\nleft-behind processes:\n" + "\n".join(f"  {line}" for line in _LEFT_BEHIND))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist, in the controller: a worker finished; keep what it found left behind."""
    _LEFT_BEHIND.extend(getattr(node, "workeroutput", {}).get("left_behind", ()))


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def fragment_bytes(store: StoreClient, fragment: StoredFragment) -> bytes:
    """A tensor's bytes as stored: its own object, or its slice of a pack."""
    return store.get_bytes(fragment.object_key)[fragment.object_offset :][: fragment.nbytes]


def payload_keys(group: str, names: Iterable[str], ranks: int = 2) -> list[str]:
    """Every key a publish of tensors ``names`` under ``group`` can have written: each
    tensor's own object and the first packs of each rank and dtype (what "nothing left
    behind" checks)."""
    packs = [pack_name(r, d, i) for r in range(ranks) for d in ROLLOUT_DTYPES for i in range(4)]
    return [payload_key(group, name) for name in (*names, *packs)]
