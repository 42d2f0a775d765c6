"""The tables of docs/performance.md, regenerated from the benchmarks' own JSON.

    benchmark JSON files (stdout of ``mooncake-rl bench``, ``bench transports``, ``bench load``)
        --load: grouped by their "bench" field-->  runs per benchmark
        --RENDERERS[bench]: pure-->                one markdown table and its caption
        --splice-->                                the doc, between ``<!-- table: NAME -->``
                                                   and ``<!-- /table: NAME -->``

Why: a figure on the page is worth what its reproduction is. A table written by hand drifts
from the JSON it came from; one written by this command from the JSON a reader can make
again cannot. ``--check`` says whether the page matches the given JSON without writing it.

    python -m bench.tables out/compare-*.json out/transports.json out/load.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

DEFAULT_DOC = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
Run = Mapping[str, Any]


class TableError(ValueError):
    """A JSON file or the doc cannot make a table; the message names which and why."""


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def _caption(runs: Sequence[Run], what: str) -> str:
    dates = ", ".join(str(run.get("date", "undated")) for run in runs)
    machines = [run.get("machine", {}) for run in runs]
    loads = [m.get("load_average_1m", m.get("load_average_1m_before")) for m in machines]
    load = ", ".join(str(x) for x in loads if x is not None)
    cpus, cpu = machines[0].get("cpus"), machines[0].get("cpu")
    host = f"{cpus} cores" + (f" ({cpu})" if cpu else "")
    host += f", load average {load}" if load else ""
    return f"*{what}; {len(runs)} run(s) of {dates}; {host}.*"


def render_compare(runs: Sequence[Run]) -> list[str]:
    """``mooncake-rl bench``: every approach; bytes as multiples of the model, seconds of
    each run, and the median of each run's seconds over ``direct``'s in that run."""
    first = runs[0]
    model = first["model_bytes"]
    rows = []
    for name, figures in first["approaches"].items():
        seconds = " / ".join(_s(run["approaches"][name]["seconds"]) for run in runs)
        vs_direct = statistics.median(run["ratios"][name]["vs_direct"]["seconds"] for run in runs)
        rows.append(
            [
                f"`{name}`",
                figures.get("engines") or f"gloo, {len(figures['rank_nodes'])} ranks",
                seconds,
                _x(figures["store_read_bytes"] / model),
                _x(figures["pushed_bytes"] / model),
                _x(figures["max_node_nic_bytes"] / model),
                _x(vs_direct),
            ]
        )
    header = ["approach", "engines", "seconds", "Store reads", "pushed", "max node NIC"]
    return [
        _caption(runs, f"{model:,} B model; bytes are multiples of it"),
        "",
        *_table([*header, "seconds vs `direct` (median)"], rows),
    ]


def render_transports(runs: Sequence[Run]) -> list[str]:
    """``mooncake-rl bench transports``: each row's median (min) seconds and its ratios
    against the baseline row of the same run."""
    (run,) = _one(runs, "transports")
    base = run["baseline"]
    rows = []
    for name, row in run["transports"].items():
        ratios = row[f"vs_{base}"]
        apply_, update = row["apply_seconds"], row["update_seconds"]
        rows.append(
            [
                f"`{name}`" + (" (baseline)" if name == base else ""),
                f"{_s(apply_['median'])} ({_s(apply_['min'])})",
                f"{_s(update['median'])} ({_s(update['min'])})",
                _x(ratios["update_seconds"]),
                _x(ratios["store_reads"]),
                _x(ratios["engine_bytes"]),
            ]
        )
    header = ["row", "apply s", "update s", "update vs baseline", "Store reads", "engine bytes"]
    what = f"{run['model']['model_bytes']:,} B {run['model']['dtype']} model; median (min)"
    return [_caption(runs, what), "", *_table(header, rows)]


def render_load(runs: Sequence[Run]) -> list[str]:
    """``mooncake-rl bench load``: per rotation and drain, the pause against the landing,
    the update, and what happened to the requests it crossed."""
    (run,) = _one(runs, "load")
    rows = []
    for mode, drains in run["modes"].items():
        for drain, report in drains.items():
            pause, landing = report["pause_s"], report["landing_s"]
            rows.append(
                [
                    f"{mode.replace('_', ' ')} / {drain}",
                    f"{_s(pause['median'])} (max {_s(pause['max'])})",
                    _s(landing["median"]),
                    _s(report["update_seconds"]["median"]),
                    report["aborted"],
                    report["failed"],
                    report["kept"],
                ]
            )
    header = ["rotation / drain", "pause s", "landing s", "update s", "aborted", "failed"]
    what = f"{run['model_bytes']:,} B model; medians of {run['config']['updates']} updates"
    return [_caption(runs, what), "", *_table([*header, "kept"], rows)]


def _one(runs: Sequence[Run], bench: str) -> Sequence[Run]:
    if len(runs) != 1:
        raise TableError(f"the {bench} table comes from one run; got {len(runs)} JSON files")
    return runs


RENDERERS: dict[str, Callable[[Sequence[Run]], list[str]]] = {
    "compare": render_compare,
    "transports": render_transports,
    "load": render_load,
}


def load(paths: Sequence[Path]) -> dict[str, list[Run]]:
    """Each file's JSON, grouped by its ``bench`` field, in the order given."""
    runs: dict[str, list[Run]] = {}
    for path in paths:
        try:
            document = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise TableError(f"{path}: not a benchmark's JSON ({error})") from error
        bench = document.get("bench") if isinstance(document, dict) else None
        if bench not in RENDERERS:
            raise TableError(
                f"{path}: bench {bench!r} has no table; tables exist for {sorted(RENDERERS)}"
            )
        runs.setdefault(bench, []).append(document)
    return runs


def splice(doc: str, name: str, lines: Sequence[str]) -> str:
    """``doc`` with the block between table ``name``'s markers replaced by ``lines``."""
    pattern = re.compile(
        rf"(<!-- table: {re.escape(name)} -->\n).*?(<!-- /table: {re.escape(name)} -->)",
        re.DOTALL,
    )
    if len(pattern.findall(doc)) != 1:
        raise TableError(
            f"the doc needs exactly one '<!-- table: {name} -->' ... "
            f"'<!-- /table: {name} -->' block to write the {name} table into"
        )
    return pattern.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(2), doc)


def regenerate(doc: str, runs: Mapping[str, Sequence[Run]]) -> str:
    for bench, documents in runs.items():
        try:
            lines = RENDERERS[bench](documents)
        except KeyError as error:
            raise TableError(
                f"a {bench} JSON lacks the field {error}: made by another version of the "
                f"benchmark? Run it again from this checkout"
            ) from error
        doc = splice(doc, bench, lines)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tables", description=__doc__)
    parser.add_argument("json", nargs="+", type=Path, help="benchmark JSON files")
    parser.add_argument("--doc", type=Path, default=DEFAULT_DOC)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the doc differs; write nothing"
    )
    args = parser.parse_args(argv)
    try:
        before = args.doc.read_text()
        after = regenerate(before, load(args.json))
    except (OSError, TableError) as error:
        print(f"bench.tables: {error}", file=sys.stderr)
        return 2
    if args.check:
        if after != before:
            print(f"bench.tables: {args.doc} differs from the JSON given", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
