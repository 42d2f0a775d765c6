"""What the engines report of their placements, and what a plan is keyed and read by.

Worker descriptions in (``GET /mooncake/placement``, with or without their boxes): each
worker's placement digest (:func:`placement_reports`), an engine per distinct placement
(:func:`representatives`), the topology (:func:`topology_of`), and a direct plan's cache keys
from the reports alone (:class:`DirectKey`). Boxes are read only when a plan needs them, one
engine per distinct placement (:class:`Boxes`), and checked to be what the engine reported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import ConfigurationError, InvariantViolation
from mooncake_rl.generations.layout import SegmentMap
from mooncake_rl.plan.cache import PlanKey
from mooncake_rl.plan.demand import declared_digest
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.planner import plan_key
from mooncake_rl.plan.topology import Topology, Worker
from mooncake_rl.protocol import (
    PLACEMENT_DIGEST,
    has_boxes,
    placement_digest,
    reports_own_placement,
)

Describe = Callable[[Sequence[str]], Mapping[str, Sequence[Mapping[str, Any]]]]
"""Reads the named engines' worker descriptions with their boxes (``GET /mooncake/placement``)."""


def require_staging(engines: Mapping[str, Sequence[Mapping[str, Any]]], batch_bytes: int) -> None:
    """Refuse batches that some worker's staging watermark cannot hold twice.

    A worker overlaps one batch's reads with the previous batch's pushes, so its watermark
    (the engine's ``MOONCAKE_RL_STAGING_WATERMARK_BYTES``, reported with its placement) must
    admit two batches of the size the plan is built with. Workers that report none (older
    engines) are left to prepare, which refuses any batch above their watermark.
    """
    short = sorted(
        (int(w["staging_watermark_bytes"]), w["worker_id"])
        for workers in engines.values()
        for w in workers
        if int(w.get("staging_watermark_bytes", 2 * batch_bytes)) < 2 * batch_bytes
    )
    if short:
        watermark, worker = short[0]
        raise ConfigurationError(
            f"the plan's batches of {batch_bytes} bytes (MOONCAKE_RL_BATCH_BYTES or `mooncake-rl "
            f"update --batch-bytes`) need a staging watermark of {2 * batch_bytes} bytes on "
            f"every engine worker; {len(short)} have less (worker {worker}: {watermark}): "
            "lower the batch, or raise MOONCAKE_RL_STAGING_WATERMARK_BYTES on the engines"
        )


def reported_digest(reports: Mapping[str, str], direct_fallback: str | None) -> str:
    """The direct demand's digest from the workers' ``placement_digest`` reports
    (:func:`placement_reports`): the cache key costs one hash per worker."""
    return declared_digest(reports.items(), scope=f"direct-fallback={direct_fallback or ''}")


def placement_reports(workers: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Each worker's reported placement digest (computed here for one that reports none)."""
    unnamed = [w["worker_id"] for w in workers if not w.get(PLACEMENT_DIGEST) and not has_boxes(w)]
    if unnamed:
        raise InvariantViolation(
            f"worker {unnamed[0]} reports neither a placement digest nor its boxes: its "
            "placement is unknown; describe it with GET /mooncake/placement"
        )
    return {w["worker_id"]: w.get(PLACEMENT_DIGEST) or placement_digest(w) for w in workers}


def representatives(
    engines: Mapping[str, Sequence[Mapping[str, Any]]], reports: Mapping[str, str]
) -> dict[str, str]:
    """Each engine's representative: the first engine whose workers report the same digests
    rank by rank. Equal digests mean equal planned placements, so a fleet of identical
    engines has its placement read, checked and planned once (a 1T MoE's TP8 engine
    describes a million boxes), and the planner sees one placement group."""
    first: dict[tuple[tuple[int, str], ...], str] = {}
    out = {}
    for url, workers in engines.items():
        out[url] = first.setdefault(ranked_reports(workers, reports), url)
    return out


def ranked_reports(
    workers: Sequence[Mapping[str, Any]], reports: Mapping[str, str]
) -> tuple[tuple[int, str], ...]:
    """An engine's placement, identified: its workers' reports in TP rank order."""
    return tuple(sorted((int(w["tp_rank"]), reports[w["worker_id"]]) for w in workers))


def require_true_reports(engines: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """Before a table is planned (and kept under the reported key): each worker of the
    engines read (one per distinct placement) must report the digest of the description it
    sent. Engines that report the same digests are planned from that one description and
    not read: each of their workers checks at prepare that its slice names its own digest
    (``placement_digest`` in the prepare body), so a report that is not an engine's own
    fails there, before anything is staged."""
    for workers in engines.values():
        for w in workers:
            _require_true_report(w)


def _require_true_report(w: Mapping[str, Any]) -> None:
    if not reports_own_placement(w):
        raise InvariantViolation(
            f"worker {w['worker_id']} reported placement digest {w[PLACEMENT_DIGEST]}, but its "
            f"placement hashes to {placement_digest(w)}: the engine runs another "
            "mooncake-rl version; upgrade it to the coordinator's"
        )


def topology_of(engines: Mapping[str, Sequence[Mapping[str, Any]]]) -> Topology:
    """One ``Worker`` per worker description; an engine (its URL) is one instance."""
    return Topology.of(
        Worker(w["worker_id"], w["node"], url, int(w["tp_rank"]), w.get("segment"))
        for url, workers in engines.items()
        for w in workers
    )


@dataclass(frozen=True)
class DirectKey:
    """A direct plan's cache keys, from the workers' reports alone (no box is read)."""

    engines: Mapping[str, Sequence[Mapping[str, Any]]]
    reports: Mapping[str, str]
    representative: Mapping[str, str]
    direct_fallback: str | None
    key: PlanKey

    @classmethod
    def of(
        cls,
        manifest: WeightManifest,
        engines: Mapping[str, Sequence[Mapping[str, Any]]],
        params: PlanParams,
        layout_digest: str | None,
        direct_fallback: str | None,
        segments: SegmentMap | None,
    ) -> DirectKey:
        reports = placement_reports([w for ws in engines.values() for w in ws])
        key = plan_key(
            manifest,
            topology_of(engines),
            reported_digest(reports, direct_fallback),
            params,
            layout_digest,
            segments=segments,
        )
        return cls(engines, reports, representatives(engines, reports), direct_fallback, key)

    @property
    def distinct(self) -> list[str]:
        """One engine per distinct placement (its representative)."""
        return list(dict.fromkeys(self.representative.values()))

    def layout_key(self, url: str) -> tuple:
        """``url``'s placement, for the layout and parts caches: the source layout, the
        direct fallback and its workers' reports rank by rank."""
        return (
            self.key.source_digest,
            self.direct_fallback,
            ranked_reports(self.engines[url], self.reports),
        )


class Boxes:
    """The engines' descriptions; boxes are read through ``describe`` when first needed."""

    def __init__(
        self, engines: Mapping[str, Sequence[Mapping[str, Any]]], describe: Describe | None
    ) -> None:
        self.engines = dict(engines)
        self.describe = describe

    def of(self, urls: Sequence[str]) -> dict[str, Sequence[Mapping[str, Any]]]:
        bare = [url for url in urls if not all(map(has_boxes, self.engines[url]))]
        if bare and self.describe is None:
            raise InvariantViolation(
                f"engine {bare[0]} was described without its boxes and this plan reads them: "
                "pass its full GET /mooncake/placement reply"
            )
        read = self.describe(bare) if bare else {}
        for url in bare:
            workers = read[url]
            if not all(map(has_boxes, workers)) or placement_reports(workers) != placement_reports(
                self.engines[url]
            ):
                raise InvariantViolation(
                    f"engine {url} describes another placement with its boxes than without "
                    "them (restarted or reconfigured during the update): run the update again"
                )
            self.engines[url] = workers
        return {url: self.engines[url] for url in urls}
