"""A worker's landing: the post-landing check's reference, commit, and rebuild from the Store.

Once every stage of every engine ran, ``expect`` builds the check's reference from staging
on the stage thread while the engine still serves, refusing unless every staged byte that
lands was written in the session (:mod:`engine_ext.written`). Commit then lands staging
through the engine's own loading paths (full tensors in compat mode, a
:class:`~engine_ext.worker_base.DirectLanding` in direct mode), compares the live model
with the reference, tags the model with the record it now serves, drops the update and
moves the serving lease. A rebuild loads the Store's active generation the way a fresh
engine does and checks it the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine_ext.adapting import AdaptingWorker
from engine_ext.admission import RequestRefused
from engine_ext.delta import DeltaWorker
from engine_ext.loading import mark_served, served_record, store_weights
from engine_ext.placement import assemble_regions
from engine_ext.update_state import UpdateState
from engine_ext.worker_base import DirectLanding, LandingMismatch
from engine_ext.written import unwritten
from mooncake_rl.generations.catalog import ROLLOUT_DTYPES


class LandingWorker(DeltaWorker, AdaptingWorker):
    """The worker's ``expect``, ``commit`` and ``rebuild``."""

    def _require_landable(self, state: UpdateState, generation: int) -> None:
        """Refuse a check or commit of anything but the prepared generation, fully applied."""
        if state.generation != generation or not state.pending:
            raise RequestRefused(
                409,
                "generation_mismatch",
                f"commit of generation {generation}, prepared {state.generation}",
            )
        if state.ran != state.stages:
            raise RequestRefused(
                409,
                "stages_incomplete",
                f"{state.ran} of {state.stages} stages ran; apply the rest first",
            )

    def _expect(self, engine_id: str, generation: int) -> dict[str, Any]:
        """Start building the post-landing check's reference on the stage thread, while the
        engine serves; ``collect`` takes its reply. Commit then pauses only to land and
        compare. Only after every engine's last stage (the coordinator commits then) is
        staging final: peers push into it until their own last stage ends."""
        state = self._state(engine_id)
        self._require_landable(state, generation)
        if state.running is not None and not state.running.done():
            raise RequestRefused(
                409, "stage_running", "an apply stage still runs; collect it first"
            )
        state.running = state.stage_runner.submit(self._build_check, state)
        return {"started": "expect"}

    def _build_check(self, state: UpdateState) -> dict[str, Any]:
        if state.delta is not None:
            self._decode_delta(state)
        state.check = self._landing_check(state)
        return {"worker_id": state.apply.worker_id, "seconds": state.check.seconds}

    def _commit(self, engine_id: str, generation: int) -> dict[str, Any]:
        """Swap the staged generation into the live model through the engine's own paths,
        then compare the live model with the check's reference (built now if ``expect``
        did not run)."""
        state = self._state(engine_id)
        self._require_landable(state, generation)
        state.settle(keep=True)
        if state.adapter is not None:
            return self._commit_adapter(engine_id, state)
        # The reference and the comparison run on one thread (the stage thread): the check
        # compares GEMM outputs bit for bit, so nothing but the weights may differ.
        if state.check is None:
            state.stage_runner.submit(self._build_check, state).result()
        check = state.check
        assert check is not None
        started = time.perf_counter()
        delta = self._land_delta(state) if state.delta is not None else {}
        if state.mode == "compat":
            self.land_compat(staged_tensors(state.layout, state.buffers))
        else:
            staged = self.staged_parameters()
            self.land_direct(
                DirectLanding(
                    {n: t for n, t in staged.items() if n not in state.in_place},
                    staged_tensors(state.fallback, state.buffers),
                    frozenset(state.in_place),
                )
            )
        landed = time.perf_counter()
        compared = state.stage_runner.submit(self._compare, check).result()
        if compared["mismatched"]:
            raise LandingMismatch(
                f"generation {generation} did not land intact; the live model differs from a "
                f"fresh load in {compared['mismatched'][:5]}: never served, rebuild from the Store"
            )
        # What a receiver rebuilt on this engine (and its status) starts from.
        mark_served(self.model(), state.record)
        state.drop()
        state.end_lease((engine_id, generation))
        return {
            "seconds": time.perf_counter() - started,
            "land_seconds": landed - started,
            "verify": compared,
            **({"delta": delta} if delta else {}),
        }

    def _landing_check(self, state: UpdateState) -> LandingCheck:
        """What every live parameter must hold once the staged generation landed; refused
        unless every staged byte that lands was written in the session."""
        if state.mode == "direct":
            # Bytes received in place were checked against the generation's checksums as
            # they were read; no landing step ran on them to compare.
            expected = {
                n: t for n, t in self.staged_parameters().items() if n not in state.in_place
            }
            uncovered = sorted(
                r.name
                for r in self.regions()[0]
                if r.name not in expected and r.name not in state.in_place
            )
            self._require_written(state)
            return self._reference(expected, uncovered, set(state.in_place))
        self._require_written(state)
        regions, shards = self.regions()
        full = dict(staged_tensors(state.layout, state.buffers))
        return self._reference(*assemble_regions(regions, shards, full))

    def _require_written(self, state: UpdateState) -> None:
        """Refuse to land staging unless every byte that lands was written in the session
        (:mod:`engine_ext.written`)."""
        if state.canary is not None:
            left = unwritten(self._landed_spans(state), state.canary)
            if left:
                raise RequestRefused(
                    409,
                    "unwritten_staging",
                    f"{len(left)} staged tensors of generation {state.generation} hold bytes "
                    f"no read or push of session {state.session} wrote (e.g. {left[:3]}): the "
                    "plan does not deliver them; nothing landed, abort and update again with "
                    "a plan made by the coordinator",
                )

    def _landed_spans(self, state: UpdateState) -> dict[str, torch.Tensor]:
        """The staged bytes commit lands: each direct box in its parameter's region (not
        the padding no box covers, nor parameters received in place), each full tensor of
        the compat or fallback layout."""
        rows = [*state.layout, *state.fallback]
        spans = {
            f"{row['region']}:{name}": tensor
            for row, (name, tensor) in zip(rows, staged_tensors(rows, state.buffers), strict=True)
        }
        if state.mode == "direct":
            regions, boxes = self.regions()
            itemsize = {r.name: r.dtype.itemsize for r in regions}
            for box in boxes:
                region = state.buffers.get(box.region)
                if region is None or box.region in state.in_place:
                    continue
                end = box.region_offset + math.prod(box.local_shape) * itemsize[box.region]
                spans[f"{box.region}@{box.region_offset}"] = region[box.region_offset : end]
        return spans

    def _reference(
        self,
        expected: Mapping[str, torch.Tensor],
        uncovered: Sequence[str],
        in_place: Collection[str] | None = None,
    ) -> LandingCheck:
        started = time.perf_counter()
        reference = self.expect_live(expected, in_place or ())
        return LandingCheck(
            reference,
            frozenset(expected),
            tuple(uncovered),
            None if in_place is None else len(in_place),
            time.perf_counter() - started,
        )

    def _compare(self, check: LandingCheck) -> dict[str, Any]:
        """The live model against ``check``; ``reference_seconds`` went to building it."""
        started = time.perf_counter()
        compared = self.compare_live(check.reference)
        result = {
            # Of the expected tensors; a parameter with none is unchecked beside them.
            "checked": len(check.expected - set(compared.unchecked)),
            "unchecked": sorted({*check.uncovered, *compared.unchecked}),
            "mismatched": compared.mismatched,
            "seconds": time.perf_counter() - started,
            "reference_seconds": check.seconds,
        }
        return result if check.in_place is None else {**result, "in_place": check.in_place}

    def _rebuild(self, engine_id: str, model_name: str) -> dict[str, Any]:
        """Reload the Store's active generation into the live model, as a fresh engine
        loads it (``--load-format mooncake``): leased first, every byte checked against the
        generation's checksums, landed through the engine's own loading path.

        Drops any pending update first. Each TP rank reads the full tensors and the model's
        ``load_weights`` cuts its shards, as the loader does; the landing is then checked
        like a commit's (the tensors are kept until then: one model's worth of host memory,
        on a path taken only to recover). Raises if loading or the check fails: the engine
        stays broken and the receiver tries again.
        """
        started = time.perf_counter()
        if self._update is not None:
            self._update.drop()
            self._update.end_lease()
        full: dict[str, torch.Tensor] = {}
        with store_weights(model_name, engine_id) as (record, tensors):
            self.land_compat(_kept(tensors, full))
        regions, shards = self.regions()
        check = self._compare(self._reference(*assemble_regions(regions, shards, full)))
        if check["mismatched"]:
            raise LandingMismatch(
                f"the rebuild of generation {record.generation} did not land intact; the live "
                f"model differs from a fresh load in {check['mismatched'][:5]}"
            )
        served = served_record(record)
        mark_served(self.model(), served, model_name)
        return {
            "generation": served.generation,
            "fence": served.fence,
            "incarnation": served.incarnation,
            "model_name": model_name,
            "seconds": time.perf_counter() - started,
            "verify": check,
        }

    # -- staged views ---------------------------------------------------------------------
    def staged_parameters(self) -> dict[str, torch.Tensor]:
        """Direct mode: every directly received parameter's bytes, as its dtype and shape.

        Raises before anything is landed if a parameter was neither staged nor left to the
        fallback (the plan sends full tensors only to workers it leaves parameters to).
        """
        assert self._update is not None
        buffers = self._update.buffers
        specs = {r.name: r for r in self.regions()[0]}
        missing = sorted(set(specs) - set(buffers))
        if missing and not self._update.fallback:
            raise ValueError(f"direct commit lacks staged parameters: {missing[:3]}")
        return {n: buffers[n].view(s.dtype).view(s.shape) for n, s in specs.items() if n in buffers}


@dataclass(frozen=True)
class LandingCheck:
    """The post-landing check's reference
    (:meth:`~engine_ext.worker_base.WorkerBase.expect_live`), made from staging; ``seconds``
    went to making it."""

    reference: Any
    expected: frozenset[str]
    uncovered: tuple[str, ...]
    in_place: int | None
    seconds: float


def _kept(
    tensors: Iterator[tuple[str, torch.Tensor]], into: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors``, each also kept in ``into`` (for the check after landing)."""
    for name, tensor in tensors:
        into[name] = tensor
        yield name, tensor


def staged_tensors(
    layout: list[dict[str, Any]], buffers: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Compat mode: full checkpoint tensors as views into the staging region."""
    for entry in layout:
        buffer = buffers[entry["region"]]
        dtype = ROLLOUT_DTYPES[entry["dtype"]]
        nbytes = math.prod(entry["shape"]) * dtype.itemsize
        raw = buffer[entry["offset"] : entry["offset"] + nbytes]
        yield entry["name"], raw.view(dtype).view(entry["shape"])
