"""Losing the master or a segment holder, caused for real (issue 14).

The master is killed with SIGKILL and a fresh one started on the same ports (it keeps no
state); a segment holder is stopped. Each test runs its own master, so the session's master
is never harmed. Store-level cases run in ``make test``; the cases with a real vLLM engine
are in ``tests/faults/test_engine_faults.py`` (``make faults``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from mooncake_rl.coordinator import Coordinator, serves
from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.generations import GenerationRegistry
from mooncake_rl.generations.commands import generation_status, verify_generation
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import Incarnation, NoActiveGeneration
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.services import EmbeddedMaster, MasterConfig, SegmentHolder, free_ports
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from tests.conftest import TEST_LEASE_TTL_MS, trainer_settings
from tests.test_cli_generations import cli, run_cli

SEGMENT = 64 << 20


def fixed_port_master(log_dir: Path) -> EmbeddedMaster:
    """A master whose ports are chosen once, so a restart comes back at the same address."""
    rpc_port, metadata_port, metrics_port = free_ports(3)
    config = MasterConfig(
        lease_ttl_ms=TEST_LEASE_TTL_MS,
        rpc_port=rpc_port,
        metadata_port=metadata_port,
        metrics_port=metrics_port,
        log_dir=log_dir,
    )
    return EmbeddedMaster(config).start()


def kill_and_restart(master: EmbeddedMaster) -> EmbeddedMaster:
    """SIGKILL the master's process group, reap it, start a fresh master on the same ports."""
    assert master.pid is not None
    os.killpg(master.pid, signal.SIGKILL)
    assert master.wait(10) == -signal.SIGKILL
    master.stop()
    return EmbeddedMaster(master.config).start()


def wait_until_writable(store: StoreClient, timeout_s: float = 30.0) -> None:
    """Segment holders remount on the fresh master within a client ping or two."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.put_bytes("fault-probe", b"x")
            store.remove(["fault-probe"], force=True)
            return
        except MooncakeRLError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def tensors(scale: float) -> list[tuple[str, torch.Tensor]]:
    return [
        ("embed", torch.arange(4096, dtype=torch.float32) * scale),
        ("norm", torch.ones(64) * scale),
    ]


def as_bytes(named: list[tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    return {name: t.numpy().tobytes() for name, t in named}


def assert_lost_state_error(message: str) -> None:
    assert "restarted" in message and "republish" in message, message


class Services:
    """Own master (fixed ports) and named segment holders; everything stopped at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.master = fixed_port_master(log_dir)
        self.holders: dict[str, SegmentHolder] = {}

    def holder(self, node: str) -> SegmentHolder:
        if node not in self.holders:
            self.holders[node] = SegmentHolder(
                self.master.master_address, self.master.metadata_url, SEGMENT, log_dir=self.log_dir
            ).start()
        return self.holders[node]

    def client(self, node: str) -> Settings:
        return trainer_settings(self.master, self.holder(node), node)

    def close(self) -> None:
        for holder in self.holders.values():
            holder.stop()
        self.master.stop()


def test_master_restart_store_level(services: Services) -> None:
    """After kill -9 and a restart: readers fail with the documented lost-state error, a
    publish gets a new incarnation, and an engine of the old one is not counted as served."""
    model = "lost-master"
    with StoreClient(services.client("node-a")) as store:
        publish_local(store, model, tensors(1.0), dtype="float32")
        before = publish_local(store, model, tensors(2.0), dtype="float32")
        assert before.generation == 2
        services.master = kill_and_restart(services.master)
        wait_until_writable(store)

        assert GenerationRegistry(store, model).active() is None
        with (
            Coordinator(store, ["http://127.0.0.1:9"]) as coordinator,
            pytest.raises(NoActiveGeneration) as update,
        ):
            coordinator.update(model)
        assert_lost_state_error(str(update.value))
        with pytest.raises(NoActiveGeneration) as loader:
            active_weights(store, model)
        assert_lost_state_error(str(loader.value))
        status = generation_status(store, model)
        assert (status["active"], status["generations"]) == (None, [])
        assert_lost_state_error(str(status.get("problem")))
        assert verify_generation(store, model)["ok"] is False

        segment = services.holder("node-a").segment
        cli_update = run_cli(
            services.master, segment, "update", "--name", model, "--engine", "http://127.0.0.1:9"
        )
        assert cli_update.returncode == 2
        assert_lost_state_error(cli_update.stderr)
        cli_verify = run_cli(services.master, segment, "verify", "--name", model)
        assert cli_verify.returncode != 0, cli_verify.stdout

        after = publish_local(store, model, tensors(3.0), dtype="float32")
        incarnation = Incarnation.read(store)
        assert incarnation is not None and after.incarnation == incarnation.id
        assert after.incarnation != before.incarnation and after.generation == 1
        # An engine still serving generation 1 of the lost incarnation is updated, not skipped.
        old = {"model": model, "generation": 1, "incarnation": before.incarnation, "fence": 1}
        assert not serves(old, after)
        assert serves({**old, "incarnation": after.incarnation}, after)
        record, loaded = active_weights(store, model)
        assert record == after
        assert {n: t.numpy().tobytes() for n, t in loaded} == as_bytes(tensors(3.0))
        assert verify_generation(store, model)["ok"]


def test_lost_holder_store_level(services: Services) -> None:
    """Generation 2 sits only in holder B, which stops: status marks it unreadable, the loader
    fails naming its objects, it cannot be re-activated, and `activate --generation 1` serves."""
    model = "lost-holder"
    with StoreClient(services.client("node-a")) as store:
        first = publish_local(store, model, tensors(1.0), dtype="float32")
    b = services.holder("node-b")
    with StoreClient(services.client("node-b")) as store:
        second = publish_local(store, model, tensors(2.0), dtype="float32")
        manifest = GenerationRegistry(store, model).load_manifest(2)
        gen2_keys = sorted({f.object_key for f in manifest.fragments})  # packs hold several
        assert {s for k in gen2_keys for s in store.replica_segments(k)} == {b.segment}
    assert (first.generation, second.generation) == (1, 2)
    b.stop()

    a_segment = services.holder("node-a").segment
    with StoreClient(services.client("node-a")) as store:
        deadline = time.monotonic() + 30
        while any(store.exists(gen2_keys)):  # the master drops the stopped holder's segment
            assert time.monotonic() < deadline, "objects of a stopped holder still listed"
            time.sleep(0.2)
        status = generation_status(store, model)
        rows = {row["generation"]: row for row in status["generations"]}
        assert status["active"] == 2 and sorted(rows) == [1, 2]
        assert rows[1]["readable"] is True and rows[1]["unreadable_objects"] == []
        assert rows[2]["readable"] is False
        assert sorted(rows[2]["unreadable_objects"]) == [f"missing {k}" for k in gen2_keys]

        _, loading = active_weights(store, model)
        with pytest.raises(MooncakeRLError) as load:
            list(loading)
        assert any(k in str(load.value) for k in gen2_keys), load.value
        assert verify_generation(store, model)["ok"] is False

    activated = cli(services.master, a_segment, "activate", "--name", model, "--generation", "1")
    assert activated.returncode == 0, activated.stderr
    assert json.loads(activated.stdout) == {"model": model, "active": 1, "fence": 3}
    refused = cli(services.master, a_segment, "activate", "--name", model, "--generation", "2")
    assert refused.returncode == 2 and "cannot activate generation 2" in refused.stderr
    for generation, message in (("99", "was never announced"), ("1", "is already active")):
        bad = cli(
            services.master, a_segment, "activate", "--name", model, "--generation", generation
        )
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr

    with StoreClient(services.client("node-a")) as store:
        record, loaded = active_weights(store, model)
        assert (record.generation, record.fence, record.newest) == (1, 3, 2)
        assert {n: t.numpy().tobytes() for n, t in loaded} == as_bytes(tensors(1.0))
        # The next publish still moves past every number ever announced.
        assert publish_local(store, model, tensors(4.0), dtype="float32").generation == 3
