"""The durable Store (issue 50): etcd, two HA masters with the operation log, real SIGKILLs.

One Store serves the module (its start costs ~6 s: the first leader waits out one etcd
lease before it serves). The engine-level smoke (a real vLLM engine updated across a leader
SIGKILL) is tests/test_quick_start.py. The store-level smoke here kills the leader; the
standby leads afterwards, so the tests after it run on one master. Slower variants are
marked ``faults``. Closing a native client of a durable Store costs ~30 s (the pinned
wheel's leader monitor thread waits out a hard-coded 30 s view-change wait before it
joins): clients that lend no memory are parked at close and reused, the CLI program ends
with its client, and the fixture closes what is parked once, before the Store stops.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mooncake_rl import etcd
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.commands import verify_generation
from mooncake_rl.generations.gc import collect_garbage
from mooncake_rl.generations.leases import EtcdLeaseBook, lease_book
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry, Incarnation
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.services import DurableConfig, DurableStore, EmbeddedMaster, SegmentHolder
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from tests.conftest import TEST_LEASE_TTL_MS, repo_root, trainer_settings

SEGMENT = 64 << 20
FAILOVER_BOUND_S = 20.0
"""Kill to first successful call: ~10 s here (one 5 s etcd lease, then the clients' pings)."""


@pytest.fixture(scope="module")
def durable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DurableStore]:
    log_dir = tmp_path_factory.mktemp("durable-logs")
    config = DurableConfig(masters=2, lease_ttl_ms=TEST_LEASE_TTL_MS, log_dir=log_dir)
    with DurableStore(config) as running:
        yield running


@pytest.fixture(scope="module")
def holder(durable: DurableStore) -> Iterator[SegmentHolder]:
    """The node's segment holder: it outlives the leader and remounts on the standby."""
    config = durable.config
    running = SegmentHolder(
        durable.master_address,
        durable.metadata_url,
        SEGMENT,
        log_dir=config.log_dir,
        cluster_id=durable.cluster_id,
    )
    with running.start():
        yield running


def tensors(scale: float) -> list[tuple[str, torch.Tensor]]:
    return [
        ("embed", torch.arange(4096, dtype=torch.float32) * scale),
        ("norm", torch.ones(64) * scale),
    ]


def kill(master: EmbeddedMaster) -> None:
    assert master.pid is not None
    os.kill(master.pid, signal.SIGKILL)
    assert master.wait(10) == -signal.SIGKILL


def loaded_bytes(store: StoreClient, model: str) -> dict[str, bytes]:
    _, loading = active_weights(store, model)
    return {name: tensor.numpy().tobytes() for name, tensor in loading}


def test_generation_survives_a_leader_sigkill(durable: DurableStore, holder: SegmentHolder) -> None:
    """Leader SIGKILLed after a publish: a call made at once succeeds once the standby leads,
    and the generation, its records and the Store's incarnation are all intact."""
    model = "durable-smoke"
    with StoreClient(trainer_settings(durable, holder, "node0")) as store:
        first = publish_local(store, model, tensors(1.0), dtype="float32")
        incarnation = Incarnation.read(store)
        before = loaded_bytes(store, model)
        leader = durable.leader()
        assert leader is not None and incarnation is not None

        kill(leader)
        killed = time.monotonic()
        assert GenerationRegistry(store, model).active() == first  # rides the failover
        took = time.monotonic() - killed
        assert took < FAILOVER_BOUND_S, f"first call after the kill took {took:.1f}s"
        assert durable.wait_for_leader() is not leader

        assert Incarnation.read(store) == incarnation
        assert loaded_bytes(store, model) == before
        assert verify_generation(store, model)["ok"]
        second = publish_local(store, model, tensors(2.0), dtype="float32")
        assert (second.generation, second.incarnation) == (2, incarnation.id)
        usage = store.etcd_usage()
        assert usage is not None and 0 < usage.db_bytes < usage.quota_bytes and usage.keys > 0


def test_status_reports_how_full_etcd_is_and_the_program_ends_at_once(
    durable: DurableStore, holder: SegmentHolder
) -> None:
    """The real program: its durable client is left to end with the process, which would
    otherwise sit 30 s in the pinned wheel's close (``StoreClient.close``, ``exit_process``)."""
    env = {
        **os.environ,
        "MOONCAKE_RL_MASTER": durable.master_address,
        "MOONCAKE_RL_CLUSTER_ID": durable.cluster_id,
        "MOONCAKE_RL_METADATA": durable.metadata_url,
        "MOONCAKE_RL_LOCAL_SEGMENT": holder.segment,
    }
    command = [sys.executable, "-m", "mooncake_rl.cli", "status", "--name", "durable-smoke"]
    done = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=25, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    usage = json.loads(done.stdout)["etcd"]
    assert usage["quota_bytes"] == 2 << 30 and 0 < usage["db_bytes"] < usage["quota_bytes"]
    assert usage["keys"] > 0 and 0 <= usage["quota_fraction"] < 0.01


def test_leases_live_in_etcd_and_gc_keeps_what_they_name(
    durable: DurableStore, holder: SegmentHolder
) -> None:
    """On a durable Store the serving leases are etcd keys: renewals add nothing to the
    operation log, GC keeps the generation a lease names and collects it once released."""
    model = "durable-leases"
    with StoreClient(trainer_settings(durable, holder, "node0")) as store:
        first = publish_local(store, model, tensors(1.0), dtype="float32", keep=None)
        book = lease_book(store, model)
        assert isinstance(book, EtcdLeaseBook)
        book.renew("engine-0", first.generation, ttl_s=60)
        logged = etcd.log_size(durable.endpoints, durable.cluster_id)
        for _ in range(5):
            book.renew("engine-0", first.generation, ttl_s=60)
        assert etcd.log_size(durable.endpoints, durable.cluster_id) == logged
        for scale in (2.0, 3.0):
            publish_local(store, model, tensors(scale), dtype="float32", keep=None)
        time.sleep(5.5)  # past Mooncake's read lease on the freshly written objects
        report = collect_garbage(store, model, keep=1, grace_s=0)
        assert (report.kept, report.deleted) == ((1, 3), (2,)), report
        book.release("engine-0")
        assert collect_garbage(store, model, keep=1, grace_s=0).deleted == (1,)


def test_a_cluster_id_the_masters_do_not_run_is_named_at_connect(durable: DurableStore) -> None:
    settings = Settings(master=durable.master_address, cluster_id="not-ours", segment_bytes=0)
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match=r"'not-ours'.*'mooncake_cluster'"):
        StoreClient(settings)
    assert time.monotonic() - started < 5


def test_a_second_etcd_in_one_process_is_refused_naming_both(
    durable: DurableStore, holder: SegmentHolder
) -> None:
    """Mooncake's etcd client keeps the first cluster its process met: a client of another
    is refused before setup, not left to fail with -1."""
    with StoreClient(trainer_settings(durable, holder, "n")):
        pass  # this process is bound to the module's etcd from here on, if not before
    other = Settings(master="etcd://127.0.0.1:9", segment_bytes=0)
    with pytest.raises(ConfigurationError, match=r"bound to etcd .*another process") as refused:
        StoreClient(other)
    assert durable.endpoints.split(";")[0] in str(refused.value)


def test_etcd_at_a_dead_endpoint_fails_fast_naming_it(tmp_path: Path) -> None:
    """`mooncake-rl master --etcd` at nothing, and a client pointed at it."""
    from mooncake_rl.services import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mooncake_rl.cli", "master", "--etcd", endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 2 and f"no etcd answers at {endpoint}" in done.stderr, done.stderr
    assert time.monotonic() - started < 15  # the interpreter's start included
    started = time.monotonic()  # a client in a fresh process: this one is bound to an etcd
    done = subprocess.run(
        [sys.executable, "-m", "mooncake_rl.cli", "status", "--name", "m"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MOONCAKE_RL_MASTER": f"etcd://{endpoint}"},
    )
    assert done.returncode == 2 and f"no etcd answers at {endpoint}" in done.stderr, done.stderr
    assert time.monotonic() - started < 15


@pytest.mark.faults
def test_every_master_restarted_replays_the_log(
    durable: DurableStore, holder: SegmentHolder
) -> None:
    """Both masters SIGKILLed, fresh ones started against the same etcd: the new leader
    replays the operation log and the generation is served unchanged."""
    model = "durable-replay"
    with StoreClient(trainer_settings(durable, holder, "node0")) as store:
        record = publish_local(store, model, tensors(3.0), dtype="float32")
        before = loaded_bytes(store, model)
        durable.replace_dead_masters()  # an earlier test's kill
        for master in list(durable.masters):
            kill(master)
        assert len(durable.replace_dead_masters()) == len(durable.masters)
        assert GenerationRegistry(store, model).active() == record
        assert loaded_bytes(store, model) == before
        assert etcd.leader(durable.endpoints, durable.cluster_id) is not None


@pytest.mark.faults
def test_a_publish_cut_by_a_leader_sigkill_completes_or_reruns(
    durable: DurableStore, holder: SegmentHolder
) -> None:
    """The leader dies while a publish of many objects runs: the publish rides through, or
    fails naming the cause and a plain rerun completes; either way exactly one complete,
    verified generation is active, and its claim stands."""
    model = "durable-mid-publish"
    durable.replace_dead_masters()  # a standby for this kill
    many = [(f"layer{i}", torch.full((8192,), float(i))) for i in range(200)]
    outcome: list[object] = []
    with StoreClient(trainer_settings(durable, holder, "node0")) as store:

        def publish() -> None:
            try:
                outcome.append(
                    publish_local(store, model, many, dtype="float32", pack_bytes=1 << 16)
                )
            except Exception as error:  # the outcome under test
                outcome.append(error)

        worker = threading.Thread(target=publish)
        worker.start()
        time.sleep(0.05)
        leader = durable.leader()
        assert leader is not None and worker.is_alive(), "the publish ended before the kill"
        kill(leader)
        worker.join(120)
        assert not worker.is_alive() and len(outcome) == 1
        if isinstance(outcome[0], Exception):
            assert str(outcome[0]), "a failed publish names its cause"
            outcome[0] = publish_local(store, model, many, dtype="float32", pack_bytes=1 << 16)
        record = outcome[0]
        registry = GenerationRegistry(store, model)
        assert registry.active() == record
        assert verify_generation(store, model)["ok"]
        claim = registry.claim(record.generation)  # type: ignore[union-attr]
        assert claim is not None and claim.aborted_at is None


THREE_MEMBER_CLIENT = """
import json, sys, torch
from mooncake_rl.generations.commands import verify_generation
from mooncake_rl.generations.gc import collect_garbage
from mooncake_rl.generations.leases import EtcdLeaseBook, lease_book
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient, exit_process

store = StoreClient(Settings(segment_bytes=0, buffer_bytes=16 << 20))
model, action, scale = "durable-three", sys.argv[1], float(sys.argv[2])
if action == "publish":
    tensors = [("embed", torch.arange(4096, dtype=torch.float32) * scale)]
    print(json.dumps(publish_local(store, model, tensors, dtype="float32").generation))
else:
    active = GenerationRegistry(store, model).active()
    print(json.dumps([active.generation, bool(verify_generation(store, model)["ok"])]))
store.close()
exit_process(0)
"""


@pytest.mark.faults
def test_a_three_member_etcd_loses_one_member_and_the_leader(tmp_path: Path) -> None:
    """The production layout on loopback: three etcd members, two masters. One etcd member
    is SIGKILLed, a generation published, the member and the standby healed as
    ``mooncake-rl master`` heals them, then the leader SIGKILLed: the Store keeps that
    generation and serves. Its clients run in child processes: this one may be bound to the
    module's etcd (Mooncake's etcd client is one per process)."""
    config = DurableConfig(
        masters=2, etcd_members=3, lease_ttl_ms=TEST_LEASE_TTL_MS, log_dir=tmp_path
    )
    with DurableStore(config) as durable:
        assert len(durable.endpoints.split(";")) == 3
        running = SegmentHolder(
            durable.master_address,
            durable.metadata_url,
            SEGMENT,
            log_dir=tmp_path,
            cluster_id=durable.cluster_id,
        )
        with running.start() as holder:
            env = {
                **os.environ,
                "PYTHONPATH": str(repo_root()),
                "MOONCAKE_RL_MASTER": durable.master_address,
                "MOONCAKE_RL_CLUSTER_ID": durable.cluster_id,
                "MOONCAKE_RL_METADATA": durable.metadata_url,
                "MOONCAKE_RL_LOCAL_SEGMENT": holder.segment,
            }

            def client(*argv: str) -> object:
                done = subprocess.run(
                    [sys.executable, "-c", THREE_MEMBER_CLIENT, *argv],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    env=env,
                )
                assert done.returncode == 0, done.stderr[-3000:]
                return json.loads(done.stdout.strip().splitlines()[-1])

            first = client("publish", "1")
            member = durable.etcd[0]
            assert member.pid is not None
            os.kill(member.pid, signal.SIGKILL)
            second = client("publish", "2")
            assert second == first + 1  # type: ignore[operator]
            leader = durable.leader()
            assert leader is not None
            # What `mooncake-rl master` does every poll: the member restarts from its data,
            # and the standby that followed the log through it is replaced by a fresh one.
            standby = next(m for m in durable.masters if m is not leader)
            events = durable.heal()
            assert len(events) == 2, events
            assert events[0].startswith(f"etcd member {member.endpoint} exited"), events
            assert events[1].startswith(f"standby {standby.rpc_address} replaced by"), events
            assert standby not in durable.masters and not standby.is_running()
            assert member.is_running() and durable.leader() is leader
            assert all(etcd.healthy(m.endpoint) for m in durable.etcd)
            kill(leader)
            assert client("check", "0") == [second, True]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--masters", "0"], "--masters must be at least 1, got 0"),
        (["--etcd-members", "2"], "--etcd-members must be odd"),
        (["--etcd-quota-bytes", "0"], "--etcd-quota-bytes must be positive, got 0"),
    ],
)
def test_bad_master_flags_are_refused_before_anything_starts(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from mooncake_rl.cli import main

    before = etcd_children()  # the module's own durable Store may be running
    assert main(["master", *flags]) == 2
    assert says in capsys.readouterr().err
    assert etcd_children() == before


def etcd_children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True) if "etcd" in p.name()}


@pytest.mark.faults
def test_mooncake_rl_master_heals_an_etcd_member_sigkill(tmp_path: Path) -> None:
    """``mooncake-rl master --etcd-members 3`` goes on serving when one of its etcd members
    dies: it restarts the member from its data and replaces the standby master."""
    import psutil

    from mooncake_rl.services import ManagedProcess
    from tests.test_quick_start import exports_of

    log = tmp_path / "master.log"
    argv = [sys.executable, "-m", "mooncake_rl.cli", "master", "--etcd-members", "3"]
    master = ManagedProcess([*argv, "--segment-bytes", "0"], log, {"TMPDIR": str(tmp_path)})
    try:
        master.spawn()
        exported, _ = exports_of(log, master)
        endpoints = exported["MOONCAKE_RL_MASTER"].removeprefix("etcd://").split(";")
        assert master.pid is not None
        members = [p for p in psutil.Process(master.pid).children() if "etcd" in p.name()]
        assert len(members) == 3
        members[0].kill()
        master.wait_until(lambda: "replaced by" in log.read_text(), "the standby's replacement", 60)
        text = log.read_text()
        assert "restarted from its data" in text and master.is_running(), text[-3000:]
        assert all(etcd.healthy(endpoint) for endpoint in endpoints)
    finally:
        master.stop(timeout_s=30)


def test_heal_names_a_given_etcd_member_that_stops_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mooncake-rl master --etcd ENDPOINTS``: a member that is not ours is not restarted,
    but ``heal`` (the master's poll) names it when it stops answering, keeps the standbys
    while no quorum answers, and says when it answers again; the masters keep running."""
    import mooncake_rl.services.durable as durable_module
    from mooncake_rl.services import EmbeddedEtcd, etcd_members

    monkeypatch.setattr(durable_module, "GIVEN_LOOK_S", 0.0)  # every poll looks
    member = etcd_members(1)[0]
    with EmbeddedEtcd(member, (member,), tmp_path) as given:
        config = DurableConfig(
            etcd=given.endpoint, masters=1, lease_ttl_ms=TEST_LEASE_TTL_MS, log_dir=tmp_path
        )
        with DurableStore(config) as store:
            assert store.heal() == []
            assert given.pid is not None
            os.kill(given.pid, signal.SIGKILL)
            assert given.wait(10) == -signal.SIGKILL
            events = store.heal()
            assert events[0].startswith(
                f"etcd member {given.endpoint} (given with --etcd) stopped answering"
            ), events
            assert events[1].startswith("standbys kept: no etcd member answers"), events
            assert len(events) == 2 and store.masters[0].is_running()
            assert store.heal() == []  # named once
            given.restart()
            assert store.heal() == [
                f"etcd member {given.endpoint} (given with --etcd) answers again"
            ]
            assert store.wait_for_leader() is store.masters[0]
