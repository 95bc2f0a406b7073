"""Commands that show a run: watch (the Textual dashboard) and report (PNG plots + Markdown)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import AcceptNewOpt, JsonOpt, OptRunArg, RunArg, emit_json, progress
from dilococtl.errors import BadInput


@app.command()
def watch(
    run: OptRunArg = None,
    refresh: Annotated[float, typer.Option("--refresh", help="Seconds between two refreshes.")] = 2.0,
    collect: Annotated[bool, typer.Option(
        "--collect/--no-collect", help="Pull new metrics from the nodes of an active run (else: the store only).")] = True,
    accept_new: AcceptNewOpt = False,
) -> None:
    """Dashboard of a run (default: the newest active run, else the newest): sites, curves, events."""
    if refresh <= 0:
        raise BadInput(f"--refresh must be > 0 seconds, got {refresh}")
    from dilococtl import queries
    from dilococtl.store import Store

    with Store.open() as store:  # an unknown run is a one-line error before the screen opens
        picked = queries.pick_run(store, run)
        store_path = store.path
    from dilococtl.tui.app import make_app

    make_app(picked.id if picked else None, store_path, collect=collect, refresh_s=refresh,
             accept_new=accept_new).run()


@app.command()
def report(
    run: RunArg,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Directory for the files (default: DILOCOCTL_HOME/runs/RUN_ID/report).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """PNG plots (perplexity vs tokens, efficiency and sync per round) and a Markdown summary."""
    from dilococtl import report as report_mod
    from dilococtl.paths import runs_dir
    from dilococtl.store import Store

    with Store.open() as store:
        r = store.get_run(run)
        out_dir = out if out is not None else runs_dir() / r.id / "report"
        files = report_mod.write_report(store, r.id, out_dir)
    if json_out:
        emit_json({"run": r.id, "files": [str(f) for f in files]})
        return
    progress(f"report of run {r.id} written to {out_dir}")
    for f in files:
        print(f)
