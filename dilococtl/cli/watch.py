"""Commands that show a run: watch (the Textual dashboard) and report (PNG plots + Markdown)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import (
    AcceptNewOpt,
    JsonOpt,
    OptRunArg,
    RefreshOpt,
    emit_json,
    progress,
)
from dilococtl.errors import BadInput
from dilococtl.lookup import pick_run, read_store


@app.command()
def watch(
    run: OptRunArg = None,
    interval: Annotated[float, typer.Option("--interval", "-n", help="Seconds between two updates.")] = 2.0,
    refresh: RefreshOpt = True,
    accept_new: AcceptNewOpt = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="No screen: one JSON object a line (what `status --json` shows) every --interval, "
        "until the run ends.")] = False,
) -> None:
    """Dashboard of a run (default: the newest active run, else the newest): sites, curves, events.

    Example: dilococtl watch local-2site -n 5
    """
    import math

    if not (math.isfinite(interval) and interval > 0):
        raise BadInput(f"--interval must be > 0 seconds, got {interval}")
    if json_out:
        _watch_json(run, interval, refresh, accept_new)
        return
    from dilococtl import queries
    from dilococtl.paths import db_path

    with read_store() as store:  # an unknown run is a one-line error before the screen opens
        picked = queries.watched_run(store, run) if store is not None else (pick_run(None, run) if run else None)
    store_path = db_path()  # no runs yet: the view waits for the first (the store appears with it)
    from dilococtl.tui.app import make_app

    make_app(picked.id if picked else None, store_path, collect=refresh, refresh_s=interval,
             accept_new=accept_new).run()


def _watch_json(run: str | None, interval: float, refresh: bool, accept_new: bool) -> None:
    import json
    import sys
    import time

    from dilococtl import runs as runs_mod
    from dilococtl.nodes import NodePool
    from dilococtl.states import ACTIVE_RUN_STATES

    with read_store() as store:
        r = pick_run(store, run)
        with NodePool(r.spec().ssh, accept_new=accept_new) as pool:
            while True:
                if refresh and r.state in ACTIVE_RUN_STATES:
                    r = runs_mod.refresh(r, store=store, pool=pool)
                else:
                    r = store.get_run(r.id)
                sys.stdout.write(json.dumps(runs_mod.run_summary(r, store), default=str) + "\n")
                sys.stdout.flush()
                if r.state not in ACTIVE_RUN_STATES:
                    return
                time.sleep(interval)


@app.command()
def report(
    run: OptRunArg = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Directory for the files (default: DILOCOCTL_HOME/runs/RUN_ID/report).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """PNG plots (perplexity vs tokens, efficiency, sync and lost time by cause per round), goodput.json and a
    Markdown summary.

    Example: dilococtl report local-2site --out report/
    """
    from dilococtl import report as report_mod
    from dilococtl.paths import runs_dir

    with read_store() as store:
        r = pick_run(store, run)
        out_dir = out if out is not None else runs_dir() / r.id / "report"
        files = report_mod.write_report(store, r.id, out_dir)
    if json_out:
        emit_json({"run": r.id, "files": [str(f) for f in files], **report_mod.report_json(files)})
        return
    progress(f"report of run {r.id} written to {out_dir}")
    for f in files:
        print(f)
