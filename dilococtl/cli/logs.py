"""`dilococtl logs [RUN]`: rounds, events and trainer logs of a run, merged by time (dilococtl.logs)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import (
    AcceptNewOpt,
    JsonOpt,
    OptRunArg,
    RefreshOpt,
    SiteOpt,
    progress,
)
from dilococtl.errors import EXIT_UNREACHABLE, BadInput
from dilococtl.lookup import pick_run, read_store

FOLLOW_S = 2.0  # --follow: seconds between two looks


@app.command()
def logs(
    run: OptRunArg = None,
    site: SiteOpt = None,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Keep printing new lines; ends when the run has ended.")] = False,
    tail: Annotated[int | None, typer.Option("--tail", "-n", help="Only the last N lines (then follow).")] = None,
    since: Annotated[str | None, typer.Option(
        "--since", help="Only lines written since: a duration (90s, 10m, 2h, 1d) or a time (20:40, 2026-12-01T20:40).")]
    = None,
    grep: Annotated[str | None, typer.Option(
        "--grep", "-g", help="Only lines matching this regular expression (case-insensitive).")] = None,
    all_lines: Annotated[bool, typer.Option(
        "--all", "-a", help="Also the libraries' chatter (torchft INFO lines, HTTP access lines...), hidden by default.")]
    = False,
    lighthouse: Annotated[bool, typer.Option("--lighthouse", help="Also the Lighthouse's log and its TLS relay's.")] = False,
    refresh: RefreshOpt = True,
    accept_new: AcceptNewOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """A run's rounds (loss, val ppl, sync s, K), events and trainer logs, all sites merged by time.

    Example: dilococtl logs --site site-a --since 10m -f
    """
    from dilococtl import logs as logs_mod

    if tail is not None and tail < 0:
        raise BadInput(f"--tail must be >= 0, got {tail}")
    flt = logs_mod.Filter(site=site, since=logs_mod.parse_since(since) if since else None,
                          grep=logs_mod.compile_grep(grep), all=all_lines)
    with read_store() as store:
        r = pick_run(store, run)
        reader = logs_mod.RunLogs(r, store, lighthouse=lighthouse)
        names = reader.sites()
        if site is not None and site not in names:
            raise BadInput(f"run {r.id} has no site {site!r} (sites: {', '.join(names)})")
        width = max([len(f.site) + (len(f"/node{f.node}") if f.node is not None else 0) for f in reader.files]
                    + [len(n) for n in names] + [3])
        out = _Printer(json_out, width)
        from dilococtl import runs as runs_mod
        from dilococtl.nodes import NodePool
        from dilococtl.states import ACTIVE_RUN_STATES

        with NodePool(r.spec().ssh, accept_new=accept_new) as pool:
            if refresh and r.state in ACTIVE_RUN_STATES:
                r = runs_mod.refresh(r, store=store, pool=pool)
            ended = r.state not in ACTIVE_RUN_STATES
            out.show(logs_mod.select(reader.poll(pool, final=ended or not follow), flt, tail))
            while follow and not ended:
                time.sleep(FOLLOW_S)
                r = runs_mod.refresh(r, store=store, pool=pool) if refresh else store.get_run(r.id)
                ended = r.state not in ACTIVE_RUN_STATES
                out.show(logs_mod.select(reader.poll(pool, final=ended), flt))
            if follow:
                progress(f"run {r.id} {r.state}" + (f": {r.exit_reason}" if r.exit_reason else ""))
    for host, why in reader.errors.items():
        progress(f"{host}: could not read its log: {why}")
    if reader.errors:
        raise SystemExit(EXIT_UNREACHABLE)


class _Printer:
    def __init__(self, json_out: bool, width: int) -> None:
        self.json_out = json_out
        self.width = width

    def show(self, lines) -> None:
        for ln in lines:
            sys.stdout.write((json.dumps(ln.to_json()) if self.json_out else ln.render(self.width)) + "\n")
        sys.stdout.flush()
