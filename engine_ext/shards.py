"""What one worker holds of each checkpoint tensor, as boxes landing in named regions.

Engine adapters describe their parameters with :class:`ShardSpec` rows (checkpoint tensor
name, the box of it this worker holds, the destination region and byte offset there). The
coordinator turns them into ``mooncake.reshard`` placement parts; the engine lays out
regions so that a box lands contiguously at its offset (split dims are outer-most, or the
box fills the region).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mooncake_rl.errors import InvariantViolation


@dataclass(frozen=True)
class ShardSpec:
    tensor: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    region: str
    region_offset: int

    def __post_init__(self) -> None:
        if not (len(self.global_shape) == len(self.global_offset) == len(self.local_shape)):
            raise InvariantViolation(f"shard of {self.tensor} mixes ranks")
        for offset, extent, total in zip(
            self.global_offset, self.local_shape, self.global_shape, strict=True
        ):
            if offset < 0 or extent < 1 or offset + extent > total:
                raise InvariantViolation(f"shard of {self.tensor} lies outside {self.global_shape}")
        if self.region_offset < 0:
            raise InvariantViolation(f"shard of {self.tensor} has a negative region offset")

    def to_json(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "global_shape": list(self.global_shape),
            "global_offset": list(self.global_offset),
            "local_shape": list(self.local_shape),
            "region": self.region,
            "region_offset": self.region_offset,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ShardSpec:
        try:
            return cls(
                str(raw["tensor"]),
                tuple(int(v) for v in raw["global_shape"]),
                tuple(int(v) for v in raw["global_offset"]),
                tuple(int(v) for v in raw["local_shape"]),
                str(raw["region"]),
                int(raw["region_offset"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise InvariantViolation(f"malformed shard spec: {error}") from error
