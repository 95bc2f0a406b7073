"""docs/cli.md is the command reference, and it says what the live CLI says.

Three holds: the file is exactly what `python -m dilococtl.cli.reference` prints (else: run `make
docs`); it has a section for every command of the app's click tree; and for a handful of commands,
every option that the real `dilococtl CMD --help` prints (run as a user runs it, in a subprocess) is
in that command's table in docs/cli.md. So an option added, renamed or removed in the code fails
here until the reference is regenerated, and the reference cannot drift from --help unseen.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from dilococtl.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "cli.md"
STALE = "docs/cli.md is out of date with the commands: run `make docs` and commit docs/cli.md"

# Commands whose live --help is read: plain and grouped, flags, short names, --x/--no-x, typed options.
LIVE = [(), ("launch",), ("status",), ("logs",), ("runs",), ("runs", "rm"), ("lab", "up"), ("data", "prepare")]


def doc_text() -> str:
    assert DOC.exists(), f"docs/cli.md is missing: run `make docs` ({STALE})"
    return DOC.read_text()


def sections(text: str) -> dict[str, str]:
    """`## dilococtl ...` heading -> the text up to the next heading."""
    out = {}
    for m in re.finditer(r"^## (dilococtl[^\n]*)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S):
        out[m.group(1).strip()] = m.group(2)
    return out


def table_names(section: str) -> set[str]:
    """Every option name in the first column of a section's Option and Argument tables."""
    names = set()
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)` \|", line)
        if m:
            names.update(t.rstrip(",") for t in m.group(1).split() if t.startswith("-"))
    return names


def live_commands(cmd=None, path=("dilococtl",)):
    """Every visible command path of the app's click tree, walked here (not by the generator)."""
    cmd = cmd or typer.main.get_command(app)
    yield " ".join(path)
    if hasattr(cmd, "list_commands"):
        ctx = typer.Context(cmd)
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from live_commands(sub, (*path, name))


OPT_TOKEN = re.compile(r"^--?[A-Za-z0-9][\w-]*,?$")


def live_options(path: tuple[str, ...]) -> set[str]:
    """The option names `dilococtl PATH --help` prints, read off its screen (rich's panels or click's
    plain list): the leading cells of each row that starts with a dash."""
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}
    p = subprocess.run([sys.executable, "-m", "dilococtl", *path, "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    found = set()
    for line in p.stdout.splitlines():
        m = re.match(r"^(?:│ +(?:\* +)?|  )(-.*)$", line)  # rich marks a required option `*`
        if not m:
            continue
        # rich: `│ --site  -s  <str>  Only this site.`; click: `  -s, --site <str>  Only this site.`
        for cell in re.split(r"\s{2,}", m.group(1).rstrip(" │")):
            tokens = [t for t in re.split(r"[\s/]+", cell) if t]
            names = [t for t in tokens if OPT_TOKEN.match(t)]
            found.update(t.rstrip(",") for t in names)
            if not tokens or len(names) < len(tokens):
                break  # the type or the help: the names are behind
    assert found, f"no options read from `dilococtl {' '.join(path)} --help`:\n{p.stdout}"
    return found


def test_docs_cli_md_is_the_generated_reference():
    # in a fresh process, as `make docs` and `dilococtl CMD --help` run: typer's usage line of a
    # required argument reads `{SPEC}` once another command's rich --help ran in the same process
    p = subprocess.run([sys.executable, "-m", "dilococtl.cli.reference"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert doc_text() == p.stdout, STALE


def test_the_reference_has_every_command_of_the_app():
    documented = set(sections(doc_text()))
    live = list(live_commands())
    missing = [c for c in live if c not in documented]
    assert not missing, f"commands without a section in docs/cli.md: {missing}; {STALE}"
    extra = documented - set(live)
    assert not extra, f"docs/cli.md documents commands the app does not have: {sorted(extra)}; {STALE}"


@pytest.mark.parametrize("path", LIVE, ids=lambda p: " ".join(p) or "root")
def test_every_option_of_the_live_help_is_in_the_reference(path):
    heading = " ".join(("dilococtl", *path))
    section = sections(doc_text()).get(heading)
    assert section is not None, f"no `## {heading}` in docs/cli.md; {STALE}"
    live = live_options(path) - {"-h", "--help"}  # said once at the top of the reference
    documented = table_names(section)
    missing = sorted(live - documented)
    assert not missing, f"`{heading} --help` has {missing}, docs/cli.md's section does not; {STALE}"
    gone = sorted(documented - live)
    assert not gone, f"docs/cli.md's `{heading}` has {gone}, its live --help does not; {STALE}"


def test_the_live_help_reader_reads_options():
    """The reader above finds what it must (so an empty read cannot pass the test above)."""
    opts = live_options(("logs",))
    assert {"--site", "-s", "--refresh", "--no-refresh", "--json", "--help", "-h"} <= opts
    # `runs` lists `rm` as "... with --files, ...": a command's help names options it does not have
    assert "--files" not in live_options(("runs",))


def test_the_reference_does_not_depend_on_the_terminal_or_home(tmp_path):
    env = {**os.environ, "COLUMNS": "40", "FORCE_COLOR": "1", "TERM": "xterm-256color",
           "DILOCOCTL_HOME": str(tmp_path / "elsewhere")}
    p = subprocess.run([sys.executable, "-m", "dilococtl.cli.reference"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == doc_text(), STALE
    assert not (tmp_path / "elsewhere").exists()  # generating it records nothing


def test_only_the_cli_imports_the_generator():
    """Library code (dilococtl/ outside cli/, trainer/) never imports dilococtl.cli.reference."""
    offenders = []
    for pkg in ("dilococtl", "trainer"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path.is_relative_to(ROOT / "dilococtl" / "cli"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module else []
                if any(n.startswith("dilococtl.cli.reference") for n in names):
                    offenders.append(str(path.relative_to(ROOT)))
    assert not offenders
