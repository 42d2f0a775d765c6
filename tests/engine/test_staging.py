"""Where a worker stages an update (engine_ext.staging): the choice, exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine_ext.admission import RequestRefused
from engine_ext.staging import DEVICE_HEADROOM, StagingPlace, choose_staging

sizes = st.integers(0, 1 << 40)
budgets = st.none() | st.integers(1, 1 << 40)


@given(staged=sizes, batch=sizes, budget=budgets, free=st.integers(0, 1 << 40))
def test_a_cuda_engine_stages_on_the_device_exactly_when_it_fits(
    staged: int, batch: int, budget: int | None, free: int
) -> None:
    cuda = torch.device("cuda", 0)
    if budget is not None and budget < batch:
        with pytest.raises(RequestRefused) as refused:
            choose_staging(staged, batch, cuda, budget, free)
        assert (refused.value.status, refused.value.code) == (409, "staging_budget")
        assert "MOONCAKE_RL_STAGING_BUDGET_BYTES" in refused.value.detail
        return
    place = choose_staging(staged, batch, cuda, budget, free)
    fits = staged <= int(free * DEVICE_HEADROOM) and (budget is None or staged <= budget)
    assert place == StagingPlace(
        "device" if fits else "host",
        "cuda:0" if fits else "cpu",
        staged,
        budget,
        free,
    )
    assert place.pinned is not fits  # host staging of a CUDA engine is pinned


@given(staged=sizes, batch=sizes, budget=budgets)
def test_a_cpu_engine_stages_in_host_memory_unpinned(
    staged: int, batch: int, budget: int | None
) -> None:
    if budget is not None and budget < batch:
        with pytest.raises(RequestRefused):
            choose_staging(staged, batch, torch.device("cpu"), budget, None)
        return
    place = choose_staging(staged, batch, torch.device("cpu"), budget, None)
    assert (place.where, place.device, place.pinned) == ("host", "cpu", False)
    assert place.to_json()["staged_bytes"] == staged


def test_an_inconsistent_place_is_refused() -> None:
    with pytest.raises(ValueError, match="host staging lives on the cpu"):
        StagingPlace("host", "cuda:0", 1, None, 10)
    with pytest.raises(ValueError, match="staged bytes"):
        StagingPlace("device", "cuda:0", -1, None, 10)
