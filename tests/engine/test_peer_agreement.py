"""An apply body names each peer a stage pushes to with only the regions it pushes into
(``stage_peers``); the worker checks that against the peer's advertisement in the Store
(``disagreement``): a body that moves, invents or leaves out a pushed region is refused."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from engine_ext.admission import disagreement

NAMES = st.sampled_from([f"layers.{i}.w" for i in range(6)] + ["staging"])


def advert() -> dict[str, Any]:
    return {
        "worker_id": "e0/tp1",
        "node": "n0",
        "endpoint": "127.0.0.1:7000",
        "regions": {
            **{f"layers.{i}.w": {"base": 4096 * i, "size": 64} for i in range(6)},
            "staging": {"base": 1 << 20, "size": 1 << 16},
        },
    }


@given(st.sets(NAMES, min_size=1), st.sets(NAMES))
def test_a_body_naming_the_pushed_regions_as_advertised_agrees(
    pushed: set[str], extra: set[str]
) -> None:
    full = advert()
    named = pushed | extra
    body = {**full, "regions": {n: full["regions"][n] for n in named}}
    assert disagreement(full, body, pushed) == []


@given(st.sets(NAMES, min_size=1), NAMES, st.sampled_from(["moved", "missing"]))
def test_a_pushed_region_moved_or_left_out_is_named(
    pushed: set[str], region: str, how: str
) -> None:
    full = advert()
    pushed = pushed | {region}
    regions = {n: dict(full["regions"][n]) for n in pushed}
    if how == "moved":
        regions[region]["base"] += 64
    else:
        del regions[region]
    assert disagreement(full, {**full, "regions": regions}, pushed) == [f"regions.{region}"]


def test_other_fields_and_invented_regions_are_named() -> None:
    full = advert()
    body = {
        **full,
        "endpoint": "127.0.0.1:1",
        "regions": {"staging": full["regions"]["staging"], "nowhere": {"base": 0, "size": 8}},
    }
    assert disagreement(full, body, {"staging"}) == ["endpoint", "regions.nowhere"]
