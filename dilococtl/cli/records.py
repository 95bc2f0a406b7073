"""`dilococtl runs` (the recorded runs, filtered) and `dilococtl runs rm` (forget old ones)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from dilococtl import fmt
from dilococtl.cli import app
from dilococtl.cli._common import (
    JsonOpt,
    YesOpt,
    confirm,
    emit_json,
    print_table,
    progress,
)
from dilococtl.errors import EXIT_FAILED
from dilococtl.lookup import NO_RUNS, read_store

runs_app = typer.Typer(name="runs", invoke_without_command=True)  # help: list_cmd's docstring
app.add_typer(runs_app, name="runs")


@runs_app.callback()
def list_cmd(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option("--state", help="Only runs in this state (running, finished...).")]
    = None,
    name: Annotated[str | None, typer.Option("--name", help="Only runs of this name (a glob: 'lab-*').")] = None,
    since: Annotated[str | None, typer.Option(
        "--since", help="Only runs launched since: a duration (2h, 7d) or a time (2026-12-01T08:00).")] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="At most this many (the newest).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """List recorded runs, newest first: state, duration, rounds, final perplexity, why it ended.

    `runs rm RUN...` forgets old ones.

    Example: dilococtl runs --state finished --since 7d
    """
    if ctx.invoked_subcommand is not None:
        return
    from dilococtl import records
    from dilococtl.logs import parse_since

    records.check_filters(state=state, limit=limit)  # a typo is an error even where there are no runs
    t_since = parse_since(since) if since else None
    with read_store() as store:
        rows = [] if store is None else records.list_runs(store, state=state, name=name, since=t_since, limit=limit)
    if json_out:
        emit_json([r.to_json() for r in rows])
        return
    if not rows:
        progress(NO_RUNS if store is None else "no run matches")
        return
    print_table(None, ["id", "name", "state", "created", "duration", "rounds", "final ppl", "ended because"],
                [[r.id, r.name, r.state, time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created)),
                  fmt.duration(r.duration_s, days=False, short=True), f"{r.rounds}/{r.rounds_planned}",
                  "-" if r.final_val_ppl is None else f"{r.final_val_ppl:.3f}", r.reason or ""] for r in rows])


@runs_app.command("rm")
def rm_cmd(
    runs: Annotated[list[str], typer.Argument(metavar="RUN...", help="Run ids, id prefixes or names.",
                                              show_default=False)],
    files: Annotated[bool, typer.Option(
        "--files", help="Also delete the run's directory on every node (checkpoints, logs) and its local report.")]
    = False,
    yes: YesOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Forget ended runs: their records and, with --files, their files. Asks first (without a terminal: --yes).

    Example: dilococtl runs rm 20261201-204155-42ab --files --yes
    """
    from dilococtl import records
    from dilococtl.lookup import pick_run

    with read_store() as store:
        picked = {}
        for name in runs:
            r = pick_run(store, name)
            picked[r.id] = r
        targets = list(picked.values())
        records.check_removable(targets)
        what = ", ".join(r.id for r in targets) + (" and their files" if files else "")
        if not confirm(f"forget {what}?", yes=yes, unattended=False):
            progress("nothing removed")
            raise SystemExit(EXIT_FAILED)

        def pool_factory(run):
            from dilococtl.nodes import NodePool

            return NodePool(run.spec().ssh)

        from dilococtl.paths import runs_dir

        removed = records.remove_runs(store, targets, files=files, pool_factory=pool_factory,
                                      local_dir=lambda rid: runs_dir() / rid, progress=progress)
    if json_out:
        emit_json([x.to_json() for x in removed])
    else:
        for x in removed:
            print(f"removed {x.id} ({x.name})" + (f": {', '.join(x.files)}" if x.files else ""))
    errors = [e for x in removed for e in x.errors]
    for e in errors:
        progress(f"could not remove {e}")
    if errors:
        raise SystemExit(EXIT_FAILED)
