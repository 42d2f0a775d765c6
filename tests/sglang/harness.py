"""Run SGLang's model-loading stack and the SGLang update worker outside an SGLang server.

A scheduler process publishes SGLang's runtime context for its TP rank before building the
model; :func:`publish_topology` does the same, so SGLang's parallel layers own their
partition without ``torch.distributed`` (SGLang's "logical group"). Worker processes then
load through ``get_model_loader`` exactly as a scheduler's model runner does.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch

from mooncake_rl.settings import Settings
from mooncake_rl.tiny_model import make_tiny
from tests.sglang.models.tiny import ARCHITECTURE


def publish_topology(tp_size: int, tp_rank: int) -> None:
    """SGLang's runtime context for one TP rank, as its own test utilities publish it."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(
        ServerArgs(model_path="dummy", tp_size=tp_size),
        role="test",
        ranks=SpawnRanks(world_rank=tp_rank),
    )


def sglang_model_dir(directory: Path) -> Path:
    """A tiny tied Qwen2 checkpoint (qkv bias, tied lm_head, one key/value head), its config
    naming the tests' SGLang architecture."""
    make_tiny("qwen2", directory, tied=True)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [ARCHITECTURE]
    config_path.write_text(json.dumps(config))
    return directory


def load_model(model_dir: Path, load_format: str, extra: dict[str, Any] | None = None) -> Any:
    """SGLang's loader selection and ``load_model``, on CPU."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    model_config = ModelConfig(str(model_dir), dtype="float32")
    load_config = LoadConfig(load_format=load_format, model_loader_extra_config=extra or {})
    loader = get_model_loader(load_config, model_config)
    return loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))


def mismatched_parameters(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """Names of parameters whose bytes differ from the reference model's."""
    expected = dict(reference.named_parameters())
    return [
        name
        for name, parameter in model.named_parameters()
        if not torch.equal(
            parameter.detach().contiguous().view(torch.uint8),
            expected[name].detach().contiguous().view(torch.uint8),
        )
    ]


def settings_env(settings: Settings) -> dict[str, str]:
    return {
        "MOONCAKE_RL_MASTER": settings.master,
        "MOONCAKE_RL_METADATA": settings.metadata,
        "MOONCAKE_RL_NODE": settings.node,
        "MOONCAKE_RL_BUFFER_BYTES": str(16 << 20),
    }


def serve_tp_rank(
    env: dict[str, str],
    tp_size: int,
    tp_rank: int,
    model_dir: Path,
    model_name: str,
    inbox: Any,
    outbox: Any,
) -> None:
    """One simulated SGLang TP rank. Commands: ("call", engine_id, method, args) -> reply;
    ("compare", checkpoint_dir) -> mismatched parameter names; ("corrupt",) adds 1 to every
    live parameter (what a half-landed update leaves); ("stop",)."""
    os.environ.update(env)
    from sglang.srt.plugins import load_plugins

    from engine_ext.sglang.worker import SglangUpdateWorker

    load_plugins()
    publish_topology(tp_size, tp_rank)
    try:
        model = load_model(model_dir, "mooncake", {"name": model_name})
        worker = SglangUpdateWorker(lambda: model)
        outbox.put(("ok", "ready"))
    except Exception:
        outbox.put(("error", traceback.format_exc()))
        return
    while True:
        command = inbox.get(timeout=600)
        try:
            if command[0] == "call":
                _, engine_id, method, args = command
                outbox.put(("ok", worker.call(engine_id, method, *args)))
            elif command[0] == "compare":
                outbox.put(("ok", mismatched_parameters(model, load_model(command[1], "auto"))))
            elif command[0] == "corrupt":
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.add_(1.0)
                outbox.put(("ok", None))
            elif command[0] == "stop":
                outbox.put(("ok", None))
                return
        except Exception:
            outbox.put(("error", traceback.format_exc()))
