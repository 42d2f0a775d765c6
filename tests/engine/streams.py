"""Streamed greedy requests on a real vLLM server, for tests that update under them."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

from engine_ext.vllm.server import VllmServer


class TokenStream(threading.Thread):
    """One greedy streamed request on vLLM's ``/inference/v1/generate``: its token ids as
    they arrive, then its finish reason and ``weight_versions`` spans (final chunk)."""

    def __init__(self, engine: VllmServer, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.engine, self.prompt, self.max_tokens = engine, prompt, max_tokens
        self.tokens: list[int] = []
        self.started_tokens = threading.Event()
        self.final: dict[str, Any] = {}

    def run(self) -> None:
        body = {
            "token_ids": self.prompt,
            "sampling_params": {
                "max_tokens": self.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
            "stream": True,
        }
        url = f"{self.engine.url}/inference/v1/generate"
        with httpx.stream("POST", url, json=body, headers=self.engine.headers(), timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                self.tokens += choice.get("token_ids") or []
                if len(self.tokens) >= 8:
                    self.started_tokens.set()
                if choice.get("finish_reason") is not None:
                    self.final = choice
        self.started_tokens.set()


def generate(engine: VllmServer, prompt: list[int], max_tokens: int) -> list[int]:
    stream = TokenStream(engine, prompt, max_tokens)
    stream.run()
    return stream.tokens
