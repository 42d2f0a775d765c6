"""``mooncake-rl bench transports``: its pure parts (samples, rows, ratios, checks, order).

The bench itself starts two vLLM engines and runs for minutes (``make bench``); nothing
here starts an engine or a service.
"""

from __future__ import annotations

import itertools

import pytest

from bench.__main__ import main as bench_main
from bench.transports import (
    BASELINE,
    CASES,
    ENGINE_GPUS,
    TransportsConfig,
    checkpoint_sequence,
    core_split,
    init_std,
    llama_shape,
    memory_fraction_for,
    parser,
    ratio,
    sample_of,
    schedule,
    summary,
    transport_row,
    update_problems,
    with_ratios,
)
from mooncake_rl.coordinator import UpdateResult

URLS = {"e0": "http://127.0.0.1:1", "e1": "http://127.0.0.1:2"}
LABELS = {url: label for label, url in URLS.items()}
CASE = {case.name: case for case in CASES}


def result(
    transports: dict[str, str],
    nbytes: int = 1000,
    apply_s: float = 1.0,
    store_read: int = 0,
    generation: int = 2,
) -> UpdateResult:
    made = UpdateResult("m", generation, "compat", list(URLS.values()))
    made.phase_seconds = {"drain": 0.1, "apply": apply_s, "commit": 0.5}
    made.legs = {
        URLS[label]: {"transport": t, "bytes": nbytes, "seconds": apply_s / 2}
        for label, t in transports.items()
    }
    made.landing = {  # engine e1 lands longest: 0.1 + 0.3 s
        url: {"pause_s": 0.1, "land_and_check_s": 0.1 * (i + 2), "resume_s": 0.0}
        for i, url in enumerate(URLS.values())
    }
    made.store_read_bytes = store_read
    made.pushed_bytes = store_read
    made.committed = list(URLS.values())
    made.verified = {
        f"{url}/tp0": {"checked": 3, "unchecked": [], "mismatched": []} for url in URLS.values()
    }
    return made


def samples(case_name: str, applies: list[float], **kwargs) -> list[dict]:
    case = CASE[case_name]
    return [
        sample_of(result(case.expected_legs(), apply_s=a, **kwargs), a + 1.0, LABELS)
        for a in applies
    ]


def test_summary_and_ratio() -> None:
    assert summary([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "all": [3, 1, 2]}
    assert summary([1.0, 2.0])["median"] == 1.5
    assert ratio(3.0, 2.0) == 1.5 and ratio(1.0, 3.0) == 0.333
    assert ratio(1.0, 0) is None and ratio(None, 1.0) is None
    with pytest.raises(ValueError):
        summary([])


def test_rows_take_medians_and_ratios_are_against_store_compat() -> None:
    rows = {
        "store_compat": transport_row(
            CASE["store_compat"], samples("store_compat", [2.0, 4.0, 3.0], store_read=1000)
        ),
        "broadcast": transport_row(
            CASE["broadcast"], samples("broadcast", [1.0, 9.0, 1.5], store_read=1000)
        ),
        "cpu_serialize_http": transport_row(
            CASE["cpu_serialize_http"],
            samples("cpu_serialize_http", [6.0, 6.0, 6.0], store_read=500),
        ),
    }
    compat = rows["store_compat"]
    assert compat["apply_seconds"]["median"] == 3.0 and compat["apply_seconds"]["min"] == 2.0
    assert compat["update_seconds"]["median"] == 4.0
    assert compat["phase_seconds_median"] == {"apply": 3.0, "commit": 0.5, "drain": 0.1}
    assert compat["landing_seconds"]["median"] == 0.4  # the longest engine's landing
    assert compat["commit_seconds"]["median"] == 0.5
    assert compat["legs"]["e1"] == {"transport": "store", "bytes": 1000, "seconds_median": 1.5}
    assert compat["engine_bytes"] == {"e0": 1000, "e1": 1000}
    assert compat["total_engine_bytes"] == 2000 and compat["verified"] == 3
    assert compat["store_read_bytes"] == 1000 and not compat["bytes_vary_between_repeats"]

    ratios = {name: row[f"vs_{BASELINE}"] for name, row in with_ratios(rows).items()}
    assert ratios["store_compat"] == {
        "apply_seconds": 1.0,
        "update_seconds": 1.0,
        "landing_seconds": 1.0,
        "engine_bytes": 1.0,
        "store_reads": 1.0,
    }
    assert ratios["broadcast"]["apply_seconds"] == 0.5  # median 1.5 over 3.0
    assert ratios["broadcast"]["update_seconds"] == 0.625  # 2.5 over 4.0
    assert ratios["broadcast"]["store_reads"] == 1.0  # the sender reads the model once
    assert ratios["cpu_serialize_http"]["apply_seconds"] == 2.0
    assert ratios["cpu_serialize_http"]["store_reads"] == 0.5


def test_a_row_says_when_bytes_differ_between_repeats() -> None:
    case = CASE["store_direct"]
    varied = [sample_of(result(case.expected_legs(), nbytes=n), 1.0, LABELS) for n in (10, 10, 12)]
    row = transport_row(case, varied)
    assert row["bytes_vary_between_repeats"] and row["engine_bytes"]["e0"] == 10


def test_update_problems_name_every_wrong_outcome() -> None:
    auto = CASE["auto_mixed"]
    right = result(auto.expected_legs())
    assert update_problems(auto, right, URLS, workers=2) == []

    all_broadcast = result({"e0": "broadcast", "e1": "broadcast"})
    assert "legs" in update_problems(auto, all_broadcast, URLS, workers=2)[0]

    partial = result(auto.expected_legs())
    partial.committed = [URLS["e0"]]
    partial.failed = {URLS["e1"]: "commit failed"}
    assert "committed" in update_problems(auto, partial, URLS, workers=2)[0]

    unchecked = result(auto.expected_legs())
    unchecked.verified[f"{URLS['e1']}/tp0"] = {"checked": 3, "unchecked": ["w"], "mismatched": []}
    assert "post-landing check of" in update_problems(auto, unchecked, URLS, workers=2)[0]

    missing = result(auto.expected_legs())
    missing.verified.pop(f"{URLS['e0']}/tp0")
    assert "1 of 2 workers" in update_problems(auto, missing, URLS, workers=2)[0]


def test_the_cases_cover_every_transport_and_topology() -> None:
    assert len({c.name for c in CASES}) == len(CASES) and BASELINE in CASE
    assert {c.transport for c in CASES} == {"store", "broadcast", "cpu_serialize", "auto"}
    assert {c.mode for c in CASES if c.transport == "store"} == {"compat", "direct"}
    assert {c.handoff for c in CASES if c.transport == "cpu_serialize"} == {"auto", "http"}
    engine_gpus = set(ENGINE_GPUS.values())
    assert not set(CASE["broadcast"].train_gpus.split(",")) & engine_gpus  # disjoint pool
    # auto: the pool is engine 1's GPU, so engine 0 broadcasts and engine 1 gets CPU buckets
    assert CASE["auto_mixed"].train_gpus == ENGINE_GPUS["e1"]
    assert CASE["auto_mixed"].expected_legs() == {"e0": "broadcast", "e1": "cpu_serialize"}


def test_rounds_rotate_and_checkpoints_always_change() -> None:
    plan = schedule(CASES, 3)
    assert len(plan) == 3 * len(CASES)
    for round_ in range(3):
        names = [c.name for r, c in plan if r == round_]
        assert sorted(names) == sorted(c.name for c in CASES)
        assert names[0] == CASES[round_].name
    order = checkpoint_sequence(20, 4)
    assert 0 not in order and set(order) == {1, 2, 3}
    assert all(a != b for a, b in itertools.pairwise(order))
    with pytest.raises(ValueError):
        checkpoint_sequence(5, 2)


def test_engines_get_disjoint_cores() -> None:
    assert core_split(2, 2) == ["0", "1"]
    assert core_split(16, 2) == ["0-7", "8-15"]
    assert core_split(5, 2) == ["0-1", "2-3"]
    assert core_split(1, 2) is None


def test_engines_reserve_memory_by_model_size() -> None:
    host = 24 << 30
    assert memory_fraction_for(40 << 20, host) == 0.05
    assert memory_fraction_for(336 << 20, host) == round((4 * 336 + 768) / (24 << 10), 3)
    assert memory_fraction_for(100 << 30, host) == 0.5


def test_model_shapes_and_config_validation() -> None:
    assert llama_shape(64, 2, 128)["head_dim"] == 32  # the tiny model's shape
    shape = llama_shape(512, 4, 1024)
    assert (shape["num_attention_heads"], shape["head_dim"]) == (8, 64)
    assert init_std(64) == 0.2 and init_std(256) == pytest.approx(0.1)
    for bad in ((96, 2, 128), (0, 2, 128), (64, 0, 128)):
        with pytest.raises(ValueError):
            llama_shape(*bad)
    with pytest.raises(ValueError):
        TransportsConfig(repeats=0)
    with pytest.raises(ValueError):
        TransportsConfig(memory_fraction=1.5)
    with pytest.raises(ValueError):
        TransportsConfig(cpu_bind="pinned")
    args = parser().parse_args([])
    assert (args.hidden, args.layers, args.repeats, args.warmup) == (512, 4, 3, 1)


def test_bench_dispatches_transports(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        bench_main(["transports", "--help"])
    assert done.value.code == 0
    assert "mooncake-rl bench transports" in capsys.readouterr().out


def test_the_transports_table_is_made_from_the_rows_and_their_ratios() -> None:
    """``python -m bench.tables``: the page's table comes from the run's JSON, row for row."""
    from bench.tables import render_transports

    rows = {
        "store_compat": transport_row(
            CASE["store_compat"], samples("store_compat", [2.0, 4.0, 3.0], store_read=1000)
        ),
        "broadcast": transport_row(
            CASE["broadcast"], samples("broadcast", [1.0, 9.0, 1.5], store_read=500)
        ),
    }
    run = {
        "bench": "transports",
        "date": "2026-12-06T20:00:00+00:00",
        "machine": {"cpus": 2},
        "model": {"model_bytes": 5_510_144, "dtype": "float32"},
        "baseline": BASELINE,
        "transports": with_ratios(rows),
    }
    lines = render_transports([run])
    assert lines[0] == (
        "*5,510,144 B float32 model; median (min); 1 run(s) of 2026-12-06T20:00:00+00:00; 2 cores.*"
    )
    assert lines[2:] == [
        "| row | apply s | update s | update vs baseline | Store reads | engine bytes |",
        "| --- | --- | --- | --- | --- | --- |",
        "| `store_compat` (baseline) | 3.000 (2.000) | 4.000 (3.000) | 1.00x | 1.00x | 1.00x |",
        "| `broadcast` | 1.500 (1.000) | 2.500 (2.000) | 0.62x | 0.50x | 1.00x |",
    ]
