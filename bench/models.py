"""The model-family coverage matrix (``make models``): every family, both update modes.

For each tiny random family (``mooncake_rl.tiny_model.FAMILIES``), tied and untied where its
config allows, at TP 1 (and TP 2 where asked): publish generation 1, start a real vLLM
engine from the Store, update it in compat mode to generation 2 and in direct mode to
generation 3, and compare greedy outputs with plain vLLM serving each generation's weights
from a local directory. At TP 2 the direct update taught the coordinator the engine's cut,
so generations 4 and 5 (generation 3's and 2's weights again) are packed rank by rank
(``generations.pack_order``): direct then compat once more. Prints one JSON row per run,
then a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator, UpdateResult
from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import FAMILIES, PROMPT, make_tiny, perturbed_copy


@dataclass
class ModeRun:
    ok: bool = False
    outputs: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)
    store_read_bytes: int = 0
    received_bytes: int = 0
    fallback_bytes: int = 0  # of received_bytes, landed through load_weights
    in_place_bytes: int = 0  # of received_bytes, received straight into live parameters
    seconds: float = 0.0
    verify_seconds: float = 0.0
    checked: int = 0
    unchecked: int = 0
    error: str | None = None
    result: UpdateResult | None = field(default=None, repr=False)


@dataclass
class FamilyRun:
    family: str
    tied: bool
    tp: int
    compat: ModeRun = field(default_factory=ModeRun)
    direct: ModeRun = field(default_factory=ModeRun)
    rank_major: ModeRun | None = None
    """TP > 1: then direct and compat again, to generations packed rank by rank (the cut the
    direct update taught, ``generations.pack_order``); the first that failed, else compat."""
    error: str | None = None  # plain vLLM cannot serve the family: the cause


def last_error(log: Path) -> str:
    """The most telling line of a failed server's log."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no log"])[-1].strip()[:300]


def plain_outputs(
    model_dir: Path, settings: Settings, tp: int, log_dir: Path, args: tuple[str, ...] = ()
) -> list[int]:
    """Plain vLLM's greedy output for these weights (one server per weights and TP)."""
    weights = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    if (weights, tp) not in _PLAIN:
        _PLAIN[weights, tp] = _serve_plain(model_dir, settings, tp, log_dir, args)
    return _PLAIN[weights, tp]


_PLAIN: dict[tuple[str, int], list[int]] = {}


def _serve_plain(
    model_dir: Path, settings: Settings, tp: int, log_dir: Path, args: tuple[str, ...]
) -> list[int]:
    server = VllmServer(
        model_dir, settings, plain=True, tensor_parallel_size=tp, log_dir=log_dir, extra_args=args
    )
    try:
        server.start()
    except Exception as error:
        raise RuntimeError(f"plain vLLM cannot serve it: {last_error(server.log_path)}") from error
    try:
        return server.complete(PROMPT)
    finally:
        server.stop()


def update_once(
    store: StoreClient,
    engine: VllmServer,
    name: str,
    model_dir: Path,
    mode: str,
    direct_fallback: str | None = None,
) -> ModeRun:
    """Publish ``model_dir`` as the next generation and update ``engine`` to it."""
    run = ModeRun()
    publish_checkpoint(store, name, model_dir, "float32")
    started = time.perf_counter()
    try:
        with Coordinator(store, [engine.url], token=engine.token) as coordinator:
            result = coordinator.update(
                name, mode=mode, batch_bytes=64 << 10, direct_fallback=direct_fallback
            )
    except MooncakeRLError as failed:  # refused or failed: a matrix row, not a crash
        run.error = f"{type(failed).__name__}: {failed}"[:300]
        return run
    run.seconds = time.perf_counter() - started
    run.store_read_bytes = result.store_read_bytes
    run.received_bytes = sum(result.received_bytes.values())
    run.fallback_bytes = sum(result.fallback_bytes.values())
    run.in_place_bytes = result.in_place_bytes
    run.result = result
    checks = list(result.verified.values())
    run.verify_seconds = max((c.get("seconds", 0.0) for c in checks), default=0.0)
    run.checked = sum(c.get("checked", 0) for c in checks)
    run.unchecked = sum(len(c.get("unchecked", [])) for c in checks)
    run.outputs = engine.complete(PROMPT)
    return run


@dataclass
class LaunchedFamily:
    """One matrix row's generations made, generation 1 published and its engine launched.

    Launching is apart from :func:`finish_family` so that several engines start at once
    (each start is mostly one process importing); ``close`` stops the engine, and is safe
    to call again, so a caller that launched several can always clean up.
    """

    run: FamilyRun
    name: str
    dirs: list[Path]
    references: list[list[int]]
    engine: VllmServer | None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()


def launch_family(
    family: str,
    tied: bool,
    tp: int,
    root: Path,
    settings: Settings,
    store: StoreClient,
    *,
    engine_env: dict[str, str] | None = None,
    compiled: bool = False,
    reference: Callable[[Path], list[int]] | None = None,
) -> LaunchedFamily:
    """Make and publish the row's generations and launch its engine, without waiting.

    Engines run eagerly (``--enforce-eager``) unless ``compiled``: it halves a CPU server's
    start and changes no greedy output here; ``tests/engine/test_vllm_e2e.py`` keeps the
    compiled path covered. ``reference(model_dir)``: the expected greedy output of a
    generation's weights; default plain vLLM's (a server per generation; the tests use
    transformers', which equals it for the tiny families and starts no server).
    """
    run = FamilyRun(family, tied, tp)
    name = f"{family}-{'tied' if tied else 'untied'}-tp{tp}"
    work = root / name
    dirs = [make_tiny(family, work / "g1", tied=tied)]
    dirs += [perturbed_copy(dirs[0], work / f"g{seed + 1}", seed) for seed in (1, 2)]
    logs = work / "logs"
    args = FAMILIES[family].serve_args + (() if compiled else ("--enforce-eager",))
    try:
        references = [
            reference(d) if reference else plain_outputs(d, settings, tp, logs, args)
            for d in dirs[1:]
        ]
    except RuntimeError as error:
        run.error = str(error)
        return LaunchedFamily(run, name, dirs, [], None)
    publish_checkpoint(store, name, dirs[0], "float32")
    engine = VllmServer(
        dirs[0],
        settings,
        name=name,
        tensor_parallel_size=tp,
        log_dir=logs,
        token="matrix",
        extra_env=engine_env,
        extra_args=args,
    )
    try:
        engine.spawn()
    except Exception as error:
        _start_failed(run, engine, error)
        return LaunchedFamily(run, name, dirs, references, None)
    return LaunchedFamily(run, name, dirs, references, engine)


def _start_failed(run: FamilyRun, engine: VllmServer, error: Exception) -> None:
    run.compat.error = run.direct.error = (
        f"start from the Store failed: {last_error(engine.log_path)} ({error})"
    )


def finish_family(
    launched: LaunchedFamily,
    store: StoreClient,
    *,
    after: Callable[[VllmServer, FamilyRun, list[Path]], None] | None = None,
) -> FamilyRun:
    """Wait for the row's engine, update it in compat then direct mode (at TP > 1 then both
    again, to rank-major generations), and stop it.

    ``after(engine, run, model_dirs)`` runs on the updated engine before it stops (tests
    add steps there without starting another engine).
    """
    run, engine = launched.run, launched.engine
    if engine is None:
        return run
    try:
        try:
            engine.wait_healthy()
        except Exception as error:
            _start_failed(run, engine, error)
            return run
        steps = (
            ("compat", launched.dirs[1], launched.references[0]),
            ("direct", launched.dirs[2], launched.references[1]),
        )
        for mode, model_dir, reference in steps:
            result = update_once(store, engine, launched.name, model_dir, mode)
            setattr(run, mode, _checked(result, reference))
        if run.tp > 1:  # the direct update taught the engine's cut: packs go rank by rank
            again = [  # direct first: a compat update forgets the cut
                _checked(update_once(store, engine, launched.name, model_dir, mode), reference)
                for mode, model_dir, reference in reversed(steps)
            ]
            run.rank_major = next((r for r in again if not r.ok), again[-1])
        if after is not None:
            after(engine, run, launched.dirs)
    finally:
        launched.close()
    return run


def _checked(result: ModeRun, reference: list[int]) -> ModeRun:
    result.reference = reference
    result.ok = result.error is None and result.outputs == reference
    return result


def table(runs: list[dict[str, Any]]) -> str:
    """The docs table from JSON rows: family, direct OK, compat OK, bytes by landing kind
    (direct: into parameters / through load_weights; compat: full tensors), seconds."""
    lines = [
        "| family | tied | TP | direct | compat | rank-major packs | direct: into parameters "
        "| direct: fallback | compat: full tensors | direct s | compat s | check s (max) "
        "| parameters checked | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        direct, compat = run["direct"], run["compat"]
        ranked = run.get("rank_major")
        note = run["error"] or direct["error"] or compat["error"] or (ranked or {}).get("error")
        check = max(direct["verify_seconds"], compat["verify_seconds"])
        packed = "n/a" if ranked is None else "OK" if ranked["ok"] else "FAIL"
        lines.append(
            f"| {run['family']} | {'yes' if run['tied'] else 'no'} | {run['tp']} "
            f"| {'OK' if direct['ok'] else 'FAIL'} | {'OK' if compat['ok'] else 'FAIL'} | {packed} "
            f"| {direct['received_bytes'] - direct['fallback_bytes']:,} "
            f"| {direct['fallback_bytes']:,} | {compat['received_bytes']:,} "
            f"| {direct['seconds']:.2f} | {compat['seconds']:.2f} | {check:.3f} "
            f"| {direct['checked']} | {(note or '')[:160]} |"
        )
    return "\n".join(lines)


def rows_of(log: Path) -> list[dict[str, Any]]:
    """The JSON rows a matrix run printed (one per line) in ``log``."""
    lines = log.read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def matrix_cases(tp2: tuple[str, ...]) -> list[tuple[str, bool, int]]:
    cases = []
    for key, family in FAMILIES.items():
        for tied, allowed in ((True, family.can_tie), (False, family.can_untie)):
            if allowed:
                cases.append((key, tied, 1))
        if key in tp2:
            cases.append((key, family.tied_by_default, 2))
    return cases


def main(argv: list[str] | None = None) -> int:
    from mooncake_rl.services import EmbeddedMaster, MasterConfig, SegmentHolder

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=Path("out/models"))
    parser.add_argument("--family", action="append", help="only these families")
    parser.add_argument("--tp2", default="qwen2,qwen3_moe", help="families also run at TP 2")
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled path (slower)")
    parser.add_argument("--table-from", type=Path, help="print the table of an earlier run's log")
    args = parser.parse_args(argv)
    if args.table_from:
        print(table(rows_of(args.table_from)))
        return 0
    cases = matrix_cases(tuple(args.tp2.split(",")))
    if args.family:
        cases = [c for c in cases if c[0] in args.family]
    args.root.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with EmbeddedMaster(MasterConfig(log_dir=args.root / "master")) as master:
        holder = SegmentHolder(
            master.master_address, master.metadata_url, 512 << 20, log_dir=args.root
        ).start()
        try:
            settings = Settings(
                master=master.master_address,
                metadata=master.metadata_url,
                segment_bytes=0,
                local_segment=holder.segment,
            )
            with StoreClient(settings) as store:
                for family, tied, tp in cases:
                    launched = launch_family(
                        family, tied, tp, args.root, settings, store, compiled=args.compiled
                    )
                    run = finish_family(launched, store)
                    row = asdict(run)
                    for mode in ("compat", "direct", "rank_major"):
                        if row[mode] is not None:
                            row[mode].pop("result")
                    runs.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            holder.stop()
    print(table(runs))
    passed = [
        r["error"]
        or (r["direct"]["ok"] and r["compat"]["ok"] and (r["rank_major"] or {"ok": 1})["ok"])
        for r in runs
    ]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
