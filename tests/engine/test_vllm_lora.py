"""LoRA adapter generations in a real vLLM-CPU engine (issue 53, the worker side): the base
loaded from the Store (``--load-format mooncake``), adapter generations read from the Store
into vLLM's own LoRA manager through the worker extension, two resident at once, each
answering exactly what vLLM answers with the same adapter loaded from a local directory.

vLLM runs in a child process (its engine in-process there, ``VLLM_ENABLE_V1_MULTIPROCESSING
=0``), driven by ``LLM.collective_rpc`` into the worker extension the API server uses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from engine_ext.vllm.server import GPU_MEMORY_UTILIZATION, KV_CACHE_BYTES, engine_env
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.generations.lora import AdapterBase, publish_adapter, read_adapter
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, make_tiny_llama, make_tiny_lora
from tests.conftest import settings_for
from tests.procs import CTX

BASE, POLICY, OTHER = "lora-e2e-base", "lora-e2e-policy", "lora-e2e-other"
pytestmark = pytest.mark.timeout(600)


def serve_and_compare(env: dict[str, str], base_dir: str, dirs: list[str], out: Any) -> None:
    """In the child: a vLLM engine with LoRA from the Store's base; each case's tokens (or
    the child's error, so the test fails at once with it)."""
    try:
        out.put(compare(env, base_dir, dirs))
    except BaseException as error:
        out.put({"error": f"{type(error).__name__}: {error}"})


def compare(env: dict[str, str], base_dir: str, dirs: list[str]) -> dict[str, Any]:
    os.environ.update(env)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from engine_ext.vllm.lora import adapter_id, adapter_path

    llm = LLM(
        model=base_dir,
        load_format="mooncake",
        model_loader_extra_config={"name": BASE},
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        max_cpu_loras=4,
        enforce_eager=True,
        worker_extension_cls="mooncake_rl.Ext",
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    greedy = SamplingParams(max_tokens=8, temperature=0)

    def tokens(request: LoRARequest | None) -> list[int]:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=PROMPT)], greedy, lora_request=request, use_tqdm=False
        )
        return list(outputs[0].outputs[0].token_ids)

    def adapter(model: str, generation: int) -> dict[str, Any]:
        [reply] = llm.collective_rpc("mooncake_call", args=("engine", "adapter", model, generation))
        return reply

    results: dict[str, Any] = {"base": tokens(None)}
    for i, directory in enumerate(dirs[:2]):
        results[f"dir{i + 1}"] = tokens(LoRARequest(f"dir{i + 1}", 100 + i, directory))
    results["load"] = [adapter(POLICY, g) for g in (1, 2)]
    for g in (1, 2):  # both resident, each under its own name; no path is ever read
        results[f"store{g}"] = tokens(
            LoRARequest(f"{POLICY}@{g}", adapter_id(g), adapter_path(POLICY, g))
        )
    results["too_wide"] = adapter(POLICY, 3)
    results["other_base"] = adapter(OTHER, 1)
    results["weights"] = adapter(BASE, 1)
    return results


def test_adapter_generations_serve_what_vllm_serves_from_a_local_directory(
    master: EmbeddedMaster, holders, tmp_path: Path
) -> None:
    base_dir = make_tiny_llama(tmp_path / "base")
    dirs = [make_tiny_lora(base_dir, tmp_path / f"a{i}", seed=i) for i in (1, 2)]
    wide = make_tiny_lora(base_dir, tmp_path / "wide", seed=3, rank=16)
    settings = settings_for(
        master, "lora-node", segment_bytes=0, local_segment=holders("lora").segment
    )
    with StoreClient(settings) as store:
        base = publish_checkpoint(store, BASE, base_dir, "float32")
        other = publish_checkpoint(store, "lora-e2e-other-base", base_dir, "float32")
        bound = AdapterBase(BASE, base.generation)
        for directory in (*dirs, wide):
            publish_adapter(store, POLICY, read_adapter(directory), bound)
        publish_adapter(
            store, OTHER, read_adapter(dirs[0]), AdapterBase(other.model, other.generation)
        )
    out = CTX.Queue()
    child = CTX.Process(
        target=serve_and_compare,
        args=(
            engine_env(settings, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
            str(base_dir),
            [str(d) for d in dirs],
            out,
        ),
    )
    child.start()
    try:
        results = out.get(timeout=540)
        assert "error" not in results, results["error"]
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join()
    assert results["store1"] == results["dir1"] != results["base"]
    assert results["store2"] == results["dir2"] != results["dir1"]
    assert [r["ok"] for r in results["load"]] == [True, True]
    assert {1, 2} <= set(results["load"][1]["resident"])
    assert results["load"][0]["adapter_bytes"] > 0
    assert results["too_wide"]["refused"]["code"] == "adapter_refused"
    assert "cannot serve the adapter" in results["too_wide"]["error"]
    assert (
        f"applies to generation {other.generation} of {other.model!r}"
        in (results["other_base"]["error"])
    )
    assert "holds model weights" in results["weights"]["error"]
