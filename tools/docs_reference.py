"""The generated parts of ``docs/reference.md``, read from the code itself.

    python -m tools.docs_reference            # print the generated sections
    python -m tools.docs_reference --write    # rewrite them in docs/reference.md
    python -m tools.docs_reference --check    # exit 1 when docs/reference.md has drifted

Sources: the ``mooncake-rl`` argument parser (``mooncake_rl.cli.build_parser``), the settings
object (``mooncake_rl.settings.Settings``), the engines' route table
(``engine_ext.routes.build_router``) and the ``EXIT_*`` constants of ``update``
(``mooncake_rl/commands/engines.py``).
Each generated section sits in docs/reference.md between ``<!-- generated: NAME -->`` and
``<!-- end generated: NAME -->``; everything outside those markers is written by hand.

It lives in ``tools/`` rather than in ``mooncake_rl``: it imports the engine adapters'
routes, which the framework-neutral core never imports, and it is no benchmark. Nothing
here is installed with the package.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"
MiB = 1 << 20

CLIENT_FLAGS = ("--master", "--metadata", "--protocol", "--hostname", "--node", "--local-segment")
"""The Store client's flags every command that opens a Store takes
(``mooncake_rl.commands.store_client.add_client_flags``)."""

ROUTE_NOTES = {
    "GET /mooncake/status": "the engine's receiver state, served generation and session",
    "GET /mooncake/placement": "each worker's description of what it holds; "
    "`?boxes=false` leaves the regions and shards out (its `placement_digest` still names "
    "them): a coordinator reads the boxes only to plan a table it does not hold",
    "POST /mooncake/drain": "open an update session (id, holder, lease TTL); the engine "
    "keeps serving",
    "POST /mooncake/renew": "renew the session's lease",
    "POST /mooncake/prepare": "stage and register receive memory from the routing slices; "
    "touches no live weight",
    "POST /mooncake/apply": "run one apply stage of the routing table while the engine serves",
    "POST /mooncake/commit": "pause, land, check against a fresh load, reset caches, resume "
    "on the new generation",
    "POST /mooncake/abort": "end the session without commit: the old generation is served",
    "POST /mooncake/resume": "the same call as abort (the contract's name for it)",
    "POST /mooncake/rebuild": "reload the Store's active generation",
    "POST /mooncake/adapter": "make a generation of the engine's LoRA adapter resident beside "
    "the base (default: the Store's active one): `POLICY@G` names it, `POLICY` the newest",
    "POST /mooncake/bucket": "a CPU-serialized bucket (safetensors) as the raw body; session, "
    "generation and stage in the query (`BucketUpload`)",
    "GET /mooncake/ready": "200 only while the engine serves a complete generation, else "
    "503; no token: point readiness probes and routers here",
}
"""What each route does, one line each. The route list itself comes from the code: a route
without a line here, or a line without a route, fails generation (and the test)."""

UNTOKENED = {"GET /mooncake/ready"}

OTHER_VARIABLES = {
    "engine_ext.leases.ENGINE_ID_ENV": "an engine's serving-lease id (default `host:port`); "
    "set it when one host runs several engines",
}
"""Variables read outside the settings object, by the constant that names them."""

FIXED_EXIT_CODES = (
    (0, "success"),
    (
        1,
        "`update`: the update failed (its result is printed as JSON); `status`: nothing is "
        "active, or the master lost it; `verify`: the generation failed its check",
    ),
    (
        2,
        "an error the command names (`mooncake-rl: error: ...`), an invalid `MOONCAKE_RL_*` "
        "setting, or bad arguments (argparse)",
    ),
)


def _size(value: int) -> str:
    """Whole GiB or MiB as such, else the number."""
    for unit, name in ((1 << 30, "GiB"), (MiB, "MiB")):
        if value >= unit and value % unit == 0:
            return f"{value // unit} {name}"
    return f"`{value}`"


def _sentence(text: str) -> str:
    text = _cell(text)
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _cell(text: Any) -> str:
    """One Markdown table cell: no newlines, pipes escaped, runs of spaces folded."""
    return re.sub(r"\s+", " ", str(text)).replace("|", "\\|").strip()


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


# -- the command line ---------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest
        return f"`{name}`" + (" (optional)" if action.nargs == "?" else "")
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{names}`"
    if action.choices is not None and not isinstance(action.choices, range):
        return f"`{names} {{{','.join(map(str, action.choices))}}}`"
    metavar = action.metavar or action.dest.upper()
    return f"`{names} {metavar}`"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return ""
    if isinstance(action.default, int) and not isinstance(action.default, bool):
        return _size(action.default) if action.default >= MiB else f"`{action.default}`"
    return f"`{action.default}`"


def _arguments(
    parser: argparse.ArgumentParser,
    *,
    skip: Iterable[str] = (),
    only: Iterable[str] | None = None,
) -> list[Any]:
    """One row per argument: the flags named in ``skip`` left out, or only those in ``only``."""
    skip, kept = set(skip), None if only is None else set(only)
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        flags = set(action.option_strings)
        if flags & skip or (kept is not None and not flags & kept):
            continue
        text = action.help or ""
        if isinstance(action, argparse._AppendAction):
            text = f"{text} (repeat it for several)"
        rows.append((_flag(action), _default(action), text))
    return rows


def cli_section() -> list[str]:
    from mooncake_rl.cli import build_parser

    parser = build_parser()
    out = ["`mooncake-rl [--verbose] COMMAND ...`. Global flags:", ""]
    out += _table(("flag", "default", "meaning"), _arguments(parser))
    commands = _subcommands(parser)
    client = next(
        p for p in commands.values() if set(CLIENT_FLAGS) <= set(p._option_string_actions)
    )
    out += [
        "",
        "Store client flags, taken by every command marked *client* below (each "
        "overrides its `MOONCAKE_RL_*` variable):",
        "",
    ]
    out += _table(
        ("flag", "default", "meaning"),
        _arguments(client, only=CLIENT_FLAGS),
    )
    for name, sub in commands.items():
        takes_client = set(CLIENT_FLAGS) <= set(sub._option_string_actions)
        out += ["", f"### `mooncake-rl {name}`", "", _sentence(_help_of(parser, name))]
        if name == "bench":
            out += [
                "",
                "Parsed by the bench package itself: `mooncake-rl bench --help` and "
                "`mooncake-rl bench SUBCOMMAND --help` list its flags.",
            ]
            continue
        if takes_client:
            out[-1] += " Takes the Store client flags (*client*)."
        rows = _arguments(sub, skip=CLIENT_FLAGS if takes_client else ())
        if rows:
            out += ["", *_table(("argument", "default", "meaning"), rows)]
    return out


# -- settings -----------------------------------------------------------------------------


def _setting_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if isinstance(value, int) and value >= MiB:
        return _size(value)
    if value == "":
        return "empty"
    return f"`{value}`"


def _values(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    if annotation is bool:
        return "`0`, `1`"
    return ""


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


def settings_section() -> list[str]:
    from mooncake_rl.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    rows = []
    for name, field in Settings.model_fields.items():
        rows.append(
            (
                f"`{prefix}{name.upper()}`",
                _values(field.annotation),
                _setting_default(field.default),
                field.description or "",
            )
        )
    for dotted, note in OTHER_VARIABLES.items():
        rows.append((f"`{_resolve(dotted)}`", "", "unset", note))
    return _table(("variable", "values", "default", "meaning"), rows)


# -- routes -------------------------------------------------------------------------------


def _closure(function: Callable[..., Any]) -> dict[str, Any]:
    cells = function.__closure__ or ()
    return dict(zip(function.__code__.co_freevars, (c.cell_contents for c in cells), strict=True))


def routes_section() -> list[str]:
    from engine_ext.routes import build_router

    async def no_receiver(request: Any) -> Any:  # never called: nothing is served
        raise AssertionError("the reference generator serves no request")

    router = build_router(no_receiver, None, max_body_bytes=1)
    rows, seen = [], set()
    for route in router.routes:
        for method in sorted(route.methods):
            key = f"{method} {route.path}"
            seen.add(key)
            if key not in ROUTE_NOTES:
                raise SystemExit(f"route {key} has no line in tools/docs_reference.ROUTE_NOTES")
            cells = _closure(route.endpoint)
            body = cells.get("model") or cells.get("query")
            shape = ""
            if cells.get("query") is not None:
                shape = f"query `{cells['query'].__name__}`"
            elif body is not None:
                shape = f"`{body.__name__}`"
            token = "no" if key in UNTOKENED else "yes"
            rows.append((f"`{method}`", f"`{route.path}`", shape, token, ROUTE_NOTES[key]))
    stale = set(ROUTE_NOTES) - seen
    if stale:
        raise SystemExit(f"ROUTE_NOTES names routes the code no longer has: {sorted(stale)}")
    return _table(("method", "path", "body", "token", "what it does"), rows)


# -- exit codes ---------------------------------------------------------------------------


def _exit_constants() -> list[tuple[int, str, str]]:
    """``EXIT_*`` constants of commands/engines.py with the docstring that follows each."""
    tree = ast.parse((ROOT / "mooncake_rl" / "commands" / "engines.py").read_text())
    found = []
    for node, after in zip(tree.body, [*tree.body[1:], None], strict=True):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if not (isinstance(target, ast.Name) and target.id.startswith("EXIT_")):
            continue
        doc = ""
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            doc = str(after.value.value)
        found.append((ast.literal_eval(node.value), target.id, doc.replace("``", "`")))
    return found


def exit_codes_section() -> list[str]:
    rows = [(f"`{code}`", "", text) for code, text in FIXED_EXIT_CODES]
    rows += [(f"`{code}`", f"`{name}`", doc) for code, name, doc in _exit_constants()]
    return _table(("code", "constant", "meaning"), sorted(rows, key=lambda r: int(r[0][1:-1])))


SECTIONS: dict[str, Callable[[], list[str]]] = {
    "cli": cli_section,
    "settings": settings_section,
    "routes": routes_section,
    "exit-codes": exit_codes_section,
}


def generated() -> dict[str, str]:
    return {name: "\n".join(make()) for name, make in SECTIONS.items()}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- generated: {re.escape(name)} -->)(.*?)(<!-- end generated: {re.escape(name)} -->)",
        re.DOTALL,
    )


def rewrite(text: str, sections: dict[str, str]) -> str:
    """``text`` with every generated block replaced; a missing marker is an error."""
    for name, body in sections.items():
        pattern = _block(name)
        if not pattern.search(text):
            raise SystemExit(f"docs/reference.md lacks the markers of section {name!r}")
        text = pattern.sub(lambda m, body=body: m.group(1) + "\n" + body + "\n" + m.group(3), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs_reference", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite docs/reference.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when it has drifted")
    args = parser.parse_args(argv)
    sections = generated()
    if not (args.write or args.check):
        for name, body in sections.items():
            print(f"<!-- generated: {name} -->\n{body}\n<!-- end generated: {name} -->\n")
        return 0
    current = REFERENCE.read_text()
    wanted = rewrite(current, sections)
    if args.write:
        if wanted != current:
            REFERENCE.write_text(wanted)
        return 0
    if wanted != current:
        print(
            "docs/reference.md has drifted from the code: run "
            "`python -m tools.docs_reference --write`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
