"""``python -m bench.tables``: the page's tables are spliced from benchmark JSON, and only
between their markers; bad input changes nothing and says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.tables import DEFAULT_DOC, RENDERERS, TableError, main, render_load, splice

# Text around a table block: anything but the markers themselves.
prose = st.text(st.characters(blacklist_characters="<"), max_size=200)
table_lines = st.lists(st.text(st.characters(blacklist_characters="<\n"), max_size=40), max_size=5)


def block(name: str, body: str = "old\n") -> str:
    return f"<!-- table: {name} -->\n{body}<!-- /table: {name} -->"


@given(prose, prose, table_lines, table_lines)
def test_splice_replaces_only_the_block_and_is_idempotent(
    before: str, after: str, first: list[str], second: list[str]
) -> None:
    doc = before + block("load") + after
    once = splice(doc, "load", first)
    assert once == before + block("load", "".join(f"{line}\n" for line in first) or "\n") + after
    assert splice(once, "load", first) == once
    assert splice(splice(once, "load", second), "load", first) == once


@pytest.mark.parametrize(
    "doc", ["no markers", block("load") + block("load"), "<!-- table: load -->\nunclosed"]
)
def test_a_doc_without_exactly_one_block_is_refused_naming_the_markers(doc: str) -> None:
    with pytest.raises(TableError, match="exactly one '<!-- table: load -->'"):
        splice(doc, "load", ["x"])


LOAD_RUN = {
    "bench": "load",
    "date": "2026-12-06T04:29:00+00:00",
    "machine": {"cpus": 2},
    "config": {"updates": 2},
    "model_bytes": 336_662_528,
    "modes": {
        "rolling": {
            "keep": {
                "pause_s": {"median": 0.81, "max": 0.94},
                "landing_s": {"median": 0.68, "max": 0.7},
                "update_seconds": {"median": 3.39, "max": 3.5},
                "aborted": 0,
                "failed": 0,
                "kept": 7,
            }
        },
        "all_at_once": {
            "abort": {
                "pause_s": {"median": 0.44, "max": 0.5},
                "landing_s": {"median": 0.59, "max": 0.6},
                "update_seconds": {"median": 1.9, "max": 2.0},
                "aborted": 8,
                "failed": 6,
                "kept": 0,
            }
        },
    },
}


def test_the_load_table_has_one_row_per_rotation_and_drain() -> None:
    assert render_load([LOAD_RUN])[2:] == [
        "| rotation / drain | pause s | landing s | update s | aborted | failed | kept |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        "| rolling / keep | 0.810 (max 0.940) | 0.680 | 3.390 | 0 | 0 | 7 |",
        "| all at once / abort | 0.440 (max 0.500) | 0.590 | 1.900 | 8 | 6 | 0 |",
    ]


def test_the_command_writes_checks_and_refuses_bad_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\n" + block("load") + "\n\nafter\n")
    run = tmp_path / "load.json"
    run.write_text(json.dumps(LOAD_RUN))

    assert main([str(run), "--doc", str(doc), "--check"]) == 1  # stale: says so, writes nothing
    assert "old\n" in doc.read_text()
    assert main([str(run), "--doc", str(doc)]) == 0
    written = doc.read_text()
    assert "| rolling / keep | 0.810 (max 0.940) |" in written and written.endswith("\nafter\n")
    assert main([str(run), "--doc", str(doc), "--check"]) == 0

    capsys.readouterr()
    for content, cause in (
        ("{not json", "not a benchmark's JSON"),
        (json.dumps({"bench": "ops"}), "bench 'ops' has no table"),
        (json.dumps({**LOAD_RUN, "modes": {"rolling": {"keep": {}}}}), "lacks the field"),
    ):
        run.write_text(content)
        assert main([str(run), "--doc", str(doc)]) == 2
        assert cause in capsys.readouterr().err
        assert doc.read_text() == written


def test_the_performance_page_has_one_block_for_every_table() -> None:
    page = DEFAULT_DOC.read_text()
    for name in RENDERERS:
        assert splice(page, name, ["x"]).count("\nx\n") == 1, name
