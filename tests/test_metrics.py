"""A coordinator process's update metrics: ``mooncake-rl update --metrics-textfile`` and
``--metrics-port``, and the accumulation the VeRL bridge relies on across its updates.

The exposition is read back with prometheus_client's own parser. The engine's side
(``/metrics``) is checked in ``tests/engine/test_receiver_routes.py`` and against a real
vLLM server in ``tests/engine/test_vllm_e2e.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
from pathlib import Path

import httpx
import pytest
import torch

from engine_ext.metrics import STATES
from mooncake_rl.cli import main
from mooncake_rl.coordinator import Coordinator, UpdateFailed, UpdateResult
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.figures import PHASE_BUCKETS_S, UpdateFigures
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.metrics import MetricsExport, UpdateMetrics, receiver_families
from mooncake_rl.services import EmbeddedMaster, free_port
from mooncake_rl.store import StoreClient
from tests.conftest import repo_root, trainer_settings
from tests.engine.test_receiver_routes import Samples, by_label, samples_of

MODEL = "metrics-tiny"
A, B, C = "http://engine-a:8000", "http://engine-b:8000", "http://engine-c:8000"


def result(**fields: object) -> UpdateResult:
    """An update of three engines: ``a`` by the Store path, ``b`` by broadcast, ``c`` lost."""
    made = UpdateResult(MODEL, 5, "direct", [A, B, C])
    made.phase_seconds = {"placement": 0.02, "drain": 0.3, "apply": 4.0, "commit": 0.7}
    made.store_read_bytes, made.pushed_bytes = 1000, 400
    made.in_place_bytes, made.staged_bytes = 600, 300
    made.legs = {
        A: {"transport": "store", "bytes": 900, "seconds": 4.0},
        B: {"transport": "broadcast", "bytes": 800, "seconds": 3.0},
    }
    made.committed = [A, B]
    made.failed = {C: "http://engine-c:8000/mooncake/prepare: 409 prepare_failed: ..."}
    made.failure_codes = {C: "prepare_failed"}
    made.rebuild = [C]
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def update_flags(master: EmbeddedMaster, *engines: str) -> list[str]:
    urls = [flag for url in engines for flag in ("--engine", url)]
    store = ["--master", master.master_address, "--metadata", master.metadata_url]
    return ["update", "--name", MODEL, *urls, *store]


def run(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples[(f"mooncake_rl_{name}", tuple(sorted(labels.items())))]


def test_cli_update_writes_every_figure_to_the_textfile(
    master: EmbeddedMaster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engines are the coordinator's business (tested against real ones elsewhere);
    here ``Coordinator.update`` returns a known result and the textfile must say it all."""
    monkeypatch.setattr(Coordinator, "update", lambda self, model, **options: result())
    textfile = tmp_path / "update.prom"
    assert run([*update_flags(master, A, B, C), "--metrics-textfile", str(textfile)]) == 0
    samples = samples_of(textfile.read_text())

    assert by_label(samples, "updates_total") == {"committed": 1}
    phases = {"placement": 0.02, "drain": 0.3, "apply": 4.0, "commit": 0.7}
    assert by_label(samples, "update_phase_seconds_count") == dict.fromkeys(phases, 1)
    assert by_label(samples, "update_phase_seconds_sum") == phases
    for phase, seconds in phases.items():
        for bound in PHASE_BUCKETS_S:
            le = str(bound)
            expected = float(seconds <= bound)
            assert sample(samples, "update_phase_seconds_bucket", phase=phase, le=le) == expected
    assert sample(samples, "update_store_read_bytes_total") == 1000
    assert sample(samples, "update_pushed_bytes_total") == 400
    # Staged: the Store path's 300 and the broadcast leg's 800.
    assert by_label(samples, "update_received_bytes_total") == {"in_place": 600, "staged": 1100}
    assert by_label(samples, "update_failures_total") == {"prepare_failed": 1}
    assert sample(samples, "update_rebuilds_total") == 1
    assert sample(samples, "update_last_success") == 1
    assert by_label(samples, "update_last_generation") == {MODEL: 5}
    assert by_label(samples, "update_last_engines") == {
        "committed": 2,
        "skipped": 0,
        "failed": 1,
        "rebuild": 1,
    }
    assert sample(samples, "update_last_duration_seconds") == pytest.approx(5.02)
    assert sample(samples, "update_last_timestamp_seconds") > 0
    assert not list(tmp_path.glob("update.prom.*"))  # written through a renamed temporary


def test_cli_update_serves_its_metrics_while_it_runs(
    master: EmbeddedMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    seen: list[Samples] = []

    def update(self: Coordinator, model: str, **options: object) -> UpdateResult:
        seen.append(samples_of(httpx.get(url, timeout=10).text))  # mid-update: a scrape
        return result()

    monkeypatch.setattr(Coordinator, "update", update)
    assert run([*update_flags(master, A), "--metrics-port", str(port)]) == 0
    (during,) = seen
    assert by_label(during, "updates_total") == {}
    assert sample(during, "update_store_read_bytes_total") == 0
    with pytest.raises(httpx.ConnectError):  # the command ended: so did the server
        httpx.get(url, timeout=10)


def test_a_failed_cli_update_is_recorded_with_each_engines_error_code(
    master: EmbeddedMaster, holders, tmp_path: Path
) -> None:
    """A real update of a published generation to an engine nobody serves: exit 1, and the
    textfile says it failed, on which generation, and why (``unreachable``)."""
    settings = trainer_settings(master, holders("metrics-store"), "trainer")
    with StoreClient(settings) as store:
        published = publish_local(store, MODEL, [("w", torch.ones(8))], dtype="float32")
    nobody = f"http://127.0.0.1:{free_port()}"
    textfile = tmp_path / "update.prom"
    assert run([*update_flags(master, nobody), "--metrics-textfile", str(textfile)]) == 1
    samples = samples_of(textfile.read_text())
    assert by_label(samples, "updates_total") == {"failed": 1}
    assert by_label(samples, "update_failures_total") == {"unreachable": 1}
    assert sample(samples, "update_last_success") == 0
    assert by_label(samples, "update_last_generation") == {MODEL: published.generation}
    assert sample(samples, "update_last_engines", outcome="failed") == 1


def test_figures_accumulate_across_updates_and_the_last_one_replaces_the_previous() -> None:
    """What a trainer's bridge sees over several syncs, served on a port while it runs."""
    clock = iter([100.0, 200.0, 300.0])
    metrics = UpdateMetrics(MetricsExport(port=free_port(), addr="127.0.0.1"), lambda: next(clock))

    def failing() -> UpdateResult:
        raise UpdateFailed(result(committed=[], failure_codes={A: "apply_failed"}))

    def refused() -> UpdateResult:
        raise ConfigurationError("no engine can take this transport")

    with metrics.serving():
        metrics.observe(result)
        for update, error in ((failing, UpdateFailed), (refused, ConfigurationError)):
            with pytest.raises(error):
                metrics.observe(update)
        url = f"http://127.0.0.1:{metrics.export.port}/metrics"
        samples = samples_of(httpx.get(url, timeout=10).text)
    assert by_label(samples, "updates_total") == {"committed": 1, "failed": 1, "refused": 1}
    assert sample(samples, "update_store_read_bytes_total") == 2000
    assert by_label(samples, "update_phase_seconds_count")["apply"] == 2
    assert by_label(samples, "update_failures_total") == {"prepare_failed": 1, "apply_failed": 1}
    # The refused update has no result: its end and its outcome, nothing else of its own.
    assert sample(samples, "update_last_success") == 0
    assert sample(samples, "update_last_timestamp_seconds") == 300
    assert by_label(samples, "update_last_generation") == {}
    with pytest.raises(httpx.ConnectError):  # served only while the block runs
        httpx.get(url, timeout=10)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--metrics-textfile", "update.txt"], "must end in .prom"),
        (["--metrics-port", "70000"], "must lie in 1..65535"),
    ],
)
def test_bad_metrics_flags_are_refused_before_anything_runs(
    master: EmbeddedMaster,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    flags: list[str],
    message: str,
) -> None:
    def never(self: Coordinator, model: str, **options: object) -> UpdateResult:
        raise AssertionError("no update may start")

    monkeypatch.setattr(Coordinator, "update", never)
    assert main([*update_flags(master, A), *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_metrics_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        metrics = UpdateMetrics(MetricsExport(port=port, addr="127.0.0.1"))
        refused = f"cannot serve metrics on 127.0.0.1:{port}"
        with pytest.raises(ConfigurationError, match=refused), metrics.serving():
            pass


def test_docs_and_dashboard_name_exactly_the_metrics_exported() -> None:
    """docs/metrics.md lists every family the engine and the coordinator export, and the
    Grafana dashboard queries no other name."""
    metrics = UpdateMetrics()
    metrics.record("committed", result())
    engine = receiver_families(
        {"state": "serving", "model": MODEL, "generation": 1}, STATES, UpdateFigures()
    )
    exported = {
        f"{family.name}_total" if family.type == "counter" else family.name
        for family in [*engine, *metrics.collect()]
    }
    docs = (repo_root() / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(mooncake_rl_\w+)` \|", docs, flags=re.M))
    assert documented == exported
    dashboard = json.loads((repo_root() / "docs" / "grafana" / "mooncake-rl.json").read_text())
    queried = {
        re.sub(r"_(bucket|sum|count)$", "", name)
        for panel in dashboard["panels"]
        for target in panel.get("targets", ())
        for name in re.findall(r"mooncake_rl_\w+", target["expr"])
    }
    assert queried <= exported
    assert {"mooncake_rl_served_generation", "mooncake_rl_updates_total"} <= queried
