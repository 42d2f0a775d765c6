"""Families beyond the tiny Llama, through real vLLM engines (the smoke of ``make models``).

A tied-embedding Qwen2 (qkv bias and a tied ``lm_head``) and a Qwen3-MoE (fused experts),
their engines launched at once: each starts from the Store, is updated in compat then direct
mode, and after each update serves exactly transformers' greedy output for that generation's
local directory (equal to plain vLLM's for these families; ``make models`` compares against
plain vLLM servers).
On the same engines: a direct update that leaves the qkv biases to the per-parameter
fallback, and a bad landing caused on purpose (vLLM's own stale CPU expert prepack, put
back) that the post-landing check must refuse to serve.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

pytest.importorskip("vllm")

from bench.models import FamilyRun, LaunchedFamily, finish_family, launch_family, update_once
from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator, UpdateFailed
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, hf_greedy
from tests.conftest import settings_for

pytestmark = pytest.mark.timeout(900)
FAULTS = Path(__file__).parent / "faults"


@pytest.fixture(scope="module")
def store(master: EmbeddedMaster, holders):
    settings = settings_for(
        master, "coordinator", segment_bytes=0, local_segment=holders("families").segment
    )
    with StoreClient(settings) as client:
        yield settings, client


@pytest.fixture(scope="module")
def stale_marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """While this file exists, the MoE engine puts vLLM's stale CPU expert prepack back."""
    return tmp_path_factory.mktemp("fault") / "stale-experts"


@pytest.fixture(scope="module")
def launched(
    store, stale_marker: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, LaunchedFamily]]:
    """Both families' engines, launched at once (each start is mostly one process
    importing); each test waits for its own."""
    settings, client = store
    root = tmp_path_factory.mktemp("families")
    pythonpath = os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": pythonpath, "MOONCAKE_RL_TEST_STALE_EXPERTS": str(stale_marker)}
    families: dict[str, LaunchedFamily] = {}
    try:
        families["qwen2"] = launch_family(
            "qwen2", True, 1, root, settings, client, reference=hf_greedy
        )
        families["qwen3_moe"] = launch_family(
            "qwen3_moe", False, 1, root, settings, client, engine_env=env, reference=hf_greedy
        )
        yield families
    finally:
        for family in families.values():
            family.close()


def assert_both_modes_exact(run: FamilyRun) -> None:
    assert run.error is None
    for mode in (run.compat, run.direct):
        assert mode.error is None
        assert mode.outputs == mode.reference
        assert mode.checked > 0 and mode.unchecked == 0
    # Direct mode receives exactly the engine's parameter bytes; compat reads the model once.
    assert run.direct.received_bytes == run.direct.store_read_bytes
    assert run.direct.fallback_bytes == 0
    assert run.compat.store_read_bytes > 0


def test_tied_qwen2_updates_exactly_and_the_fallback_lands_the_rest(store, launched) -> None:
    _, client = store
    fallback: dict[str, object] = {}

    def direct_with_fallback(engine: VllmServer, run: FamilyRun, dirs: list[Path]) -> None:
        # Generation 4 holds generation 2's weights: their reference output is known.
        update = update_once(
            client, engine, "qwen2-tied-tp1", dirs[1], "direct", r"qkv_proj\.bias$"
        )
        fallback.update(
            update=update,
            reference=run.compat.reference,
            placement=engine.mooncake("GET", "placement").json()["workers"][0],
        )

    run = finish_family(launched["qwen2"], client, after=direct_with_fallback)
    assert_both_modes_exact(run)

    update, worker = fallback["update"], fallback["placement"]
    assert update.error is None and update.outputs == fallback["reference"]
    stored = load_file(launched["qwen2"].dirs[1] / "model.safetensors")
    biases = ("q_proj.bias", "k_proj.bias", "v_proj.bias")
    assert update.fallback_bytes == sum(t.nbytes for n, t in stored.items() if n.endswith(biases))
    fused = [f"model.layers.{i}.self_attn.qkv_proj.bias" for i in (0, 1)]
    direct = sum(r["bytes"] for r in worker["regions"].values())
    direct -= sum(worker["regions"][name]["bytes"] for name in fused)
    assert update.received_bytes == direct + update.fallback_bytes
    (check,) = update.result.verified.values()
    assert check["unchecked"] == fused and check["mismatched"] == []
    # Norms are served as loaded: received in place, not compared after a landing step.
    norms = [n for n in worker["regions"] if n.endswith("norm.weight")]
    assert check["in_place"] == len(norms) > 0
    assert update.in_place_bytes == sum(worker["regions"][n]["bytes"] for n in norms)
    assert check["checked"] == len(worker["regions"]) - len(fused) - len(norms)


def test_qwen3_moe_updates_exactly_and_a_stale_landing_is_never_served(
    store, launched, stale_marker: Path
) -> None:
    _, client = store
    seen: dict[str, object] = {}

    def stale_experts(engine: VllmServer, run: FamilyRun, dirs: list[Path]) -> None:
        stale_marker.touch()
        publish_checkpoint(client, "qwen3_moe-untied-tp1", dirs[1], "float32")
        with (
            Coordinator(client, [engine.url], token=engine.token) as coordinator,
            pytest.raises(UpdateFailed) as failed,
        ):
            coordinator.update("qwen3_moe-untied-tp1", mode="compat", batch_bytes=64 << 10)
        seen.update(failed=failed.value, url=engine.url, broken=status_of(engine))
        # The engine rebuilds itself from the Store; while the fault lasts, the rebuild's own
        # landing check refuses it too, and the engine stays out of service.
        seen["refused"] = wait_for(engine, lambda s: "rebuild failed" in (s["last_error"] or ""))
        seen["ready"] = httpx.get(f"{engine.url}/mooncake/ready").status_code
        stale_marker.unlink()
        seen["rebuilt"] = wait_for(engine, lambda s: s["state"] == "serving")
        seen["outputs"] = engine.complete(PROMPT)

    run = finish_family(launched["qwen3_moe"], client, after=stale_experts)
    assert_both_modes_exact(run)

    assert "did not land intact" in str(seen["failed"]) and "mlp.experts" in str(seen["failed"])
    assert seen["failed"].result.rebuild == [seen["url"]]
    broken = seen["broken"]
    assert broken["state"] in ("broken", "rebuilding") and broken["generation"] == 3
    assert "did not land intact" in seen["refused"]["last_error"]
    assert seen["refused"]["state"] in ("broken", "rebuilding") and seen["ready"] == 503
    rebuilt = seen["rebuilt"]
    assert (rebuilt["generation"], rebuilt["rebuilds"], rebuilt["last_error"]) == (4, 1, None)
    assert seen["outputs"] == run.compat.reference  # generation 4 holds the compat checkpoint


def status_of(engine: VllmServer) -> dict:
    return engine.mooncake("GET", "status").json()


def wait_for(engine: VllmServer, done: Callable[[dict], bool], timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while not done(status := status_of(engine)):
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    return status
