"""Demand merge: per object, the union of demanded bytes cut into disjoint ranges.

Every range lists each consumer's destination, so overlapping demands become one read plus
pushes, and bytes nobody demands are never read (the single-pull invariant).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

from mooncake_rl.plan.demand import Demand


@dataclass(frozen=True, order=True)
class Consumer:
    worker: str
    region: str
    dst_offset: int


@dataclass(frozen=True)
class SourceRange:
    obj: str
    start: int
    length: int
    consumers: tuple[Consumer, ...]

    def piece(self, start: int, length: int) -> SourceRange:
        shift = start - self.start
        return SourceRange(
            self.obj,
            start,
            length,
            tuple(Consumer(c.worker, c.region, c.dst_offset + shift) for c in self.consumers),
        )


def merge_demands(demands: Iterable[Demand]) -> list[SourceRange]:
    by_object: dict[str, list[Demand]] = defaultdict(list)
    for demand in demands:
        by_object[demand.obj].append(demand)
    ranges: list[SourceRange] = []
    for obj in sorted(by_object):
        items = by_object[obj]
        cuts = sorted({d.src_offset for d in items} | {d.src_offset + d.length for d in items})
        items.sort(key=lambda d: (d.src_offset, d.worker, d.region, d.dst_offset))
        active: list[Demand] = []
        cursor = 0
        for begin, end in pairwise(cuts):
            while cursor < len(items) and items[cursor].src_offset <= begin:
                active.append(items[cursor])
                cursor += 1
            active = [d for d in active if d.src_offset + d.length > begin]
            if not active:
                continue
            consumers = tuple(
                sorted(
                    Consumer(d.worker, d.region, d.dst_offset + begin - d.src_offset)
                    for d in active
                )
            )
            ranges.append(SourceRange(obj, begin, end - begin, consumers))
    return ranges


def unique_bytes(ranges: Iterable[SourceRange]) -> int:
    return sum(r.length for r in ranges)
