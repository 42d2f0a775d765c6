"""A small real HTTP worker for the router tests: it answers what a router's health checks
and one completion route need, and says which worker served (``python -m`` it with a port)."""

from __future__ import annotations

import sys

import uvicorn
from fastapi import FastAPI

app = FastAPI()
PORT = int(sys.argv[1]) if __name__ == "__main__" else 0


@app.get("/health")
def health() -> dict[str, str]:
    return {}


@app.get("/v1/models")
def models() -> dict[str, list[dict[str, str]]]:
    return {"data": [{"id": "tiny"}]}


@app.get("/get_model_info")
def model_info() -> dict[str, object]:
    return {"model_path": "tiny", "is_generation": True}


@app.get("/get_server_info")
def server_info() -> dict[str, str]:
    return {"version": "http-worker"}


@app.post("/v1/completions")
def completions(body: dict[str, object]) -> dict[str, object]:
    return {"worker": PORT, "choices": [{"text": "ok", "finish_reason": "length"}]}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
