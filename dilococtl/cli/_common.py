"""Options and output helpers shared by every command group.

Progress and human tables go to stderr/stdout through rich; `--json` prints one JSON document on
stdout and nothing else there, so scripts can pipe it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

PLAYBOOKS = "playbooks"  # the example specs: the repository's playbooks/, shipped as dilococtl/playbooks/


def playbook_path(path: Path) -> Path:
    """A SPEC or SCENARIO argument as given; but `playbooks/NAME` (how --help names the examples)
    where there is no playbooks/ directory, as from an installed wheel, is the copy of NAME that
    the package carries, if it has one."""
    if path.parent != Path(PLAYBOOKS) or path.parent.exists():
        return path
    from importlib.resources import files

    bundled = files("dilococtl") / PLAYBOOKS / path.name
    if not bundled.is_file():
        return path
    progress(f"note: no {PLAYBOOKS}/ here; {path} is the example installed with dilococtl: {bundled}")
    return Path(str(bundled))


# One name and one meaning per option across every command.
JsonOpt = Annotated[bool, typer.Option(
    "--json", help="Print machine-readable JSON on stdout (errors too: {\"error\": ..., \"exit\": N}).")]
SpecArg = Annotated[Path, typer.Argument(metavar="SPEC", help="Run spec (TOML).", show_default=False,
                                         callback=playbook_path)]
RunArg = Annotated[str, typer.Argument(metavar="RUN", help="Run id, id prefix or name.", show_default=False)]
OptRunArg = Annotated[str | None, typer.Argument(
    metavar="RUN", help="Run id, id prefix or name (default: the newest run).", show_default=False)]
SiteOpt = Annotated[str | None, typer.Option("--site", "-s", help="Only this site.")]
# --refresh is always this switch: pull new metrics from the nodes of an active run before
# showing it (--no-refresh: what the store has). How often `watch` redraws is --interval.
RefreshOpt = Annotated[bool, typer.Option(
    "--refresh/--no-refresh", help="Collect new metrics from the nodes of an active run first (else: the store only).")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
AcceptNewOpt = Annotated[bool, typer.Option(
    "--accept-new-host-keys", help="Trust SSH host keys seen for the first time (never a changed key).")]


def console(stderr: bool = True):
    """A rich console (stderr by default: stdout is for results)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def print_table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    """A rich table on stdout."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*["" if v is None else str(v) for v in row])
    out = console(stderr=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = max(out.width, 200)  # piped into a log: whole cells, not rich's 80-column cut ("finish…")
    out.print(table)


def progress(msg: str) -> None:
    """One line on stderr, as it is: no markup read into it (a path may hold "[...]"), never wrapped."""
    console().print(msg, style="dim", markup=False, soft_wrap=True)


def interactive() -> bool:
    """Whether a person can answer a question (stdin is a terminal)."""
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):  # closed or replaced stdin
        return False


def confirm(question: str, *, yes: bool, unattended: bool = True) -> bool:
    """Ask on stderr unless `yes`. Without a terminal to ask on: `unattended` (go ahead, as scripts
    and CI expect) or refuse with a one-line BadInput naming --yes (for what cannot be undone)."""
    if yes:
        return True
    if not interactive():
        if unattended:
            return True
        from dilococtl.errors import BadInput

        raise BadInput(f"{question.rstrip('?')}: no terminal to ask on; pass --yes")
    return typer.confirm(question, default=False, err=True)
