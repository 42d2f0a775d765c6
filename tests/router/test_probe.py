"""The pure checks before any engine is touched: rolling waves and plugin versions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.protocol import PROTOCOL_VERSION
from mooncake_rl.router import VersionSkew, require_compatible, waves

URLS = st.lists(st.from_regex(r"http://e[0-9]{1,3}:8000", fullmatch=True), unique=True)


@given(URLS.filter(bool), st.data())
def test_waves_take_every_engine_once_in_order_and_at_most_k_at_a_time(
    urls: list[str], data: st.DataObject
) -> None:
    k = data.draw(st.integers(1, len(urls)))
    groups = waves(urls, k)
    assert [url for group in groups for url in group] == urls
    assert all(1 <= len(group) <= k for group in groups)
    assert len(groups) == -(-len(urls) // k)  # the fewest waves K allows


@given(URLS.filter(bool))
def test_without_max_unavailable_every_engine_goes_at_once(urls: list[str]) -> None:
    assert waves(urls, None) == [urls]


@pytest.mark.parametrize("k", [0, -1, 3])
def test_max_unavailable_outside_the_engines_is_refused(k: int) -> None:
    with pytest.raises(ConfigurationError, match=f"--max-unavailable must lie in 1..2.*got {k}"):
        waves(["http://a:1", "http://b:1"], k)


def test_engines_of_this_protocol_pass() -> None:
    require_compatible({"http://a:1": {"protocol": PROTOCOL_VERSION, "plugin_version": "0.1.0"}})


def test_skew_names_every_engine_and_the_fix() -> None:
    with pytest.raises(VersionSkew) as skew:
        require_compatible(
            {
                "http://new:1": {"protocol": PROTOCOL_VERSION + 1, "plugin_version": "9.0.0"},
                "http://old:1": {"generation": 3},  # before the protocol field existed
                "http://none:1": None,  # no /mooncake routes
                "http://ok:1": {"protocol": PROTOCOL_VERSION},
            }
        )
    message = str(skew.value)
    assert f"http://new:1 speaks protocol {PROTOCOL_VERSION + 1} (plugin 9.0.0)" in message
    assert "http://old:1 speaks protocol None (plugin unknown)" in message
    assert "http://none:1 has no /mooncake routes" in message
    assert "http://ok:1" not in message
    assert "no engine was touched" in message and "same mooncake-rl version" in message
