"""``make load``: five updates per mode under continuous traffic through a real vllm-router
in front of two real vLLM CPU engines (``bench.load``, which checks every update: both
engines serve the new generation with transformers' greedy output for it)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from bench.load import LoadConfig, run

pytestmark = [pytest.mark.load, pytest.mark.timeout(1800)]


def test_rolling_updates_fail_no_request_and_all_at_once_is_measured(tmp_path: Path) -> None:
    result = run(LoadConfig(updates=5, root=tmp_path))
    for drain, rolling in result["modes"]["rolling"].items():
        assert rolling["failed"] == 0, (drain, rolling["failures"])
        assert rolling["during"]["ok_per_second"] > 0
        assert len(rolling["generations"]) == 5
        assert rolling["generations_in_headers"][-1] == rolling["generations"][-1]
    for at_once in result["modes"]["all_at_once"].values():
        # All at once, the router has no worker while both engines land. Its own retries
        # (about 0.4 s) can bridge a short window, so a failure is not certain; any that
        # happens is the router's 503 for having no worker, never an engine error or a
        # timeout, and the measured outage covers exactly those.
        assert all(f.startswith("No available workers") for f in at_once["failures"]), at_once
        assert (at_once["failed"] > 0) == (at_once["unavailable_seconds"] > 0)
        assert at_once["generations_in_headers"][-1] == at_once["generations"][-1]
    for runs in result["modes"].values():
        # keep freezes in-flight requests and resumes them; abort cuts them; wait ends them
        assert runs["keep"]["aborted"] == 0, runs["keep"]
        assert runs["abort"]["kept"] == 0
        assert runs["wait"]["aborted"] == 0
    # A keep wave of every engine stays in rotation: requests wait out the landing queued.
    assert result["modes"]["all_at_once"]["keep"]["failed"] == 0
    for rotation in ("rolling", "all_at_once"):
        assert result["goals"][rotation]["no_aborted"] and result["goals"][rotation]["no_failed"]
