"""Which leg each target engine's update takes, decided from declared GPU ids.

Classification is pure and runs before any engine is drained, so a topology that cannot
work is refused with nothing touched. The rule behind it: NCCL cannot form a group that
holds one physical GPU twice, and the broadcast group's rank 0 sits on a train GPU. An
engine sharing a GPU with the train pool therefore cannot join the group: ``auto`` sends it
CPU-serialized buckets instead, strict ``broadcast`` refuses the whole update.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from mooncake_rl.errors import ConfigurationError, InvariantViolation, MooncakeRLError
from mooncake_rl.transport.modes import TransportMode

BROADCAST = TransportMode.BROADCAST
CPU_SERIALIZE = TransportMode.CPU_SERIALIZE
_MODE_LEGS: dict[TransportMode, frozenset[TransportMode]] = {
    TransportMode.STORE: frozenset({TransportMode.STORE}),
    BROADCAST: frozenset({BROADCAST}),
    CPU_SERIALIZE: frozenset({CPU_SERIALIZE}),
    TransportMode.AUTO: frozenset({BROADCAST, CPU_SERIALIZE}),
}
"""The legs each mode may assign (``auto`` is never a leg itself)."""


class TopologyError(ConfigurationError):
    """Declared GPUs that no transport plan can honour: missing, shared, or uneven."""


class MixedTransportInvalid(MooncakeRLError):
    """``MOONCAKE_RL_ASSERT_MIXED_TRANSPORT`` is set and an update lacks one of its two legs."""


@dataclass(frozen=True)
class Classification:
    """Every target's leg, in target order, and the broadcast group's per-engine rank count."""

    mode: TransportMode
    legs: Mapping[str, TransportMode]
    broadcast: tuple[str, ...] = ()
    cpu: tuple[str, ...] = ()
    per_engine: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.mode, TransportMode):
            raise InvariantViolation(
                f"mode must be a TransportMode (resolve_mode makes one), got {self.mode!r}"
            )
        legs = MappingProxyType(dict(self.legs))
        object.__setattr__(self, "legs", legs)
        wrong = {url: leg for url, leg in legs.items() if leg not in _MODE_LEGS[self.mode]}
        if wrong:
            raise InvariantViolation(f"mode {self.mode} cannot assign legs {wrong}")
        for leg, engines in ((BROADCAST, self.broadcast), (CPU_SERIALIZE, self.cpu)):
            expected = tuple(url for url, each in legs.items() if each == leg)
            if tuple(engines) != expected:
                raise InvariantViolation(
                    f"{leg} engines {engines} disagree with the legs (expected {expected})"
                )
        if type(self.per_engine) is not int or (self.per_engine >= 1) != bool(self.broadcast):
            raise InvariantViolation(
                f"per_engine {self.per_engine!r} must be >= 1 exactly when engines broadcast"
            )

    @property
    def mixed(self) -> bool:
        """Both legs present: some engines broadcast, others receive CPU-serialized buckets."""
        return bool(self.broadcast) and bool(self.cpu)


def classify(
    mode: TransportMode,
    targets: Sequence[str],
    engine_gpus: Mapping[str, Sequence[str] | None],
    train_gpus: Iterable[str] | None,
) -> Classification:
    """Assign each target (an engine URL) its leg under ``mode``.

    ``engine_gpus`` maps engine URLs to their physical GPU ids in rank order (engines that
    are not targets are ignored); ``train_gpus`` is the train pool. The Store path needs
    neither. Raises :class:`TopologyError` for what no leg assignment can fix.
    """
    targets = tuple(targets)
    repeated = sorted(url for url, count in Counter(targets).items() if count > 1)
    if repeated:
        raise TopologyError(
            f"target engines listed more than once: {', '.join(repeated)}; list each once"
        )
    if not targets or mode == TransportMode.STORE:
        return Classification(mode, dict.fromkeys(targets, mode))
    declared = (train_gpus, *(engine_gpus.get(url) for url in targets))
    unparsed = [gpus for gpus in declared if isinstance(gpus, str)]
    if unparsed:
        raise InvariantViolation(
            f"GPU ids must be split (parse_gpu_ids), got the string {unparsed[0]!r}"
        )
    train = frozenset(train_gpus or ())
    if not train:
        raise TopologyError(
            f"transport {mode} needs the train pool's GPU ids: pass --train-gpus / "
            "MOONCAKE_RL_TRAIN_GPUS, or the bridge reports them"
        )
    gpus = _declared(mode, targets, engine_gpus)
    shared = {url: tuple(g for g in gpus[url] if g in train) for url in targets}
    colocated = {url: ids for url, ids in shared.items() if ids}
    if mode == BROADCAST and colocated:
        listed = "; ".join(f"{url} shares {', '.join(ids)}" for url, ids in colocated.items())
        raise TopologyError(
            f"transport broadcast cannot reach engines that share GPUs with the train pool "
            f"(one physical GPU cannot sit twice in one NCCL group): {listed}. Nothing was "
            "drained. Use --transport auto (colocated engines then receive CPU-serialized "
            "buckets), or target only engines disjoint from the train pool"
        )
    if mode == CPU_SERIALIZE:
        legs = dict.fromkeys(targets, CPU_SERIALIZE)
    else:
        legs = {url: CPU_SERIALIZE if url in colocated else BROADCAST for url in targets}
    broadcast = tuple(url for url in targets if legs[url] == BROADCAST)
    cpu = tuple(url for url in targets if legs[url] == CPU_SERIALIZE)
    return Classification(mode, legs, broadcast, cpu, _uniform(broadcast, gpus))


def _declared(
    mode: TransportMode, targets: tuple[str, ...], engine_gpus: Mapping[str, Sequence[str] | None]
) -> dict[str, tuple[str, ...]]:
    """Each target's GPUs, refusing engines that declare none and GPUs declared twice."""
    missing = [url for url in targets if not engine_gpus.get(url)]
    if missing:
        raise TopologyError(
            f"transport {mode} needs every target's GPU ids, but {', '.join(missing)} "
            "reported none (an engine outside the declared pool): set MOONCAKE_RL_GPU_IDS on "
            "each (one id per rank, in rank order), or run it on CUDA, which reports GPU UUIDs"
        )
    gpus = {url: tuple(engine_gpus[url] or ()) for url in targets}
    holders: dict[str, list[str]] = {}
    for url, ids in gpus.items():
        for gpu in ids:
            holders.setdefault(gpu, []).append(url)
    doubled = {gpu: urls for gpu, urls in holders.items() if len(urls) > 1}
    if doubled:
        listed = "; ".join(f"{gpu} by {', '.join(urls)}" for gpu, urls in doubled.items())
        raise TopologyError(
            f"GPUs declared more than once (one physical GPU cannot be two ranks): {listed}. "
            "Fix the engines' MOONCAKE_RL_GPU_IDS, or target only one engine per GPU"
        )
    return gpus


def _uniform(broadcast: tuple[str, ...], gpus: Mapping[str, tuple[str, ...]]) -> int:
    """The GPU count every broadcast engine shares (0 without any): the rank cursor gives
    each engine the same number of ranks."""
    counts = {url: len(gpus[url]) for url in broadcast}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{url} has {count}" for url, count in counts.items())
        raise TopologyError(
            f"broadcast engines differ in GPU count ({listed}): heterogeneous broadcast sets "
            "are out of scope. Target broadcast engines of one tensor-parallel size per update"
        )
    return next(iter(counts.values()), 0)


def require_mixed(classification: Classification) -> None:
    """The mixed-transport assertion, checked before the update: ``auto`` with both legs."""
    if classification.mode != TransportMode.AUTO:
        raise MixedTransportInvalid(
            f"MOONCAKE_RL_ASSERT_MIXED_TRANSPORT is set but the update runs transport "
            f"{classification.mode}, not auto: the run is declared INVALID. Set "
            "MOONCAKE_RL_TRANSPORT=auto, or unset the assertion"
        )
    _require_both({*classification.legs.values()}, "the classified update")


def require_mixed_ran(completed: Collection[TransportMode]) -> None:
    """The mixed-transport assertion, checked after the update on the legs that completed."""
    _require_both(completed, "the completed update")


def _require_both(legs: Collection[TransportMode], what: str) -> None:
    missing = [leg for leg in (BROADCAST, CPU_SERIALIZE) if leg not in legs]
    if missing:
        reasons = {
            BROADCAST: "a broadcast leg (an engine disjoint from the train pool)",
            CPU_SERIALIZE: "a cpu_serialize leg (an engine sharing a GPU with the train pool)",
        }
        raise MixedTransportInvalid(
            f"MOONCAKE_RL_ASSERT_MIXED_TRANSPORT is set but {what} lacks "
            f"{' and '.join(reasons[leg] for leg in missing)}: the run is declared INVALID. "
            "Place engines on both sides of the train pool, or unset the assertion"
        )
