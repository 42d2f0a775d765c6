"""The docs against the code: docs/reference.md regenerated and compared, every
``mooncake-rl`` command the quick starts show parsed by the real parser, every relative link
resolved. No engine, no Store."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mooncake_rl.cli import build_parser
from tools import check_links, docs_reference

ROOT = Path(__file__).resolve().parent.parent
COMMAND_PAGES = ("README.md", "docs/deployment.md", "docs/sglang.md", "docs/performance.md")


def test_reference_md_matches_the_code() -> None:
    current = docs_reference.REFERENCE.read_text()
    regenerated = docs_reference.rewrite(current, docs_reference.generated())
    assert regenerated == current, (
        "docs/reference.md has drifted from the code: run `python -m tools.docs_reference --write`"
    )


def test_a_drifted_reference_is_told_apart() -> None:
    current = docs_reference.REFERENCE.read_text()
    drifted = current.replace("`MOONCAKE_RL_MASTER`", "`MOONCAKE_RL_MASTERS`", 1)
    assert drifted != current
    assert docs_reference.rewrite(drifted, docs_reference.generated()) == current
    with pytest.raises(SystemExit, match="markers of section 'routes'"):
        docs_reference.rewrite(current.replace("<!-- generated: routes -->", ""), {"routes": ""})


def test_every_route_of_the_code_is_in_the_reference() -> None:
    routes = "\n".join(docs_reference.routes_section())
    for key in docs_reference.ROUTE_NOTES:
        method, path = key.split()
        assert f"| `{method}` | `{path}` |" in routes


def _shell_commands(text: str) -> list[str]:
    """Each command of the page's ```bash blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            for part in re.split(r"&&|;", line):
                commands.append(part.strip())
    return commands


def _mooncake_rl_argv(command: str) -> list[str] | None:
    """The arguments after ``mooncake-rl`` in one shell command, or None for another tool."""
    command = re.sub(r"\$\([^)]*\)", "VALUE", command)  # $(hostname -i) -> one word
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words or Path(words[0]).name != "mooncake-rl":
        return None
    return words[1:]


def _documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in COMMAND_PAGES:
        for command in _shell_commands((ROOT / page).read_text()):
            argv = _mooncake_rl_argv(command)
            if argv is not None and argv[:1] != ["bench"]:  # bench parses its own flags
                found.append((f"{page}: {command}", argv))
    return found


def test_the_quick_start_has_commands_to_check() -> None:
    readme = [where for where, _ in _documented_commands() if where.startswith("README.md")]
    assert any(" update " in where for where in readme)
    assert any(" publish " in where for where in readme)


@pytest.mark.parametrize(
    ("where", "argv"), _documented_commands(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_documented_commands_parse(where: str, argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit as error:  # argparse's refusal of an unknown or malformed flag
        pytest.fail(f"{where}: mooncake-rl refuses it (exit {error.code})")


def test_relative_links_resolve() -> None:
    assert check_links.broken_links() == []


def test_the_link_checker_finds_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n[b](b.md) [self](#a-page) [x](#nope)\n")
    (tmp_path / "README.md").write_text("[a](docs/a.md#a-page) [c](docs/c.md)\n")
    assert sorted(check_links.broken_links(tmp_path)) == [
        "README.md: docs/c.md: no such file",
        "docs/a.md: #nope: no heading with that anchor",
        "docs/a.md: b.md: no such file",
    ]
