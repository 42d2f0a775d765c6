"""Planning parameters: chunking, batching, alignment and pull knobs (part of the cache key)."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_rl.errors import InvariantViolation

PULLS = ("single", "node")


@dataclass(frozen=True)
class PlanParams:
    """Knobs of chunking, batching and alignment (part of the cache key).

    ``pull``: ``single`` reads each demanded byte from the Store once, fleet-wide, and
    pushes it on to every other node that consumes it (the default: the fewest bytes).
    ``node`` reads it once per consuming *node* and fans it out over the node's NVLink as
    each read lands. It exists for compat mode, where every GPU takes every full tensor:
    with a single pull the relays of a node can only forward what other nodes pushed to
    them after the barrier (stage 2, up to 0.82x the NIC time again), while a node's own
    reads fan out inside stage 1. The Store then serves the model once per rollout node,
    so choose it only where the trainers' NICs have that headroom
    (``docs/planning.md``, "Pull per node").
    """

    batch_bytes: int = 256 << 20
    balance_slack: float = 0.02
    min_chunk_bytes: int = 4 << 20
    align: int = 64
    pull: str = "single"

    def __post_init__(self) -> None:
        for name in ("batch_bytes", "min_chunk_bytes", "align"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise InvariantViolation(f"{name} must be a positive int, got {value!r}")
        if not (isinstance(self.balance_slack, float) and 0 < self.balance_slack <= 1):
            raise InvariantViolation(f"balance_slack must be in (0, 1], got {self.balance_slack}")
        if self.pull not in PULLS:
            raise InvariantViolation(
                f"pull must be one of {', '.join(PULLS)} (once fleet-wide, or once per node), "
                f"got {self.pull!r}"
            )
