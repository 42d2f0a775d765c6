"""Planning parameters: chunking, batching and alignment knobs (part of the cache key)."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_rl.errors import InvariantViolation


@dataclass(frozen=True)
class PlanParams:
    """Knobs of chunking, batching and alignment (part of the cache key)."""

    batch_bytes: int = 256 << 20
    balance_slack: float = 0.02
    min_chunk_bytes: int = 4 << 20
    align: int = 64

    def __post_init__(self) -> None:
        for name in ("batch_bytes", "min_chunk_bytes", "align"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise InvariantViolation(f"{name} must be a positive int, got {value!r}")
        if not (isinstance(self.balance_slack, float) and 0 < self.balance_slack <= 1):
            raise InvariantViolation(f"balance_slack must be in (0, 1], got {self.balance_slack}")
