"""``mooncake-rl bench load``'s pure parts: the pause over streamed token times, the landing,
kept requests, the goals (exact cases and properties; no services)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.load import (
    EngineLanding,
    Sample,
    chunk_of,
    keep_goals,
    kept,
    landing_mark,
    landing_seconds,
    longest_gap_within,
    longest_stall,
    outcome_of,
)


def streamed(started: float, tokens: list[float], ended: float | None = None, **kw) -> Sample:
    end = tokens[-1] if ended is None else ended
    return Sample(started, end, kw.pop("outcome", "ok"), 200, tokens=tuple(tokens), **kw)


def test_the_pause_is_the_longest_gap_touching_the_update_counted_from_its_start() -> None:
    # tokens every 0.1 s, then held 1.0 s by the landing inside the update [2, 4]
    held = streamed(0.0, [1.0, 1.1, 2.5, 3.5, 3.6])
    assert longest_stall([held], 2.0, 4.0) == 1.0
    # a stall that began before the update counts from the update's start
    assert longest_stall([streamed(0.0, [1.0, 2.5, 2.6])], 2.2, 4.0) == pytest.approx(0.3)
    # one that lasts past the update's end counts in full
    late = streamed(0.0, [3.0, 5.5])
    assert longest_stall([late], 2.0, 4.0) == 2.5
    # gaps wholly before or after the update do not count
    assert longest_stall([streamed(0.0, [0.5, 1.5])], 2.0, 4.0) == 0.0
    assert longest_stall([streamed(4.5, [6.0])], 2.0, 4.0) == 0.0
    # time to first token counts (sent at 2.1, first token at 2.9)
    assert longest_stall([streamed(2.1, [2.9, 3.0])], 2.0, 4.0) == pytest.approx(0.8)
    # an aborted stream: the gap to its end counts; a failed request (no token) does not
    cut = streamed(1.9, [2.0, 2.1], ended=2.6, outcome="aborted")
    refused = Sample(2.0, 3.9, "failed", 503)
    assert longest_stall([cut, refused], 2.0, 4.0) == pytest.approx(0.5)
    assert longest_stall([held, late, cut], 2.0, 4.0) == 2.5


times = st.lists(st.floats(0, 100, allow_nan=False), min_size=2, max_size=12).map(sorted)


@given(times, st.floats(0, 100), st.floats(0, 50))
def test_the_pause_is_bounded_and_never_negative(events: list[float], start: float, span: float):
    sample = streamed(events[0], events[1:])
    end = start + span
    pause = longest_stall([sample], start, end)
    assert pause >= 0
    gaps = [b - a for a, b in itertools.pairwise(events)]
    assert pause <= max(gaps)  # never more than a whole gap
    if any(a < end and b > start for a, b in itertools.pairwise(events)):
        # the largest gap touching the window, clipped at the start: an exact oracle
        touching = [
            b - max(a, start) for a, b in itertools.pairwise(events) if a < end and b > start
        ]
        assert pause == max(touching)
    else:
        assert pause == 0


@given(times, st.floats(0, 100), st.floats(0, 50), st.floats(0, 5))
def test_a_longer_window_never_shortens_the_pause(
    events: list[float], start: float, span: float, more: float
) -> None:
    samples = [streamed(events[0], events[1:])]
    assert longest_stall(samples, start, start + span) <= longest_stall(
        samples, start, start + span + more
    )


def test_the_landing_is_the_longest_engine_landing_and_its_mark_lies_inside_it() -> None:
    parts = {
        "pause_s": 0.04,
        "land_and_check_s": 0.3,
        "reset_cache_s": 0.05,
        "weight_version_s": 0.05,
        "resume_s": 0.1,
    }
    landing = {"http://a": parts, "http://b": {**parts, "pause_s": 0.54}}
    assert abs(landing_seconds(landing) - 1.04) < 1e-9
    assert landing_seconds({}) == 0.0
    # re-admitted at 10.0: resumed from 9.9, landed from 9.5: the middle is 9.7
    assert abs(landing_mark(10.0, parts) - 9.7) < 1e-9


def test_kept_requests_were_in_flight_on_the_paused_engine_and_ended_ok_after() -> None:
    landing = EngineLanding("e0", out=5.0, mark=5.5)
    samples = [
        streamed(4.0, [4.5, 6.0], engine="e0"),  # frozen, resumed: kept
        streamed(4.0, [4.5, 5.2], engine="e0"),  # ended before the landing (wait): not kept
        streamed(4.0, [4.5, 6.0], engine="e1"),  # other engine
        streamed(5.1, [6.0], engine="e0"),  # sent after e0 left the rotation
        streamed(4.0, [4.5], ended=6.0, engine="e0", outcome="aborted"),
    ]
    assert kept(samples, [landing]) == 1
    assert kept(samples, [landing, EngineLanding("e1", 5.0, 5.5)]) == 2
    assert kept(samples, []) == 0


def test_stream_lines_and_outcomes() -> None:
    assert chunk_of('data: {"choices": [{"text": "a"}]}') == {"choices": [{"text": "a"}]}
    assert chunk_of("data: [DONE]") is None
    assert chunk_of("") is None and chunk_of(": keep-alive") is None
    assert outcome_of(200, "length", None) == "ok"
    assert outcome_of(200, "abort", None) == "aborted"
    assert outcome_of(200, None, None) == "failed"  # the stream ended without a reason
    assert outcome_of(503, None, None) == "failed"
    assert outcome_of(200, "length", "boom") == "failed"


def test_keep_goals() -> None:
    row = {"pause_s": 0.5, "landing_s": 0.4, "prepare_apply_share": 0.6}
    run = {"per_update": [row, {**row, "pause_s": 0.3}], "aborted": 0, "failed": 0}
    goals = keep_goals(run)
    assert goals["met"] and goals["premise"]["transfer_measurable"]
    assert abs(goals["max_pause_minus_landing_s"] - 0.1) < 1e-9
    late = keep_goals({**run, "per_update": [{**row, "pause_s": 0.61}]})
    assert not late["met"] and not late["pause_within_landing_plus_0_2_s"]
    assert not keep_goals({**run, "failed": 1})["met"]
    assert not keep_goals({**run, "per_update": [{**row, "prepare_apply_share": 0.1}]})["premise"][
        "transfer_measurable"
    ]


def test_the_steady_stall_counts_only_gaps_wholly_inside_its_window() -> None:
    samples = [streamed(0.0, [0.2, 0.3, 1.5]), streamed(1.0, [1.1, 2.9])]
    assert longest_gap_within(samples, 0.0, 2.0) == pytest.approx(1.2)  # 0.3 -> 1.5
    assert longest_gap_within(samples, 0.5, 2.0) == pytest.approx(0.1)  # 1.0 -> 1.1
    assert longest_gap_within(samples, 3.0, 4.0) == 0.0
