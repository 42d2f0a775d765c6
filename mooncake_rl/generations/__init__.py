"""Generations: immutable, fully written policies, announced atomically and kept in the Store.

A generation is written under fresh deterministic keys (Mooncake silently ignores a put to an
existing key), described by a ``mooncake.reshard`` ``WeightManifest``, and becomes visible
only when the model's active-generation record flips to it.
"""

from mooncake_rl.generations.assignment import PublisherLoads, TrainerTopology, assign_publishers
from mooncake_rl.generations.catalog import TensorSpec, build_manifest
from mooncake_rl.generations.publisher import (
    GenerationPublisher,
    PublishReport,
    finalize_generation,
)
from mooncake_rl.generations.registry import (
    ActiveRecord,
    GenerationRegistry,
    active_generation,
    load_manifest,
)

__all__ = [
    "ActiveRecord",
    "GenerationPublisher",
    "GenerationRegistry",
    "PublishReport",
    "PublisherLoads",
    "TensorSpec",
    "TrainerTopology",
    "active_generation",
    "assign_publishers",
    "build_manifest",
    "finalize_generation",
    "load_manifest",
]
