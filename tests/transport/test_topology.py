"""Classification of target engines into legs: the mode matrix, strict rejection, the
uniformity guard and the mixed-transport assertion. Pure: no engine, no Store."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from mooncake_rl.errors import ConfigurationError, InvariantViolation
from mooncake_rl.transport import (
    Classification,
    MixedTransportInvalid,
    TopologyError,
    TransportMode,
    classify,
    require_mixed,
    require_mixed_ran,
)

STORE = TransportMode.STORE
BROADCAST = TransportMode.BROADCAST
CPU = TransportMode.CPU_SERIALIZE
AUTO = TransportMode.AUTO

TRAIN = ("g0", "g1", "g2", "g3")
A, B, C, D = "http://a:30000", "http://b:30000", "http://c:30000", "http://d:30000"
ENGINES: dict[str, Sequence[str] | None] = {
    A: ("g0", "g1"),  # colocated with the train pool
    B: ("g4", "g5"),  # disjoint
    C: ("g6", "g7"),  # disjoint
    D: ("g3", "g8"),  # straddles: one GPU shared
}


# -- the mode matrix ---------------------------------------------------------------------


def test_store_needs_no_topology() -> None:
    result = classify(STORE, [A, B], {}, None)
    assert result == Classification(STORE, {A: STORE, B: STORE})
    assert (result.broadcast, result.cpu, result.per_engine, result.mixed) == ((), (), 0, False)


def test_auto_splits_on_overlap_with_the_train_pool() -> None:
    result = classify(AUTO, [A, B, C, D], ENGINES, TRAIN)
    assert dict(result.legs) == {A: CPU, B: BROADCAST, C: BROADCAST, D: CPU}
    assert result.broadcast == (B, C)
    assert result.cpu == (A, D)
    assert result.per_engine == 2
    assert result.mixed


def test_legs_follow_target_order() -> None:
    result = classify(AUTO, [C, D, B, A], ENGINES, TRAIN)
    assert list(result.legs) == [C, D, B, A]
    assert (result.broadcast, result.cpu) == ((C, B), (D, A))


def test_strict_broadcast_names_every_colocated_engine_and_its_gpus() -> None:
    with pytest.raises(TopologyError) as raised:
        classify(BROADCAST, [A, B, D], ENGINES, TRAIN)
    message = str(raised.value)
    assert f"{A} shares g0, g1; {D} shares g3" in message
    assert "Nothing was drained" in message
    assert "--transport auto" in message
    assert B not in message


def test_strict_broadcast_to_disjoint_targets_succeeds() -> None:
    """Targeting a subset that avoids the colocated engines is the strict mode's way out."""
    result = classify(BROADCAST, [C, B], ENGINES, TRAIN)
    assert dict(result.legs) == {C: BROADCAST, B: BROADCAST}
    assert (result.broadcast, result.cpu, result.per_engine) == ((C, B), (), 2)


def test_cpu_serialize_sends_every_target_cpu_buckets() -> None:
    result = classify(CPU, [A, B], ENGINES, TRAIN)
    assert dict(result.legs) == {A: CPU, B: CPU}
    assert (result.broadcast, result.cpu, result.per_engine) == ((), (A, B), 0)


def test_per_engine_gpu_slices_decide_each_engine_alone() -> None:
    """Engine A on g0,g1 sits inside the train pool g0..g3; B on g4,g5 beside it."""
    result = classify(AUTO, [A, B], {A: ["g0", "g1"], B: ["g4", "g5"]}, ["g0", "g1", "g2", "g3"])
    assert dict(result.legs) == {A: CPU, B: BROADCAST}
    assert result.per_engine == 2


@pytest.mark.parametrize("mode", list(TransportMode))
def test_no_targets_is_nothing_to_do(mode: TransportMode) -> None:
    result = classify(mode, [], {}, None)
    assert result == Classification(mode, {})
    assert not result.mixed


@pytest.mark.parametrize("mode", [BROADCAST, CPU, AUTO])
@pytest.mark.parametrize("train", [None, [], ()])
def test_non_store_modes_refuse_without_the_train_pool(
    mode: TransportMode, train: Sequence[str] | None
) -> None:
    with pytest.raises(TopologyError) as raised:
        classify(mode, [B], ENGINES, train)
    assert str(raised.value) == (
        f"transport {mode} needs the train pool's GPU ids: pass --train-gpus / "
        "MOONCAKE_RL_TRAIN_GPUS, or the bridge reports them"
    )


@pytest.mark.parametrize("mode", [BROADCAST, CPU, AUTO])
@pytest.mark.parametrize("declared", [{}, {B: None}, {B: ()}, {B: []}])
def test_engine_outside_the_declared_pool_is_refused(
    mode: TransportMode, declared: Mapping[str, Sequence[str] | None]
) -> None:
    with pytest.raises(TopologyError) as raised:
        classify(mode, [A, B], {A: ENGINES[A], **declared}, TRAIN)
    message = str(raised.value)
    assert f"but {B} reported none (an engine outside the declared pool)" in message
    assert "set MOONCAKE_RL_GPU_IDS" in message
    assert "run it on CUDA, which reports GPU UUIDs" in message
    assert isinstance(raised.value, ConfigurationError)


def test_gpu_shared_by_two_engines_is_refused() -> None:
    with pytest.raises(TopologyError) as raised:
        classify(AUTO, [B, C], {B: ["g4", "g5"], C: ["g5", "g6"]}, TRAIN)
    assert f"g5 by {B}, {C}" in str(raised.value)
    assert "one physical GPU cannot be two ranks" in str(raised.value)


def test_gpu_listed_twice_by_one_engine_is_refused() -> None:
    with pytest.raises(TopologyError, match=f"g4 by {B}, {B}"):
        classify(BROADCAST, [B], {B: ["g4", "g4"]}, TRAIN)


def test_engines_that_are_not_targets_are_ignored() -> None:
    """A non-target's declaration (even a clashing one) does not affect this update."""
    result = classify(AUTO, [B], {B: ["g4"], C: ["g4"], A: None}, TRAIN)
    assert dict(result.legs) == {B: BROADCAST}


@pytest.mark.parametrize(("engines", "train"), [({B: ["g4"]}, "g0,g1"), ({B: "g4,g5"}, ["g0"])])
def test_unsplit_gpu_strings_are_refused(
    engines: Mapping[str, Sequence[str]], train: Sequence[str]
) -> None:
    """A string is a sequence of one-letter ids: it must go through parse_gpu_ids first."""
    with pytest.raises(InvariantViolation, match="GPU ids must be split"):
        classify(AUTO, [B], engines, train)


def test_a_target_listed_twice_is_refused() -> None:
    with pytest.raises(TopologyError, match=f"listed more than once: {B}"):
        classify(STORE, [B, A, B], {}, None)


# -- the uniformity guard ----------------------------------------------------------------


def test_broadcast_engines_of_different_sizes_are_refused() -> None:
    with pytest.raises(TopologyError) as raised:
        classify(BROADCAST, [B, C], {B: ["g4"], C: ["g6", "g7"]}, TRAIN)
    message = str(raised.value)
    assert f"{B} has 1, {C} has 2" in message
    assert "heterogeneous broadcast sets are out of scope" in message


def test_auto_guard_counts_only_broadcast_engines() -> None:
    """A colocated TP2 engine beside TP1 disjoint ones: its CPU leg has no rank count."""
    result = classify(AUTO, [A, B, C], {A: ["g0", "g1"], B: ["g4"], C: ["g6"]}, TRAIN)
    assert (result.broadcast, result.cpu, result.per_engine) == ((B, C), (A,), 1)


def test_auto_guard_refuses_uneven_disjoint_engines() -> None:
    with pytest.raises(TopologyError, match=f"{B} has 1, {C} has 2"):
        classify(AUTO, [A, B, C], {A: ["g0"], B: ["g4"], C: ["g6", "g7"]}, TRAIN)


# -- invariants over random topologies ---------------------------------------------------

GPUS = [f"g{i}" for i in range(12)]


@st.composite
def topologies(draw: st.DrawFn) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """Targets with disjoint GPU slices of 1-2 GPUs, and a non-empty train pool."""
    pool = draw(st.permutations(GPUS))
    sizes = draw(st.lists(st.integers(1, 2), min_size=0, max_size=5))
    engines: dict[str, list[str]] = {}
    used = 0
    for i, size in enumerate(sizes):
        engines[f"http://e{i}"] = list(pool[used : used + size])
        used += size
    train = draw(st.lists(st.sampled_from(GPUS), min_size=1, max_size=6))
    targets = draw(st.permutations(list(engines)))
    return list(targets), engines, train


def overlaps(gpus: Sequence[str], train: Sequence[str]) -> bool:
    return bool(set(gpus) & set(train))


@hypothesis_settings(max_examples=200, deadline=None)
@given(topologies(), st.sampled_from(list(TransportMode)))
def test_classification_invariants(
    topology: tuple[list[str], dict[str, list[str]], list[str]], mode: TransportMode
) -> None:
    targets, engines, train = topology
    broadcast_sizes = {
        len(engines[url])
        for url in targets
        if mode == BROADCAST or (mode == AUTO and not overlaps(engines[url], train))
    }
    strict_overlap = mode == BROADCAST and any(overlaps(engines[u], train) for u in targets)
    try:
        result = classify(mode, targets, engines, train)
    except TopologyError as error:
        # Refused iff strict mode meets a colocated target, or broadcast sizes are uneven.
        assert strict_overlap or len(broadcast_sizes) > 1, error
        return
    assert not strict_overlap
    assert len(broadcast_sizes) <= 1
    assert list(result.legs) == targets  # every target exactly one leg, in order
    assert set(result.broadcast) | set(result.cpu) <= set(targets)
    assert not set(result.broadcast) & set(result.cpu)
    for url in targets:
        expected = {
            STORE: STORE,
            BROADCAST: BROADCAST,
            CPU: CPU,
            AUTO: CPU if overlaps(engines[url], train) else BROADCAST,
        }[mode]
        assert result.legs[url] == expected
    assert result.per_engine == (next(iter(broadcast_sizes)) if result.broadcast else 0)
    assert result.mixed == (bool(result.broadcast) and bool(result.cpu))


# -- the value's own checks --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "auto", "legs": {}},
        {"mode": BROADCAST, "legs": {A: CPU}, "cpu": (A,)},
        {"mode": AUTO, "legs": {A: STORE}},
        {"mode": AUTO, "legs": {A: BROADCAST}, "per_engine": 1},
        {"mode": AUTO, "legs": {A: BROADCAST, B: BROADCAST}, "broadcast": (B, A), "per_engine": 1},
        {"mode": AUTO, "legs": {A: CPU}, "cpu": (A,), "per_engine": 1},
        {"mode": AUTO, "legs": {A: BROADCAST}, "broadcast": (A,)},
    ],
)
def test_inconsistent_classifications_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvariantViolation):
        Classification(**kwargs)  # type: ignore[arg-type]


def test_legs_cannot_be_changed_after_classification() -> None:
    result = classify(AUTO, [A, B], ENGINES, TRAIN)
    with pytest.raises(TypeError):
        result.legs[A] = BROADCAST  # type: ignore[index]


# -- the mixed-transport assertion -------------------------------------------------------


def test_mixed_auto_update_passes() -> None:
    result = classify(AUTO, [A, B], ENGINES, TRAIN)
    require_mixed(result)
    require_mixed_ran({BROADCAST, CPU})
    require_mixed_ran([CPU, BROADCAST, BROADCAST])


@pytest.mark.parametrize(
    ("targets", "missing"),
    [
        ([B, C], "a cpu_serialize leg (an engine sharing a GPU with the train pool)"),
        ([A, D], "a broadcast leg (an engine disjoint from the train pool)"),
    ],
)
def test_auto_update_with_one_leg_is_invalid(targets: list[str], missing: str) -> None:
    with pytest.raises(MixedTransportInvalid) as raised:
        require_mixed(classify(AUTO, targets, ENGINES, TRAIN))
    assert str(raised.value) == (
        f"MOONCAKE_RL_ASSERT_MIXED_TRANSPORT is set but the classified update lacks {missing}: "
        "the run is declared INVALID. Place engines on both sides of the train pool, or "
        "unset the assertion"
    )


def test_empty_auto_update_lacks_both_legs() -> None:
    with pytest.raises(MixedTransportInvalid, match=r"lacks a broadcast leg .* and a cpu_ser"):
        require_mixed(classify(AUTO, [], {}, None))


@pytest.mark.parametrize("mode", [STORE, BROADCAST, CPU])
def test_non_auto_update_is_invalid_under_the_assertion(mode: TransportMode) -> None:
    with pytest.raises(MixedTransportInvalid, match=f"runs transport {mode}, not auto"):
        require_mixed(classify(mode, [B], ENGINES, TRAIN))


@pytest.mark.parametrize(
    ("completed", "missing"),
    [({BROADCAST}, "cpu_serialize"), ({CPU, STORE}, "broadcast"), (set(), "broadcast")],
)
def test_completed_legs_must_include_both(completed: set[TransportMode], missing: str) -> None:
    with pytest.raises(MixedTransportInvalid) as raised:
        require_mixed_ran(completed)
    message = str(raised.value)
    assert f"the completed update lacks a {missing} leg" in message
    assert "declared INVALID" in message
