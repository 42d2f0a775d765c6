"""The receiver's figures on the engine's own ``/metrics`` (names: :mod:`mooncake_rl.metrics`).

Import this module only once the engine's server runs: it imports ``prometheus_client``,
and SGLang picks that package's multiprocess mode when it is first imported, which must be
SGLang's own import, made after it set ``PROMETHEUS_MULTIPROC_DIR``.

How each engine serves ``/metrics``, and so where the collector goes (:func:`expose`):

- vLLM with one API server: prometheus_client's default ``REGISTRY``.
- SGLang (``--enable-metrics``): a ``/metrics`` mount over a fresh registry that holds only
  a ``MultiProcessCollector``. That registry is not reachable, so the mount gets an app
  over a registry holding the same collector and this one.
- vLLM with ``PROMETHEUS_MULTIPROC_DIR`` (``--api-server-count`` > 1): its route builds a
  registry per scrape; nothing can join it, and each API server process would hold a
  receiver of its own anyway. Refused with a warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

from fastapi import FastAPI
from prometheus_client import REGISTRY, CollectorRegistry, make_asgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.routing import Mount

from engine_ext.receiver import Receiver
from engine_ext.sessions import ReceiverState
from mooncake_rl.metrics import receiver_families

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STATES = tuple(state.value for state in ReceiverState)


class ReceiverCollector:
    """Reads the engine's receiver at scrape time, so nothing is counted twice."""

    def __init__(self, current: Callable[[], Receiver | None]) -> None:
        self.current = current

    def collect(self) -> Iterable[Metric]:
        receiver = self.current()
        if receiver is None:  # the engine is still starting
            return []
        return receiver_families(receiver.status(), STATES, receiver.figures)


def expose(
    app: FastAPI,
    current: Callable[[], Receiver | None],
    registry: CollectorRegistry = REGISTRY,
) -> bool:
    """Add the receiver's figures to ``app``'s own ``/metrics``; whether they are there.

    ``registry``: the one a single-process ``/metrics`` serves (the default ``REGISTRY``).
    """
    route = next((r for r in app.routes if getattr(r, "path", None) == "/metrics"), None)
    collector = ReceiverCollector(current)
    if route is None:
        logger.warning(
            "mooncake: the engine serves no /metrics (SGLang: --enable-metrics), so the "
            "mooncake_rl_* metrics are not exported"
        )
        return False
    if MULTIPROC_ENV not in os.environ:
        registry.register(collector)  # type: ignore[arg-type]  # a collector: it has collect()
        return True
    if isinstance(route, Mount):
        served = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(served)
        served.register(collector)  # type: ignore[arg-type]
        route.app = make_asgi_app(registry=served)
        return True
    logger.warning(
        "mooncake: /metrics serves only %s (vLLM --api-server-count > 1), so the "
        "mooncake_rl_* metrics are not exported; run one API server per engine",
        MULTIPROC_ENV,
    )
    return False
