"""etcd at its quota (issue 50): a real etcd with a small ``--quota-backend-bytes``, one HA
master logging to it, tiny generations published until etcd raises its NOSPACE alarm.

Mooncake's master answers puts with success once etcd refuses its log writes (it only warns
in its own log), so without a check of ours publishes go on announcing generations that a
failover would lose. The publishing runs in a child process: its client lends no memory, is
parked at close and ends with the process (``exit_process``), with no 30 s close.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_rl import etcd
from mooncake_rl.errors import EtcdOutOfSpace, NotLogged, mooncake_error
from mooncake_rl.services import DurableConfig, DurableStore, SegmentHolder
from tests.conftest import TEST_LEASE_TTL_MS, repo_root

QUOTA = 400_000
"""etcd's database starts at ~20 KB and grows ~6.5 KB per tiny generation: ~60 publishes."""

PUBLISH_UNTIL_REFUSED = """
import json, sys, torch
from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.generations.commands import verify_generation
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient, exit_process

def tensors(i):
    return [("embed", torch.full((256,), float(i))), ("norm", torch.ones(8) * i)]

store = StoreClient(Settings(segment_bytes=0, buffer_bytes=16 << 20))
result = {"published": [], "error": None}
for i in range(1, 500):
    try:
        record = publish_local(store, "q", tensors(i), dtype="float32")
        result["published"].append(record.generation)
    except MooncakeRLError as error:
        result["error"] = [type(error).__name__, str(error)]
        break
_, loading = active_weights(store, "q")
result["active"] = GenerationRegistry(store, "q").active().generation
expected = dict(tensors(result["active"]))
result["loads_last"] = all(t.equal(expected[name]) for name, t in loading)
result["verified"] = bool(verify_generation(store, "q")["ok"])
print(json.dumps(result))
store.close()
exit_process(0)
"""


@contextlib.contextmanager
def small_durable_store(log_dir: Path) -> Iterator[tuple[DurableStore, str]]:
    """One HA master logging to an etcd of ``QUOTA`` bytes, and a segment holder."""
    config = DurableConfig(
        masters=1, lease_ttl_ms=TEST_LEASE_TTL_MS, log_dir=log_dir, etcd_quota_bytes=QUOTA
    )
    with DurableStore(config) as durable:
        holder = SegmentHolder(
            durable.master_address,
            durable.metadata_url,
            64 << 20,
            log_dir=log_dir,
            cluster_id=durable.cluster_id,
        )
        with holder.start():
            yield durable, holder.segment


@pytest.fixture(scope="module")
def small_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DurableStore, str]]:
    with small_durable_store(tmp_path_factory.mktemp("quota-logs")) as running:
        yield running


def client_env(durable: DurableStore, segment: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(repo_root()),
        "MOONCAKE_RL_MASTER": durable.master_address,
        "MOONCAKE_RL_CLUSTER_ID": durable.cluster_id,
        "MOONCAKE_RL_METADATA": durable.metadata_url,
        "MOONCAKE_RL_LOCAL_SEGMENT": segment,
        "MOONCAKE_RL_ETCD_QUOTA_BYTES": str(QUOTA),
        "MOONCAKE_RL_LOG_LEVEL": "error",
    }


def test_a_publish_at_the_quota_fails_naming_it_and_the_last_generation_stays_active(
    small_etcd: tuple[DurableStore, str],
) -> None:
    durable, segment = small_etcd
    env = client_env(durable, segment)
    done = subprocess.run(
        [sys.executable, "-c", PUBLISH_UNTIL_REFUSED],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert etcd.out_of_space(durable.endpoints)
    published = result["published"]
    assert len(published) > 5, "etcd filled before the Store was used: raise QUOTA"
    name, message = result["error"]
    assert name == "EtcdOutOfSpace", message
    assert "NOSPACE" in message and f"{QUOTA:,}-byte quota" in message
    assert "--quota-backend-bytes" in message and "--cluster-id" in message
    # Refused before its fence (nothing of it announced), or its own fence tripped the quota:
    # then it is active on the leader and the error says it may be missing from the log.
    tripped = f"generation {published[-1] + 1} of q became active on the leading master"
    assert result["active"] == published[-1] or (
        result["active"] == published[-1] + 1 and message.startswith(tripped)
    ), message
    assert result["loads_last"] and result["verified"]

    status = subprocess.run(
        [sys.executable, "-m", "mooncake_rl.cli", "status", "--name", "q"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert status.returncode == 0, status.stderr[-2000:]
    assert "WARNING: etcd is" in status.stdout and "--quota-backend-bytes" in status.stdout


def test_the_out_of_space_error_names_the_quota_and_the_way_out() -> None:
    used = etcd.Usage(db_bytes=1_900_000_000, quota_bytes=2 << 30, keys=12)
    error = etcd.out_of_space_error("127.0.0.1:2379", used, "publishing a generation of m")
    assert isinstance(error, EtcdOutOfSpace)
    text = str(error)
    assert text.startswith("publishing a generation of m: etcd at 127.0.0.1:2379")
    assert (
        "1,900,000,000 bytes of its 2,147,483,648-byte quota (88.5%)" in text
        and "etcdctl alarm disarm" in text
    )
    assert "docs/etcd-growth.md" in text


@pytest.mark.parametrize(("db_bytes", "warns"), [(0, False), (799, False), (800, True)])
def test_status_warns_from_80_percent_of_the_quota(db_bytes: int, warns: bool) -> None:
    warning = etcd.Usage(db_bytes=db_bytes, quota_bytes=1000, keys=1).warning()
    assert (warning is not None) == warns
    if warning is not None:
        assert warning.startswith("etcd is 80% full") and "--quota-backend-bytes" in warning


def test_a_remove_the_master_could_not_log_names_etcd() -> None:
    error = mooncake_error(-1010, "batch_remove", "1 keys")
    assert isinstance(error, NotLogged)
    assert "UNAVAILABLE_IN_CURRENT_STATUS (-1010)" in str(error) and "etcd" in str(error)


FILL_DURING_THE_ANNOUNCE = """
import json, torch
from mooncake_rl import etcd
from mooncake_rl.errors import ConfigurationError, MooncakeRLError
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient, exit_process

store = StoreClient(Settings(segment_bytes=0, buffer_bytes=16 << 20))
endpoints = store.settings.master.removeprefix(etcd.ETCD_SCHEME)
first = publish_local(store, "race", [("w", torch.ones(64))], dtype="float32")
result = {"first": first.generation}
create = store.create_exclusive

def another_writer_fills_etcd_first(key, data):
    if "/fence/" in key:  # after the announce checked etcd's space, before its fence
        for i in range(1000):
            try:
                etcd.put(endpoints, f"another-writer/{i}", "x" * 50_000, 0)
            except ConfigurationError:  # etcd refused: database space exceeded
                break
    return create(key, data)

store.create_exclusive = another_writer_fills_etcd_first
try:
    publish_local(store, "race", [("w", torch.ones(64) * 2)], dtype="float32")
except MooncakeRLError as error:
    result["error"] = [type(error).__name__, str(error)]
print(json.dumps(result))
store.close()
exit_process(0)
"""


@pytest.mark.faults
def test_etcd_filled_by_another_writer_during_an_announce_is_named(tmp_path: Path) -> None:
    """A writer elsewhere fills etcd between the announce's space check and its fence: the
    master answers the fence with success without logging it, and the publish raises,
    naming the generation a failover would bring back, instead of returning."""
    with small_durable_store(tmp_path) as (durable, segment):
        done = subprocess.run(
            [sys.executable, "-c", FILL_DURING_THE_ANNOUNCE],
            capture_output=True,
            text=True,
            timeout=120,
            env=client_env(durable, segment),
        )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    name, message = result["error"]
    assert (result["first"], name) == (1, "EtcdOutOfSpace"), message
    assert message.startswith(
        "generation 2 of race became active on the leading master (fence 2), but etcd filled up"
    ), message
    assert "a failover would bring back generation 1" in message and "NOSPACE" in message
