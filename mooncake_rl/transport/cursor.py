"""The broadcast group's rank cursor: which ranks each engine's GPUs take.

The sender (the train pool's rank 0) is rank 0. Engines follow in broadcast-set order, each
taking ``per_engine`` consecutive ranks: SGLang's ``init_weights_update_group`` joins
engine TP rank ``r`` as ``rank_offset + r``, so one offset per engine places all of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.transport.topology import TopologyError


@dataclass(frozen=True)
class GroupLayout:
    """World size and each engine's rank offset (its TP rank 0), in broadcast-set order."""

    world_size: int
    per_engine: int
    offsets: Mapping[str, int]

    def __post_init__(self) -> None:
        offsets = MappingProxyType(dict(self.offsets))
        object.__setattr__(self, "offsets", offsets)
        if type(self.per_engine) is not int or self.per_engine < 1 or not offsets:
            raise InvariantViolation(
                f"a broadcast group needs engines of >= 1 rank each, got per_engine="
                f"{self.per_engine!r} for {len(offsets)} engines"
            )
        expected = [1 + i * self.per_engine for i in range(len(offsets))]
        if list(offsets.values()) != expected:
            raise InvariantViolation(
                f"rank offsets {dict(offsets)} must be {expected} in order (rank 0 sends)"
            )
        if self.world_size != 1 + self.per_engine * len(offsets):
            raise InvariantViolation(
                f"world_size {self.world_size} must be 1 + {self.per_engine} x {len(offsets)}"
            )


def broadcast_group(
    broadcast_set: Sequence[str], per_engine: int, targets: Sequence[str]
) -> GroupLayout:
    """Lay out the group for ``broadcast_set`` (a subset of ``targets``, in its own order)."""
    engines = tuple(broadcast_set)
    if not engines:
        raise TopologyError(
            "no engine to broadcast to: the broadcast set is empty (classify assigns "
            "broadcast legs; skip the group when it assigns none)"
        )
    if type(per_engine) is not int or per_engine < 1:
        raise TopologyError(
            f"per_engine must be a GPU count >= 1, got {per_engine!r} (classify derives it)"
        )
    repeated = sorted(url for url, count in Counter(engines).items() if count > 1)
    if repeated:
        raise TopologyError(
            f"broadcast set lists engines more than once: {', '.join(repeated)}; one "
            "engine takes one block of ranks"
        )
    known = set(targets)
    outside = [url for url in engines if url not in known]
    if outside:
        raise TopologyError(
            f"broadcast set names engines that are not targets of this update: "
            f"{', '.join(outside)}; broadcast only to classified targets"
        )
    offsets = {url: 1 + i * per_engine for i, url in enumerate(engines)}
    return GroupLayout(1 + per_engine * len(engines), per_engine, offsets)
