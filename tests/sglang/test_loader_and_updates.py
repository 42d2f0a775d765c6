"""``--load-format mooncake``, both Store-path update modes and the transports beside the
Store (broadcast, CPU serialization, auto) through SGLang's model-loader stack.

A real ``mooncake_master`` and segment holder; generations published with
``publish_local``; models built and loaded by SGLang's ``get_model_loader`` /
``load_model`` from SGLang parallel layers. Two processes simulate TP=2 ranks (node labels
``node-a``/``node-b``) and are driven by the real coordinator over the shared
``/mooncake/*`` routes; a third is a TP=1 engine that the transports' two-engine topologies
need. Only the transport to the ranks (SGLang's scheduler IPC) and the API-side
drain/resume/cache calls are the test's. Every comparison is byte-exact against SGLang
loading the same checkpoint from disk at the same TP rank.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import httpx
import torch
import uvicorn
from fastapi import FastAPI
from safetensors.torch import load_file

from engine_ext.backend import WorkerBackend
from engine_ext.loading import served_by
from engine_ext.receiver import DrainRequest, Receiver, ServedRecord, weight_version
from engine_ext.routes import build_router
from engine_ext.sglang.backend import pause_modes
from mooncake_rl.apply.wire import WorkerSlice, encode_slice
from mooncake_rl.coordinator import ADVERTISED, Coordinator, UpdateFailed
from mooncake_rl.generations.chain import DeltaPolicy
from mooncake_rl.generations.commands import checkpoint_tensors
from mooncake_rl.generations.keys import advert_key, group_id
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.plan.delta import DELTA_REGION
from mooncake_rl.plan.update import RoutingCache, plan_update
from mooncake_rl.protocol import (
    PLACEMENT_DIGEST,
    ApplyRequest,
    PrepareRequest,
    placement_digest,
    without_boxes,
)
from mooncake_rl.services import EmbeddedMaster, free_port
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import perturbed_copy
from mooncake_rl.transport.layout import receive_layout
from mooncake_rl.transport.topology import MixedTransportInvalid, TopologyError
from tests.conftest import settings_for
from tests.procs import CTX
from tests.sglang.harness import (
    load_model,
    mismatched_parameters,
    publish_topology,
    serve_tp_rank,
    settings_env,
    sglang_model_dir,
)

MODEL = "tiny-sglang"
ENGINE = "sglang-under-test"
SINGLE = "sglang-tp1"


class QueueBackend(WorkerBackend):
    """The shared backend over queues to the simulated TP ranks (stands in for SGLang's
    scheduler IPC; the API-side drain/resume/cache calls are recorded)."""

    def __init__(self, engine_id: str, ranks: list[tuple[Any, Any]]) -> None:
        self.engine_id = engine_id
        self.ranks = ranks
        self.events: list[str] = []
        self.rpc_timeout_s = 300.0

    async def call_workers(self, method: str, *args: Any) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._call_all, method, args)

    def _call_all(self, method: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        for inbox, _ in self.ranks:
            inbox.put(("call", self.engine_id, method, list(args)))
        return [_answer(outbox) for _, outbox in self.ranks]

    async def paused(self) -> bool:
        return False

    async def pause(self, request: DrainRequest) -> None:
        self.events.append(f"drain:{request.mode}")

    async def unpause(self) -> None:
        self.events.append("resume")

    async def reset_cache(self) -> None:
        self.events.append("reset_cache")

    async def set_weight_version(self, version: str) -> None:
        self.events.append(f"weight_version:{version}")


def _answer(outbox: Any) -> Any:
    status, value = outbox.get(timeout=300)
    if status != "ok":
        raise RuntimeError(value)
    return value


class Engine:
    """One simulated SGLang engine: a rank process per node label (its TP rank), each
    declaring its GPU id, behind the shared ``/mooncake`` routes on a loopback port. Every
    request the routes receive is logged (method and path)."""

    def __init__(
        self,
        engine_id: str,
        master: EmbeddedMaster,
        nodes: tuple[str, ...],
        gpus: tuple[str, ...],
    ) -> None:
        self.engine_id = engine_id
        self.master = master
        self.nodes = nodes
        self.gpus = gpus
        self.ranks: list[tuple[Any, Any]] = []
        self.processes: list[Any] = []
        self.requests: list[str] = []
        self.server: uvicorn.Server | None = None

    def spawn(self, model_dir: Path) -> None:
        """Start the rank processes; each loads the Store's active generation."""
        for rank, node in enumerate(self.nodes):
            inbox, outbox = CTX.Queue(), CTX.Queue()
            env = settings_env(settings_for(self.master, node, segment_bytes=0))
            env["MOONCAKE_RL_GPU_IDS"] = ",".join(self.gpus)
            process = CTX.Process(
                target=serve_tp_rank,
                args=(env, len(self.nodes), rank, model_dir, MODEL, inbox, outbox),
            )
            process.start()
            self.ranks.append((inbox, outbox))
            self.processes.append(process)

    def serve(self) -> None:
        """Once every rank is ready: the receiver and its routes."""
        for _, outbox in self.ranks:
            assert _answer(outbox) == "ready"
        self.backend = QueueBackend(self.engine_id, self.ranks)
        served, loaded = asyncio.run(self.backend.served())
        self.receiver = Receiver(self.backend, loaded or MODEL, served)

        async def get_receiver(request: Any) -> Receiver:
            return self.receiver

        app = FastAPI()

        @app.middleware("http")
        async def log(request: Any, call_next: Any) -> Any:
            self.requests.append(f"{request.method} {request.url.path}")
            return await call_next(request)

        app.include_router(
            build_router(get_receiver, None, max_body_bytes=Settings().max_body_bytes)
        )
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        threading.Thread(target=self.server.run, daemon=True).start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "route server did not start"
            time.sleep(0.05)

    def compare(self, model_dir: Path) -> list[list[str]]:
        """Per rank: parameters that differ from SGLang loading ``model_dir`` from disk."""
        for inbox, _ in self.ranks:
            inbox.put(("compare", model_dir))
        return [_answer(outbox) for _, outbox in self.ranks]

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/mooncake/status", timeout=30).json()

    def placement(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/mooncake/placement", timeout=30).json()["workers"]

    def call(self, method: str, *args: Any) -> list[dict[str, Any]]:
        """One worker call on every rank, past the receiver; the ranks' replies."""
        return self.backend._call_all(method, args)

    def corrupt(self) -> None:
        for inbox, _ in self.ranks:
            inbox.put(("corrupt",))
        assert [_answer(outbox) for _, outbox in self.ranks] == [None] * len(self.ranks)

    def close(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        for (inbox, _), process in zip(self.ranks, self.processes, strict=True):
            if process.is_alive():
                inbox.put(("stop",))
                process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()


class World:
    """The engine under test (two TP ranks, ``gpu-s0``/``gpu-s1``) and a TP=1 engine
    (``gpu-one0``) for the transports that take two engines; both start from the Store."""

    def __init__(self, root: Path, master: EmbeddedMaster, holder_segment: str) -> None:
        self.root = root
        self.master = master
        self.dirs = [sglang_model_dir(root / "g1")]
        for seed in (1, 2, 3):
            self.dirs.append(perturbed_copy(self.dirs[0], root / f"g{seed + 1}", seed))
        self.store = StoreClient(
            settings_for(master, "coordinator", segment_bytes=0, local_segment=holder_segment)
        )
        self.engine = Engine(ENGINE, master, ("node-a", "node-b"), ("gpu-s0", "gpu-s1"))
        self.single = Engine(SINGLE, master, ("node-c",), ("gpu-one0",))

    def publish(self, index: int, dtype: str = "float32") -> int:
        tensors = checkpoint_tensors(self.dirs[index])
        return publish_local(self.store, MODEL, tensors, dtype=dtype).generation

    def start(self) -> None:
        for engine in (self.engine, self.single):
            engine.spawn(self.dirs[0])
        for engine in (self.engine, self.single):
            engine.serve()

    # The engine under test, as the Store-path tests drive it.
    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def backend(self) -> QueueBackend:
        return self.engine.backend

    def compare(self, index: int) -> list[list[str]]:
        """Per rank: parameters that differ from SGLang loading checkpoint ``index``."""
        return self.engine.compare(self.dirs[index])

    def status(self) -> dict[str, Any]:
        return self.engine.status()

    def call(self, method: str, *args: Any) -> list[dict[str, Any]]:
        return self.engine.call(method, *args)

    def corrupt(self) -> None:
        self.engine.corrupt()

    def close(self) -> None:
        for engine in (self.engine, self.single):
            engine.close()
        self.store.close()


@pytest.fixture(scope="module")
def world(
    master: EmbeddedMaster, holders, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    made = World(tmp_path_factory.mktemp("sglang"), master, holders("sglang-store").segment)
    try:
        assert made.publish(0) == 1
        made.start()
        yield made
    finally:
        made.close()


def test_loader_reads_the_active_generation_through_sglang(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=1 in this process: SGLang picks our loader, and the module equals SGLang's own
    load of the same checkpoint from disk; fused parameters hold q|k|v and gate|up."""
    for key, value in settings_env(settings_for(world.master, "node-loader")).items():
        monkeypatch.setenv(key, value)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    publish_topology(1, 0)
    model = load_model(world.dirs[0], "mooncake", {"name": MODEL})
    served, name = served_by(model)
    assert (served.generation, served.fence, name) == (1, 1, MODEL)
    assert served.incarnation is not None
    assert mismatched_parameters(model, load_model(world.dirs[0], "auto")) == []
    checkpoint = load_file(str(world.dirs[0] / "model.safetensors"))
    attention = "model.layers.1.self_attn"
    fused = torch.cat([checkpoint[f"{attention}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, fused)


def test_tp2_ranks_start_from_the_store(world: World) -> None:
    assert world.compare(0) == [[], []]
    status = world.status()
    assert (status["state"], status["generation"], status["model"]) == ("serving", 1, MODEL)


def landing_events(world: World, mode: str) -> list[str]:
    """The API-side calls of a commit that landed the Store's active record: pause in
    ``mode``, drop caches, tag that record's weight version, resume."""
    record = GenerationRegistry(world.store, MODEL).active()
    assert record is not None
    served = ServedRecord(record.generation, record.fence, record.incarnation)
    return [
        f"drain:{mode}",
        "reset_cache",
        f"weight_version:{weight_version(MODEL, served)}",
        "resume",
    ]


def assert_every_parameter_checked(engine: Engine, result: Any) -> None:
    """The post-landing check compared every parameter of every rank, and all matched."""
    placement = engine.placement()
    checks = [result.verified[f"{engine.url}/tp{w['tp_rank']}"] for w in placement]
    assert [c["checked"] + c.get("in_place", 0) for c in checks] == [
        len(w["regions"]) for w in placement
    ]
    assert all(c["unchecked"] == [] and c["mismatched"] == [] for c in checks)


def test_compat_update_reads_each_byte_once(world: World) -> None:
    assert world.publish(1) == 2
    with Coordinator(world.store, [world.url]) as coordinator:
        result = coordinator.update(MODEL, mode="compat", batch_bytes=64 << 10)
    assert world.compare(1) == [[], []]
    model_bytes = (world.dirs[1] / "model.safetensors").stat().st_size
    assert result.store_read_bytes == result.unique_demand_bytes == result.planned_read_bytes
    assert 0.99 * model_bytes < result.store_read_bytes < model_bytes
    # Each tensor is read once by one rank and pushed to the other over TE.
    assert result.pushed_bytes == result.planned_pushed_bytes == result.store_read_bytes
    assert world.backend.events[-4:] == landing_events(world, "abort")
    assert world.status()["generation"] == 2
    assert_every_parameter_checked(world.engine, result)


def test_direct_update_delivers_only_each_ranks_shards(world: World) -> None:
    assert world.publish(2) == 3
    with Coordinator(world.store, [world.url]) as coordinator:
        result = coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    assert world.compare(2) == [[], []]
    placement = httpx.get(f"{world.url}/mooncake/placement", timeout=30).json()["workers"]
    bare = httpx.get(f"{world.url}/mooncake/placement?boxes=false", timeout=30).json()["workers"]
    assert bare == [without_boxes(w) for w in placement]  # the digest still names the boxes
    assert [(w["tp_rank"], w["tp_size"]) for w in placement] == [(0, 2), (1, 2)]
    for worker in placement:  # each rank reports the digest its routing table is keyed by
        assert worker[PLACEMENT_DIGEST] == placement_digest(worker)
        parameter_bytes = sum(r["bytes"] for r in worker["regions"].values())
        assert result.received_bytes[worker["worker_id"]] == parameter_bytes
    assert result.store_read_bytes == result.unique_demand_bytes
    # SGLang serves checkpoint layout: every byte lands in the live parameters, none staged
    # (world.compare above checked them against the generation's own tensors).
    assert result.in_place_bytes == sum(result.received_bytes.values())
    assert result.staged_bytes == 0
    assert world.status()["generation"] == 3
    assert_every_parameter_checked(world.engine, result)


def prepare_body(
    world: World,
    fence: int | None = None,
    mode: str = "compat",
    placement: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The prepare body a coordinator sends for active record ``fence`` (default: the
    newest), planned for ``placement`` (default: this engine's)."""
    registry = GenerationRegistry(world.store, MODEL)
    record = registry.active() if fence is None else registry.fence_record(fence)
    assert record is not None
    manifest = registry.load_manifest(record.generation, record.manifest_digest)
    checksums = registry.load_checksums(record.generation, record.checksums_digest)
    if placement is None:
        placement = httpx.get(f"{world.url}/mooncake/placement", timeout=30).json()["workers"]
    plan = plan_update(
        manifest, {world.url: placement}, mode, 64 << 10, RoutingCache(), record.layout_digest
    )
    return {
        "session": uuid.uuid4().hex,
        "model": MODEL,
        "generation": record.generation,
        "manifest_digest": record.manifest_digest,
        "fence": record.fence,
        "incarnation": record.incarnation,
        "mode": mode,
        "stages": plan.stages,
        "workers": plan.engine_workers(world.url, checksums.objects),
    }


def wire(model: type[PrepareRequest | ApplyRequest], body: dict[str, Any]) -> dict[str, Any]:
    """The body as the routes validate it and the backend forwards it to the workers."""
    return model.model_validate_json(json.dumps(body)).model_dump(mode="json")


def refusals(replies: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    return [reply.get("refused") for reply in replies]


def collected(world: World, within_s: float = 120) -> list[dict[str, Any]]:
    """Every rank's reply to the apply stage it started, once each has run it."""
    deadline = time.monotonic() + within_s
    while True:
        replies = world.call("collect")
        if not any(r.get("running") for r in replies):
            return replies
        assert time.monotonic() < deadline, "the apply stage still runs"
        time.sleep(0.02)


def first_read_changed(body: dict[str, Any], **change: Any) -> dict[str, Any]:
    """The body with the first read of every worker's slice changed (``key``, a function
    of the old key, and/or ``src_offset``); a renamed key keeps its checksum row."""
    changed = copy.deepcopy(body)
    for routing in changed["workers"].values():
        sliced = routing["slice"]
        reads = next(b["reads"] for stage in sliced["stages"] for b in stage if b["reads"])
        read = list(reads[0])
        if "key" in change:
            names = sliced["names"]
            old, read[0] = read[0], len(names)
            names.append(change["key"](names[old]))
            row = next(row for row in sliced["checksums"] if row[0] == old)
            sliced["checksums"].append((read[0], *row[1:]))
        if "src_offset" in change:
            read[1] = change["src_offset"]
        reads[0] = read
    return changed


def first_read_keys(body: dict[str, Any]) -> list[str]:
    return [
        r["slice"]["names"][
            next(b["reads"][0][0] for stage in r["slice"]["stages"] for b in stage if b["reads"])
        ]
        for r in body["workers"].values()
    ]


def test_prepare_refuses_what_the_store_contradicts(world: World) -> None:
    """Each refusal names its cause and changes nothing: no staging, no advertisement."""
    body = prepare_body(world)
    assert body["generation"] == 3 and body["fence"] == 3
    active, older = group_id(MODEL, 3) + "/", group_id(MODEL, 1) + "/"
    sizes = {
        r["slice"]["names"][key]: nbytes
        for r in body["workers"].values()
        for key, nbytes, *_ in r["slice"]["checksums"]
    }
    cases: list[tuple[dict[str, Any], int, str, str]] = [
        ({**body, "generation": 999_999}, 409, "unknown_generation", "not an active record"),
        ({**body, "fence": 0, "generation": 10**15}, 409, "unknown_generation", "[1, 10^12)"),
        ({**body, "fence": 0, "generation": 999_999}, 409, "unknown_generation", "not an active"),
        ({**body, "fence": 2}, 409, "unknown_generation", "record 2 names generation 2"),
        ({**body, "incarnation": "0" * 16}, 409, "unknown_generation", "not an active record"),
        ({**body, "manifest_digest": "0" * 64}, 409, "unknown_generation", "not an active"),
        ({**body, "fence": 0, "manifest_digest": "0" * 64}, 409, "manifest_mismatch", "digest"),
        (
            first_read_changed(body, key=lambda key: key.replace(active, older)),
            422,
            "foreign_key",
            f"not an object of generation 3 of {MODEL}",
        ),
        (
            first_read_changed(body, key=lambda key: key + "-absent"),
            409,
            "object_missing",
            "-absent is not held whole in the Store",
        ),
        (
            first_read_changed(body, src_offset=max(sizes.values())),
            409,
            "object_missing",
            "the slice reads bytes",
        ),
        ({**body, "stages": 0}, 422, "too_many_stages", "the update declares 0"),
    ]
    for case, status, code, detail in cases:
        replies = world.call("prepare", wire(PrepareRequest, case))
        assert refusals(replies) == [{"status": status, "code": code}] * 2, (code, replies)
        assert all(detail in reply["error"] for reply in replies), (detail, replies)
    malformed = world.call("prepare", {**body, "session": "not-a-session"})
    assert refusals(malformed) == [{"status": 422, "code": "invalid_request"}] * 2
    unplanned = world.call("prepare", wire(PrepareRequest, {**body, "workers": {}}))
    assert refusals(unplanned) == [{"status": 422, "code": "no_slice"}] * 2

    # An object of an announced generation that the Store lost (generation 2, record 2).
    lost = prepare_body(world, fence=2)
    keys = first_read_keys(lost)
    assert world.store.remove(keys, force=True) == {}
    replies = world.call("prepare", wire(PrepareRequest, lost))
    assert refusals(replies) == [{"status": 409, "code": "object_missing"}] * 2
    assert [reply["error"].split()[0] for reply in replies] == keys

    adverts = [advert_key(body["session"], w) for w in body["workers"]]
    assert world.store.exists(adverts) == [False, False]
    status = world.status()
    assert (status["state"], status["generation"]) == ("serving", 3)
    assert world.compare(2) == [[], []]


def test_a_region_stored_in_another_dtype_is_refused_by_name(world: World) -> None:
    """Direct mode lands bytes as they arrive, so each region's stored dtype (sent in the
    slice's regions) must be its parameter's, and one direct mode cannot land at all is
    refused as unsupported; both before anything is staged."""
    body = prepare_body(world, mode="direct")
    refused = []
    for stored, code in (("float16", "dtype_mismatch"), ("int8", "unsupported_dtype")):
        case = copy.deepcopy(body)
        for routing in case["workers"].values():
            sliced, names = routing["slice"], routing["slice"]["names"]
            at = next(i for i, r in enumerate(sliced["regions"]) if len(r) == 3)
            index, size, dtype = sliced["regions"][at]
            assert names[dtype] != stored
            names.append(stored)
            sliced["regions"][at] = (index, size, len(names) - 1)
            refused.append(names[index])
        replies = world.call("prepare", wire(PrepareRequest, case))
        status = 409 if code == "dtype_mismatch" else 422
        assert refusals(replies) == [{"status": status, "code": code}] * 2, replies
        said = {
            "dtype_mismatch": "direct mode needs stored dtype float16 to equal parameter "
            "dtype; {} is",
            "unsupported_dtype": "{} is stored as int8; direct mode lands only",
        }[code]
        for reply, region in zip(replies, refused[-2:], strict=True):
            assert reply["error"].startswith(said.format(region)), reply
    adverts = [advert_key(body["session"], w) for w in body["workers"]]
    assert world.store.exists(adverts) == [False, False]
    assert world.status()["state"] == "serving"


def test_a_slice_planned_for_another_placement_is_refused(world: World) -> None:
    """A coordinator reads one engine per distinct placement and trusts the others' reports
    (and every report on a hit); each slice names the digest it was planned for, and a
    worker whose own placement hashes otherwise refuses it by name before anything is
    staged. Without that name (an older coordinator) the regions' sizes are still checked."""
    placement = httpx.get(f"{world.url}/mooncake/placement", timeout=30).json()["workers"]
    other = copy.deepcopy(placement)
    grown = [next(iter(w["regions"])) for w in other]
    for worker, region in zip(other, grown, strict=True):
        worker["regions"][region]["bytes"] += 64
        worker[PLACEMENT_DIGEST] = placement_digest(worker)
    body = prepare_body(world, mode="direct", placement=other)
    unnamed = copy.deepcopy(body)
    for routing in unnamed["workers"].values():
        del routing["placement_digest"]
    for case, said in (
        (body, [f"planned for placement digest {w[PLACEMENT_DIGEST]}" for w in other]),
        (
            unnamed,
            [
                f"region {r} is {w['regions'][r]['bytes']} bytes, slice says "
                f"{w['regions'][r]['bytes'] + 64}"
                for w, r in zip(placement, grown, strict=True)
            ],
        ),
    ):
        replies = world.call("prepare", wire(PrepareRequest, case))
        assert refusals(replies) == [{"status": 409, "code": "placement_mismatch"}] * 2, replies
        assert all(text in r["error"] for r, text in zip(replies, said, strict=True)), replies
    adverts = [advert_key(body["session"], w) for w in body["workers"]]
    assert world.store.exists(adverts) == [False, False]
    assert world.status()["state"] == "serving"


def test_apply_writes_only_into_peers_advertised_in_the_session(world: World) -> None:
    body = prepare_body(world)
    session, generation = body["session"], body["generation"]
    assert body["stages"] >= 1
    prepared = world.call("prepare", wire(PrepareRequest, body))
    assert [r["ok"] for r in prepared] == [True, True], prepared
    assert [r["ok"] for r in world.call("promote")] == [True, True]
    peers = {r["worker_id"]: {k: r[k] for k in ADVERTISED} for r in prepared}
    adverts = [advert_key(session, worker_id) for worker_id in peers]
    assert [json.loads(world.store.get_bytes(key)) for key in adverts] == list(peers.values())
    # In this plan each rank reads half the tensors and pushes them to the other, at once.
    for routing in body["workers"].values():
        assert any(b["pushes"] for b in routing["slice"]["stages"][0])

    def apply(stage: int, peers: dict[str, Any], session: str = session) -> list[Any]:
        request = {"session": session, "generation": generation, "stage": stage, "peers": peers}
        replies = world.call("apply", wire(ApplyRequest, request))
        return refusals(collected(world) if all(r["ok"] for r in replies) else replies)

    def refused(status: int, code: str) -> list[dict[str, Any]]:
        return [{"status": status, "code": code}] * 2

    elsewhere = {w: {**p, "endpoint": "127.0.0.1:1"} for w, p in peers.items()}
    moved = {
        w: {**p, "regions": {n: {**r, "base": r["base"] + 64} for n, r in p["regions"].items()}}
        for w, p in peers.items()
    }
    assert apply(0, elsewhere) == refused(422, "untrusted_peer")
    assert apply(0, moved) == refused(422, "untrusted_peer")
    assert apply(0, {}) == refused(422, "untrusted_peer")
    assert apply(body["stages"], peers) == refused(422, "stage_out_of_range")
    assert apply(0, peers, session=uuid.uuid4().hex) == refused(409, "generation_mismatch")
    assert refusals(world.call("commit", generation)) == refused(409, "stages_incomplete")
    if body["stages"] > 1:
        assert apply(1, peers) == refused(409, "stage_out_of_order")
    for stage in range(body["stages"]):
        assert apply(stage, peers) == [None, None]
    assert apply(0, peers) == refused(409, "stage_out_of_order")
    assert [r["ok"] for r in world.call("commit", generation)] == [True, True]
    assert world.store.exists(adverts) == [False, False]
    served = [(r["generation"], r["fence"], r["incarnation"]) for r in world.call("status")]
    assert served == [(generation, body["fence"], body["incarnation"])] * 2
    assert world.compare(2) == [[], []]

    # A push past the end of the region its peer advertised is refused before it is sent.
    body = prepare_body(world)
    for routing in body["workers"].values():
        pushes = next(b["pushes"] for b in routing["slice"]["stages"][0] if b["pushes"])
        push, names = list(pushes[0]), routing["slice"]["names"]
        peer = body["workers"][names[push[0]]]["slice"]
        size = {peer["names"][i]: n for i, n in peer["regions"]}[names[push[3]]]
        push[4] = size - push[5] + 1
        pushes[0] = push
    prepared = world.call("prepare", wire(PrepareRequest, body))
    assert [r["ok"] for r in prepared] == [True, True], prepared
    peers = {r["worker_id"]: {k: r[k] for k in ADVERTISED} for r in prepared}
    request = {"session": body["session"], "generation": generation, "stage": 0, "peers": peers}
    replies = world.call("apply", wire(ApplyRequest, request))
    assert refusals(replies) == refused(422, "untrusted_peer")
    assert all("which advertised" in r["error"] for r in replies)
    assert [r["ok"] for r in world.call("abort")] == [True, True]
    assert world.store.exists([advert_key(body["session"], w) for w in peers]) == [False] * 2
    assert world.compare(2) == [[], []]


def test_rebuild_restores_the_active_generation_byte_exactly(world: World) -> None:
    """A rank whose live weights were partly written reloads the Store's active generation
    through the loader's path, and drops the update it had pending."""
    body = prepare_body(world)
    assert [r["ok"] for r in world.call("prepare", wire(PrepareRequest, body))] == [True, True]
    world.corrupt()
    assert all(world.compare(2))
    record = GenerationRegistry(world.store, MODEL).active()
    assert record is not None
    replies = world.call("rebuild", MODEL)
    assert [
        (r["ok"], r["generation"], r["fence"], r["incarnation"], r["model_name"]) for r in replies
    ] == [(True, record.generation, record.fence, record.incarnation, MODEL)] * 2
    assert world.compare(2) == [[], []]
    assert (
        world.store.exists([advert_key(body["session"], w) for w in body["workers"]]) == [False] * 2
    )
    request = {"session": body["session"], "generation": 3, "stage": 0, "peers": {}}
    not_prepared = world.call("apply", wire(ApplyRequest, request))
    assert refusals(not_prepared) == [{"status": 409, "code": "not_prepared"}] * 2


def test_prepare_failure_keeps_the_served_generation(world: World) -> None:
    assert world.publish(3, dtype="bfloat16") == 4
    with (
        Coordinator(world.store, [world.url]) as coordinator,
        pytest.raises(UpdateFailed) as failed,
    ):
        coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    assert "direct mode needs stored dtype bfloat16" in str(failed.value)
    status = world.status()
    assert (status["state"], status["generation"]) == ("serving", 3)
    assert world.compare(2) == [[], []]


# -- transports beside the Store path (mooncake_rl.transport), on the same engines ----------
TRAIN = "gpu-train0"
"""The train pool's GPU: shared with neither engine unless a test adds one of theirs."""


def transport_store(world: World, **overrides: Any) -> StoreClient:
    """A coordinator-side client with transport settings (the CLI reads them from env)."""
    return StoreClient(world.store.settings.with_overrides(broadcast_timeout_s=60.0, **overrides))


def generation_bytes(model_dir: Path) -> int:
    """The bytes of every tensor of the checkpoint (published as stored: float32)."""
    return sum(t.numel() * t.element_size() for _, t in checkpoint_tensors(model_dir))


def bucket_count(world: World, batch_bytes: int) -> int:
    """Buckets of the active generation: one CPU-serialized apply stage each."""
    registry = GenerationRegistry(world.store, MODEL)
    record = registry.active()
    assert record is not None
    manifest = registry.load_manifest(record.generation, record.manifest_digest)
    return len(receive_layout(manifest, batch_bytes).buckets)


def posts(engine: Engine, since: int) -> dict[str, int]:
    """The POSTs an engine's routes received after request ``since``, by path; lease
    renewals are left out (the session renews on its own clock, every third of its TTL)."""
    counted: dict[str, int] = {}
    for line in engine.requests[since:]:
        method, path = line.split(" ", 1)
        if method == "POST" and path != "/mooncake/renew":
            counted[path] = counted.get(path, 0) + 1
    return counted


def test_a_topology_no_transport_can_serve_is_refused_before_any_drain(world: World) -> None:
    """Strict broadcast with a colocated engine, a TP2 + TP1 broadcast set, and an auto
    update that must be mixed but is not: each fails at classification; both engines keep
    serving their generation and no POST reached them."""
    engines = (world.engine, world.single)
    before = [(e.status(), list(e.backend.events), len(e.requests)) for e in engines]
    world.publish(3)
    urls = [e.url for e in engines]
    with Coordinator(world.store, urls) as coordinator, pytest.raises(TopologyError) as colocated:
        coordinator.update(MODEL, transport="broadcast", train_gpus=f"{TRAIN},gpu-s1")
    assert f"{world.url} shares gpu-s1" in str(colocated.value)
    assert "Nothing was drained" in str(colocated.value)
    with Coordinator(world.store, urls) as coordinator, pytest.raises(TopologyError) as uneven:
        coordinator.update(MODEL, transport="broadcast", train_gpus=TRAIN)
    assert f"{world.url} has 2" in str(uneven.value)
    assert f"{world.single.url} has 1" in str(uneven.value)
    with (
        transport_store(world, assert_mixed_transport=True) as store,
        Coordinator(store, [world.single.url]) as coordinator,
        pytest.raises(MixedTransportInvalid, match="lacks a cpu_serialize leg"),
    ):
        coordinator.update(MODEL, transport="auto", train_gpus=TRAIN)
    for engine, (status, events, requests) in zip(engines, before, strict=True):
        now = engine.status()
        assert (now["state"], now["generation"]) == ("serving", status["generation"])
        assert now["last_session"] == status["last_session"]
        assert engine.backend.events == events
        assert posts(engine, requests) == {}
    assert world.engine.compare(world.dirs[2]) == [[], []]
    assert world.single.compare(world.dirs[0]) == [[]]


def test_broadcast_update_lands_what_sglang_loads_from_disk(world: World) -> None:
    """Over gloo, both TP ranks join one group at ranks 1 and 2 and receive the whole
    generation in one apply; commit lands it through SGLang's ``load_weights``."""
    generation = world.publish(3)
    since = len(world.engine.requests)
    with (
        transport_store(world) as store,
        Coordinator(store, [world.url]) as coordinator,
    ):
        result = coordinator.update(MODEL, transport="broadcast", train_gpus=TRAIN)
    assert (result.transport, result.committed, result.failed) == ("broadcast", [world.url], {})
    leg = result.legs[world.url]
    assert (leg["transport"], leg["bytes"]) == ("broadcast", 2 * generation_bytes(world.dirs[3]))
    assert leg["port"] >= store.settings.rendezvous_port
    # The sender read the generation from the Store once; nothing moved over TE.
    assert (result.store_read_bytes, result.pushed_bytes) == (generation_bytes(world.dirs[3]), 0)
    assert posts(world.engine, since) == {
        f"/mooncake/{path}": 1 for path in ("drain", "prepare", "apply", "commit")
    }
    assert world.compare(3) == [[], []]
    assert world.backend.events[-4:] == landing_events(world, "abort")
    status = world.status()
    assert (status["state"], status["generation"]) == ("serving", generation)
    assert_every_parameter_checked(world.engine, result)


@pytest.mark.parametrize(
    ("handoff", "index"), [("http", 1), ("auto", 2)], ids=["http", "shared-memory"]
)
def test_cpu_serialize_update_lands_what_sglang_loads_from_disk(
    world: World, handoff: str, index: int
) -> None:
    """One safetensors bucket per apply stage to both engines: as the raw body of
    ``POST /mooncake/bucket``, or (``auto`` on this host) as a ``/dev/shm`` file named in
    ``POST /mooncake/apply``. Every rank receives the whole generation."""
    generation = world.publish(index)
    engines = (world.engine, world.single)
    buckets = bucket_count(world, 64 << 10)
    assert buckets > 1
    since = [len(e.requests) for e in engines]
    with (
        transport_store(world, cpu_handoff=handoff) as store,
        Coordinator(store, [e.url for e in engines]) as coordinator,
    ):
        result = coordinator.update(
            MODEL, transport="cpu_serialize", train_gpus=TRAIN, batch_bytes=64 << 10
        )
    assert result.transport == "cpu_serialize"
    assert sorted(result.committed) == sorted(e.url for e in engines)
    model_bytes = generation_bytes(world.dirs[index])
    assert {u: (row["transport"], row["bytes"]) for u, row in result.legs.items()} == {
        world.url: ("cpu_serialize", 2 * model_bytes),
        world.single.url: ("cpu_serialize", model_bytes),
    }
    delivered = "/mooncake/bucket" if handoff == "http" else "/mooncake/apply"
    for engine, start in zip(engines, since, strict=True):
        calls = posts(engine, start)
        assert calls.pop(delivered) == buckets
        assert calls == {f"/mooncake/{p}": 1 for p in ("drain", "prepare", "commit")}
        status = engine.status()
        assert (status["state"], status["generation"]) == ("serving", generation)
        assert_every_parameter_checked(engine, result)
    assert world.compare(index) == [[], []]
    assert world.single.compare(world.dirs[index]) == [[]]
    assert not list(Path("/dev/shm").glob(f"*{result.session}*"))


def test_auto_update_splits_a_declared_mixed_topology(world: World) -> None:
    """The TP=2 engine shares ``gpu-s1`` with the train pool: CPU buckets (shared memory);
    the TP=1 engine is disjoint: broadcast. Both legs ran, so the mixed assertion passes."""
    generation = world.publish(0)
    with (
        transport_store(world, assert_mixed_transport=True) as store,
        Coordinator(store, [world.url, world.single.url]) as coordinator,
    ):
        result = coordinator.update(MODEL, transport="auto", train_gpus=f"{TRAIN},gpu-s1")
    assert result.transport == "auto"
    assert sorted(result.committed) == sorted([world.url, world.single.url])
    model_bytes = generation_bytes(world.dirs[0])
    assert {u: (row["transport"], row["bytes"]) for u, row in result.legs.items()} == {
        world.url: ("cpu_serialize", 2 * model_bytes),
        world.single.url: ("broadcast", model_bytes),
    }
    assert "port" in result.legs[world.single.url] and "port" not in result.legs[world.url]
    assert world.compare(0) == [[], []]
    assert world.single.compare(world.dirs[0]) == [[]]
    for engine in (world.engine, world.single):
        status = engine.status()
        assert (status["state"], status["generation"]) == ("serving", generation)
        assert_every_parameter_checked(engine, result)


def test_keep_update_lands_and_tags_the_new_weight_version(world: World) -> None:
    """A keep session stages beside serving and pauses only to land: the pause, cache
    reset, version tag and resume all follow the apply stages, and the version names the
    record landed."""
    generation = world.publish(1)
    since = len(world.engine.requests)
    with Coordinator(world.store, [world.url]) as coordinator:
        result = coordinator.update(MODEL, drain_mode="keep", batch_bytes=64 << 10)
    assert (result.drain_mode, result.committed) == ("keep", [world.url])
    assert world.compare(1) == [[], []]
    assert world.backend.events[-4:] == landing_events(world, "keep")
    assert posts(world.engine, since)["/mooncake/drain"] == 1
    status = world.status()
    assert (status["state"], status["generation"], status["pause_modes"]) == (
        "serving",
        generation,
        ["abort", "wait", "keep"],
    )
    assert_every_parameter_checked(world.engine, result)


def test_keep_is_refused_before_any_drain_by_an_engine_that_cannot_retract(
    world: World,
) -> None:
    """An SGLang whose pause offers no retract serves abort and wait only: a keep update
    is refused from its placement, and the engine keeps serving untouched."""
    backend = world.backend
    backend.engine_version, backend.pause_modes = "sglang 0.5.0", pause_modes(("abort",))
    try:
        world.publish(2)
        before, events, since = world.status(), list(backend.events), len(world.engine.requests)
        with (
            Coordinator(world.store, [world.url]) as coordinator,
            pytest.raises(UpdateFailed) as refused,
        ):
            coordinator.update(MODEL, drain_mode="keep")
    finally:
        del backend.engine_version, backend.pause_modes
    assert f"{world.url} runs sglang 0.5.0, which pauses only with abort, wait, not 'keep'" in (
        str(refused.value)
    )
    after = world.status()
    assert (after["state"], after["generation"]) == ("serving", before["generation"])
    assert backend.events == events and posts(world.engine, since) == {}
    assert world.compare(1) == [[], []]


def test_a_delta_lands_in_place_at_its_base_and_whole_elsewhere(world: World) -> None:
    """A keyframe both engines take, then a delta moving 1 % of the elements. The TP=1
    engine serves checkpoint layout, and the rank-major fragments packed for the TP=2 cut
    tile each of its whole-tensor boxes: it reads only the delta's entries and scatters
    them into live parameters. The TP=2 engine's row-parallel shards are columns, which no
    checksum covers alone: it reads the generation whole, rebuilt once from the chain.
    Both then hold exactly what SGLang loads from disk."""
    urls = [world.url, world.single.url]
    for _ in range(2):  # the second keyframe is packed for the cut both engines reported
        keyframe = world.publish(0)
        with Coordinator(world.store, urls) as coordinator:
            coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    step = perturbed_copy(world.dirs[0], world.root / "delta", 11, scale=0.05, fraction=0.01)
    tensors = checkpoint_tensors(step)
    record = publish_local(world.store, MODEL, tensors, dtype="float32", delta=DeltaPolicy())
    assert (record.base, record.keyframe) == (keyframe, keyframe)
    # A delta prepare whose slice is not this worker's fetch, or no slice at all: refused
    # by name, the engine at its base and serving, nothing held.
    active = GenerationRegistry(world.store, MODEL).active()
    assert active is not None and active.generation == record.generation
    session, url = uuid.uuid4().hex, f"{world.single.url}/mooncake"
    target = {k: getattr(active, k) for k in ("model", "generation", "fence", "incarnation")}
    drain = {"session": session, "holder": "test", "target": target}
    assert httpx.post(f"{url}/drain", json=drain, timeout=30).status_code == 200
    worker = world.single.placement()[0]["worker_id"]
    wrong = WorkerSlice({DELTA_REGION: 3}, ((),))
    body = {
        "session": session,
        **target,
        "manifest_digest": active.manifest_digest,
        "mode": "direct",
        "stages": 1,
        "delta": {"base": keyframe},
    }
    for workers, status, code in (
        (
            {worker: {"slice": encode_slice(wrong), "layout": [], "fallback": []}},
            409,
            "placement_mismatch",
        ),
        (
            {worker: {"slice": {"regions": "x"}, "layout": [], "fallback": []}},
            422,
            "invalid_request",  # typed at the route, before any worker sees it
        ),
        ({}, 422, "no_slice"),
    ):
        refused = httpx.post(f"{url}/prepare", json={**body, "workers": workers}, timeout=60)
        assert (refused.status_code, refused.json()["error"]) == (status, code)
        assert world.single.status()["generation"] == keyframe
    assert httpx.post(f"{url}/abort", json={"session": session}, timeout=30).status_code == 200
    assert (world.single.status()["state"], world.single.status()["session"]) == ("serving", None)
    with Coordinator(world.store, urls) as coordinator:
        result = coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    assert result.delta == [world.single.url]
    assert list(result.delta_refused) == [world.url]
    assert "no checksum covers alone" in result.delta_refused[world.url]
    assert sorted(result.committed) == sorted(urls)
    assert 0 < result.delta_bytes < record.bytes / 10
    assert result.realized_bytes > 0  # the TP=2 engine's full path
    assert world.engine.compare(step) == [[], []]
    assert world.single.compare(step) == [[]]
    assert world.single.status()["generation"] == record.generation
