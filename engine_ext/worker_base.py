"""The engine-neutral base of an update worker: what an engine supplies, what every step shares.

An engine's worker (vLLM's, SGLang's) supplies its model, its tensor-parallel rank, a
describer of its receive regions and the checkpoint boxes landing in them, and its two
landing paths (full checkpoint tensors, or a :class:`DirectLanding`); it may narrow which
live parameters receive in place and how the landed model is compared with the generation.
The description is kept here, remade only when the parameters change, beside the worker's
pending update (:class:`~engine_ext.update_state.UpdateState`); the steps read both:
:mod:`engine_ext.preparing`, :mod:`engine_ext.applying` and :mod:`engine_ext.landing`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine_ext.placement import RegionSpec
from engine_ext.shards import ShardSpec
from engine_ext.update_state import UpdateState
from mooncake_rl.protocol import reported_placement
from mooncake_rl.store import StoreClient


class _Description:
    """A worker's regions and boxes as its describer found them, kept while the parameters
    are the same tensors of the same shapes and dtypes (``fingerprint``), and their served
    form with its placement digest, made once."""

    def __init__(self, fingerprint: tuple, specs: tuple[list[RegionSpec], list[ShardSpec]]) -> None:
        self.fingerprint = fingerprint
        self.specs = specs
        self._served: dict[str, Any] | None = None

    def served(self, tp_rank: int, tp_size: int) -> dict[str, Any]:
        """The planned fields (``protocol.PLANNED_FIELDS``) and their ``placement_digest``."""
        if self._served is None or (self._served["tp_rank"], self._served["tp_size"]) != (
            tp_rank,
            tp_size,
        ):
            regions, shards = self.specs
            self._served = reported_placement(
                {
                    "tp_rank": tp_rank,
                    "tp_size": tp_size,
                    "regions": {
                        r.name: {"bytes": r.nbytes, "dtype": str(r.dtype).removeprefix("torch.")}
                        for r in regions
                    },
                    "shards": [s.to_json() for s in shards],
                }
            )
        return self._served


def parameter_fingerprint(model: torch.nn.Module) -> tuple:
    """Which tensors the model's parameters are, with their shapes and dtypes: an entry per
    parameter (a fused 1T MoE has about a thousand), not per box (it describes ~140k)."""
    return tuple((n, id(p), p.shape, p.dtype) for n, p in model.named_parameters())


class WorkerBase(ABC):
    """What an engine's worker supplies (the abstract glue) and what every step shares: the
    kept description, the pending update, the device."""

    _update: UpdateState | None = None
    _description: _Description | None = None

    # -- engine glue ------------------------------------------------------------------
    @abstractmethod
    def model(self) -> torch.nn.Module: ...

    @abstractmethod
    def tp(self) -> tuple[int, int]:
        """(tensor-parallel rank, tensor-parallel size) of this worker."""

    @abstractmethod
    def describe_regions(self) -> tuple[list[RegionSpec], list[ShardSpec]]:
        """The engine's describer: receive regions and the checkpoint boxes landing in them."""

    def regions(self) -> tuple[list[RegionSpec], list[ShardSpec]]:
        """``describe_regions``, kept while the parameters stay the same tensors of the same
        shapes and dtypes. Every update asks several times (placement, prepare, the landing
        check), each call runs in the engine's own loop (on vLLM, between the steps of every
        request), and a 1T MoE's rank describes some 140k boxes."""
        return self._described().specs

    def _described(self) -> _Description:
        fingerprint = parameter_fingerprint(self.model())
        if self._description is None or self._description.fingerprint != fingerprint:
            self._description = _Description(fingerprint, self.describe_regions())
        return self._description

    @abstractmethod
    def land_compat(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load full checkpoint tensors into the live model (the engine's ``load_weights``)."""

    @abstractmethod
    def land_direct(self, landing: DirectLanding) -> None:
        """Load ``landing`` into the live model (see :class:`DirectLanding`)."""

    def in_place_parameters(self) -> dict[str, torch.Tensor]:
        """Live parameters that can be their own receive regions, by region name.

        The default takes every parameter whose live tensor has its stored shape and dtype
        (:func:`live_receivers`); engines exclude those their post-load processing changes.
        """
        return live_receivers(self.model(), self.regions()[0], self.device())

    def expect_live(
        self, expected: Mapping[str, torch.Tensor], received: Collection[str] = ()
    ) -> Any:
        """The reference :meth:`compare_live` takes: what the live model must hold once
        ``expected`` (model format, staged) landed; ``received``: parameters received in
        place, already checked against the generation's checksums as they were read.
        Built before the pause, while the engine serves, so the pause holds only the
        comparison. Engines that keep checkpoint layout live (SGLang) compare bytes: the
        reference is ``expected`` itself; engines that repack into kernel layouts override
        both with a fresh-load comparison."""
        return expected

    def compare_live(self, reference: Any) -> Comparison:
        """Which live parameters differ from the reference, and which it could not compare."""
        live = dict(self.model().named_parameters())
        return Comparison(
            [n for n, t in reference.items() if n in live and not same_bytes(live[n], t)],
            [n for n in reference if n not in live],
        )

    # -- shared by the steps ----------------------------------------------------------
    def _state(self, engine_id: str) -> UpdateState:
        if self._update is None:
            self._update = UpdateState(f"{engine_id}/tp{self.tp()[0]}")
        return self._update

    def store(self, engine_id: str) -> StoreClient:
        """This worker's Store client (opened on first use), for callers that check the
        Store before they build a request, without a second client per worker."""
        return self._state(engine_id).apply.store

    def device(self) -> torch.device:
        return next(self.model().parameters()).device


def live_receivers(
    model: torch.nn.Module,
    regions: Sequence[RegionSpec],
    device: torch.device,
    excluded: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Live parameters laid out exactly as their regions (stored shape and dtype, dense,
    on ``device``, sharing no bytes with another region), by region name."""
    live = dict(model.named_parameters())
    found: dict[str, torch.Tensor] = {}
    taken: set[int] = set()
    for region in regions:
        tensor = live.get(region.name)
        if (
            region.name in excluded
            or tensor is None
            or tuple(tensor.shape) != region.shape
            or tensor.dtype != region.dtype
            or tensor.device != device
            or not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() in taken
        ):
            continue
        taken.add(tensor.untyped_storage().data_ptr())
        found[region.name] = tensor.data
    return found


@dataclass(frozen=True)
class DirectLanding:
    """What a direct-mode commit lands: the staged parameters (model format, by parameter
    name), the full checkpoint tensors of the parameters discovery could not describe (the
    fallback), and the parameters received in place, which already hold their new bytes
    and are left as they are."""

    staged: Mapping[str, torch.Tensor]
    fallback: Iterator[tuple[str, torch.Tensor]]
    in_place: frozenset[str]


@dataclass(frozen=True)
class Comparison:
    """The live model against the generation: names that differ, names not comparable."""

    mismatched: list[str]
    unchecked: list[str]


class LandingMismatch(RuntimeError):
    """The live model does not hold the generation that commit landed."""


def same_bytes(live: torch.Tensor, expected: torch.Tensor) -> bool:
    """Exact equality in the live tensor's dtype (loaders cast the same way)."""
    return live.shape == expected.shape and torch.equal(live, expected.to(live.device, live.dtype))
