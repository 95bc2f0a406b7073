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

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
SpecArg = Annotated[Path, typer.Argument(help="Run spec (TOML).", show_default=False)]
RunArg = Annotated[str, typer.Argument(help="Run id or name.", show_default=False)]
OptRunArg = Annotated[str | None, typer.Argument(help="Run id or name (default: the newest).", show_default=False)]
SiteOpt = Annotated[str | None, typer.Option("--site", "-s", help="Only this site.")]
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
    console().print(f"[dim]{msg}[/dim]")
