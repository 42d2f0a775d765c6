"""Every ``mooncake_rl_*`` Prometheus metric: its name, type, labels and help, in one place.

Two vantages report the same update figures (:class:`~mooncake_rl.figures.UpdateFigures`):

- **an engine**, on the engine's own ``/metrics`` (``engine_ext.metrics`` mounts it): the
  receiver's state and served generation, read at scrape time, and ``mooncake_rl_engine_*``;
- **a coordinator process** (``mooncake-rl update``, the VeRL bridge): ``mooncake_rl_update_*``
  and ``mooncake_rl_updates_total``, from each update's :class:`UpdateResult`, on a port
  while the process runs and/or in a node-exporter textfile (:class:`UpdateMetrics`).

``docs/metrics.md`` lists them; ``docs/grafana/mooncake-rl.json`` charts them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from mooncake_rl.errors import ConfigurationError, MooncakeRLError
from mooncake_rl.figures import LANDINGS, UpdateFigures

if TYPE_CHECKING:
    from mooncake_rl.coordinator import UpdateResult

logger = logging.getLogger(__name__)

UPDATE_OUTCOMES = ("committed", "failed", "out_of_rotation", "refused")
"""How a coordinator's update ended: every engine committed (or already served it); it raised
:class:`~mooncake_rl.coordinator.UpdateFailed`; it synced but engines stayed out of the
router's rotation; it was refused before any engine was drained (no result)."""


@dataclass(frozen=True)
class Vantage:
    """Who reports a set of update figures, and what its ends and rebuilds mean there."""

    prefix: str
    outcomes: str
    outcomes_help: str
    rebuilds_help: str


ENGINE = Vantage(
    "mooncake_rl_engine",
    "mooncake_rl_engine_sessions",
    "Update sessions this engine ended, by outcome (committed, aborted, failed, expired, broken)",
    "Rebuilds of this engine from the Store's active generation that completed",
)
COORDINATOR = Vantage(
    "mooncake_rl_update",
    "mooncake_rl_updates",
    "Updates this process ran, by outcome (committed, failed, out_of_rotation, refused)",
    "Engines an update left rebuilding themselves from the Store's active generation",
)


def update_families(vantage: Vantage, figures: UpdateFigures) -> list[Metric]:
    """Phase seconds, bytes, failures, ends and rebuilds, as seen from ``vantage``."""
    name = vantage.prefix
    phases = HistogramMetricFamily(
        f"{name}_phase_seconds", "Seconds each update phase took", labels=["phase"]
    )
    for phase, histogram in sorted(dict(figures.phases).items()):
        buckets = [(floatToGoString(b), n) for b, n in histogram.cumulative()]
        phases.add_metric([phase], buckets, histogram.total)
    received = CounterMetricFamily(
        f"{name}_received_bytes",
        "Bytes received into engine workers, by landing (in_place: live parameters; "
        "staged: staging landed at commit)",
        labels=["landing"],
    )
    for landing in LANDINGS:
        received.add_metric([landing], figures.received_bytes[landing])
    return [
        phases,
        CounterMetricFamily(
            f"{name}_store_read_bytes",
            "Bytes read from Mooncake Store",
            value=figures.store_read_bytes,
        ),
        CounterMetricFamily(
            f"{name}_pushed_bytes",
            "Bytes pushed to peer workers with Transfer Engine writes",
            value=figures.pushed_bytes,
        ),
        received,
        _counted(
            f"{name}_failures",
            "Refused or failed update steps, by error code",
            "code",
            figures.failures,
        ),
        _counted(vantage.outcomes, vantage.outcomes_help, "outcome", figures.outcomes),
        CounterMetricFamily(f"{name}_rebuilds", vantage.rebuilds_help, value=figures.rebuilds),
    ]


def _counted(name: str, documentation: str, label: str, counts: Mapping[str, int]) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, count in sorted(dict(counts).items()):
        family.add_metric([value], count)
    return family


def receiver_families(
    status: Mapping[str, Any], states: Sequence[str], figures: UpdateFigures
) -> list[Metric]:
    """An engine's families: its receiver's ``status()`` now, and its update figures."""
    state = GaugeMetricFamily(
        "mooncake_rl_receiver_state",
        "1 for the state the engine's update receiver is in, 0 for the others",
        labels=["state"],
    )
    for name in states:
        state.add_metric([name], float(name == status["state"]))
    served = GaugeMetricFamily(
        "mooncake_rl_served_generation", "The generation the engine serves", labels=["model"]
    )
    served.add_metric([str(status["model"])], status["generation"])
    adapters = GaugeMetricFamily(
        "mooncake_rl_resident_adapter_generation",
        "The adapter generation each request name selects (POLICY@G, and POLICY: the newest)",
        labels=["adapter", "name"],
    )
    kept = status.get("adapter") or {}
    for name, generation in kept.get("resident", {}).items():
        adapters.add_metric([str(kept["model"]), name], generation)
    return [state, served, adapters, *update_families(ENGINE, figures)]


# -- a coordinator process -------------------------------------------------------------------
@dataclass(frozen=True)
class MetricsExport:
    """Where a coordinator process exposes its update figures.

    ``port``: serve them over HTTP while the process runs (``addr``: the interface);
    ``textfile``: rewrite this node-exporter textfile collector file, atomically, after
    every update (the collector reads only ``*.prom`` files).
    """

    port: int | None = None
    textfile: Path | None = None
    addr: str = "0.0.0.0"

    def __post_init__(self) -> None:
        if self.port is not None and not 1 <= self.port <= 65535:
            raise ConfigurationError(f"the metrics port must lie in 1..65535, got {self.port}")
        if self.textfile is not None and self.textfile.suffix != ".prom":
            raise ConfigurationError(
                f"the metrics textfile {self.textfile} must end in .prom: node exporter's "
                "textfile collector reads nothing else"
            )


@dataclass(frozen=True)
class LastUpdate:
    """The most recent update's own figures (a textfile keeps only these and the totals)."""

    outcome: str
    at: float
    result: UpdateResult | None

    def families(self) -> list[Metric]:
        success = GaugeMetricFamily(
            "mooncake_rl_update_last_success",
            "1 if the last update committed on every engine it needed, else 0",
            value=float(self.outcome == "committed"),
        )
        at = GaugeMetricFamily(
            "mooncake_rl_update_last_timestamp_seconds",
            "Unix time the last update ended",
            value=self.at,
        )
        if self.result is None:
            return [success, at]
        result = self.result
        generation = GaugeMetricFamily(
            "mooncake_rl_update_last_generation",
            "The generation the last update brought engines to",
            labels=["model"],
        )
        generation.add_metric([result.model], result.generation)
        engines = GaugeMetricFamily(
            "mooncake_rl_update_last_engines",
            "Engines of the last update, by outcome (committed, skipped: already served it, "
            "failed: left out, rebuild: rebuilding from the Store)",
            labels=["outcome"],
        )
        for outcome, urls in (
            ("committed", result.committed),
            ("skipped", result.skipped),
            ("failed", result.failed),
            ("rebuild", result.rebuild),
        ):
            engines.add_metric([outcome], len(urls))
        duration = GaugeMetricFamily(
            "mooncake_rl_update_last_duration_seconds",
            "Seconds the last update took, its phases summed",
            value=sum(result.phase_seconds.values()),
        )
        return [success, at, generation, engines, duration]


class UpdateMetrics:
    """The update figures of one coordinator process (a CLI run, a trainer), as a collector.

    :meth:`observe` runs each update and records it however it ends; the totals accumulate
    for the process's life, and the last update's own figures replace the previous ones.
    """

    def __init__(
        self, export: MetricsExport | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.export = export or MetricsExport()
        self.figures = UpdateFigures()
        self.last: LastUpdate | None = None
        self._clock = clock
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]  # a collector: it has collect()

    def collect(self) -> Iterator[Metric]:
        yield from update_families(COORDINATOR, self.figures)
        if self.last is not None:
            yield from self.last.families()

    def observe(self, update: Callable[[], UpdateResult]) -> UpdateResult:
        """Run ``update``, record how it ended, re-raise its error, write the textfile."""
        # Here, not at the top: the engine's server imports this module, not the coordinator.
        from mooncake_rl.coordinator import ReadmitFailed, UpdateFailed

        try:
            result = update()
        except UpdateFailed as failed:
            self.record("failed", failed.result)
            raise
        except ReadmitFailed as stuck:
            self.record("out_of_rotation", stuck.result)
            raise
        except MooncakeRLError:
            self.record("refused", None)
            raise
        else:
            self.record("committed", result)
            return result
        finally:
            self.write()

    def record(self, outcome: str, result: UpdateResult | None) -> None:
        if outcome not in UPDATE_OUTCOMES:
            raise ValueError(f"unknown update outcome {outcome!r}; one of {UPDATE_OUTCOMES}")
        figures = self.figures
        figures.outcomes[outcome] += 1
        self.last = LastUpdate(outcome, self._clock(), result)
        if result is None:
            return
        for phase, seconds in result.phase_seconds.items():
            figures.timed(phase, seconds)
        figures.store_read_bytes += result.store_read_bytes
        figures.pushed_bytes += result.pushed_bytes
        # Broadcast and CPU deliveries report their bytes by leg, all staged.
        legs = sum(row["bytes"] for row in result.legs.values() if row["transport"] != "store")
        figures.received(result.in_place_bytes, result.staged_bytes + legs)
        figures.failures.update(result.failure_codes.values())
        figures.rebuilds += len(result.rebuild)

    def write(self) -> None:
        """Rewrite the textfile, if one is configured; a failed write never fails an update."""
        path = self.export.textfile
        if path is None:
            return
        try:
            write_to_textfile(str(path), self.registry)
        except OSError as error:
            logger.warning("mooncake-rl: could not write the metrics textfile %s: %s", path, error)

    @contextlib.contextmanager
    def serving(self) -> Iterator[UpdateMetrics]:
        """Serve the figures on ``export.port`` (if set) while the block runs."""
        port = self.export.port
        if port is None:
            yield self
            return
        try:
            server, thread = start_http_server(port, self.export.addr, registry=self.registry)
        except OSError as error:
            raise ConfigurationError(
                f"cannot serve metrics on {self.export.addr}:{port}: {error.strerror}"
            ) from error
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()
            thread.join()
