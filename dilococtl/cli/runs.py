"""Commands over runs: launch, status, stop (logs: dilococtl/cli/logs.py; runs: dilococtl/cli/records.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import (
    AcceptNewOpt,
    JsonOpt,
    OptRunArg,
    RunArg,
    SpecArg,
    YesOpt,
    confirm,
    emit_json,
    print_table,
    progress,
)
from dilococtl.errors import EXIT_FAILED, DilocoError
from dilococtl.lookup import pick_run, read_store
from dilococtl.states import ACTIVE_RUN_STATES, LIVE_SITE_STATES, RunState


def _print_summary(summary: dict) -> None:
    from dilococtl.columns import SITE_COLUMNS, text_cells

    cells = [text_cells(s, summary["rounds_planned"]) for s in summary["sites"]]
    print_table(
        f"run {summary['id']} ({summary['name']}): {summary['state']}"
        + (f" — {summary['reason']}" if summary.get("reason") else ""),
        [c.name for c in SITE_COLUMNS], [[row[c.key] for c in SITE_COLUMNS] for row in cells])
    if summary.get("sync_share") is not None:
        from dilococtl import fmt

        m = summary.get("metrics") or {}
        line = f"sync share of round time (compute + sync): {fmt.pct(summary['sync_share'])}"
        if m.get("round_s"):  # the same sums as report's summary and watch (dilococtl/metrics.py)
            line += f" ({m['sync_s']:.1f} s of {m['round_s']:.1f} s, summed over the sites' rounds)"
        if summary.get("predicted_sync_share") is not None:
            line += f" (tune-h predicted {fmt.pct(summary['predicted_sync_share'])} for H={summary['h']})"
        print(line)
        if m.get("sync_share_of_wall") is not None:
            print(f"sync share of wall time: {fmt.pct(m['sync_share_of_wall'])} "
                  f"(a site's mean sync seconds in {m['wall_s']:.1f} s since launch)")
        if m.get("goodput") is not None:  # dilococtl/goodput.py
            lost = ", ".join(f"{cause.replace('_', ' ')} {s:.1f} s" for cause, s in m["lost_s"].items() if s >= 0.05)
            print(f"goodput {fmt.pct(m['goodput'])} of the sites' wall time" + (f"; lost: {lost}" if lost else ""))
    if st := summary.get("stalled"):
        import time as _time

        print(f"STALLED since {_time.strftime('%H:%M:%S', _time.localtime(st['since']))} "
              f"({_time.time() - st['since']:.0f} s; {', '.join(st['sites'])}): {st['cause']}")
    for site, job in (summary.get("jobs") or {}).items():  # Slurm sites: the job's state, reason, nodes
        print(f"{site}: {job['detail'] or 'job ' + job['job_id'] + ' submitted'}")
    for e in summary.get("problems") or []:
        where = " ".join(x for x in (e["site"], f"round {e['round']}" if e["round"] is not None else "") if x)
        print(f"{e['event']}: {where}: {e['message']}" if where else f"{e['event']}: {e['message']}")


def _show_plan(p: dict) -> None:
    """The launch plan, on stderr (stdout keeps the run id or the JSON)."""
    progress(f"plan: {p['name']}: {len(p['sites'])} site(s), {p['nodes']} node(s), {p['processes']} process(es); "
             f"H {p['h']}, {p['rounds']} rounds, mode {p['mode']}; lighthouse {p['lighthouse']}")
    for s in p["sites"]:
        progress(f"  {s['name']}: {', '.join(s['hosts'])} ({s['processes']} process(es))")
    share = p["predicted_sync_share"]
    progress(f"  predicted sync share: {share * 100:.1f}% (tune-h)" if share is not None
             else "  predicted sync share: unknown (`dilococtl tune-h SPEC` measures it)")
    if p.get("land") is not None:
        progress(f"  the update lands {p['land'] * 100:.1f}% into the next round (tune-h's exchange)")
    if p.get("transport") is not None:
        from dilococtl.derive_transport import describe

        progress(f"  {describe(p['transport'])}")
    if p.get("grace") is not None:
        from dilococtl.grace import describe as describe_grace

        progress(f"  {describe_grace(p['grace'])}")
    progress("  writes to: " + "; ".join(p["writes"]))


@app.command()
def launch(
    spec_path: SpecArg,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the command of every node; start nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Stop an active run of the same name first.")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the run until it ends; exit 1 if it failed.")] = False,
    accept_new: AcceptNewOpt = False,
    yes: YesOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Record a run and start the Lighthouse and torchrun on every node.

    Shows the plan (sites, nodes, H, predicted sync share, where the run writes) and asks before
    starting anything, unless --yes or stdin is not a terminal (scripts, CI).

    Example: dilococtl launch playbooks/local-2site.toml --wait
    """
    from dilococtl import plan as plan_mod
    from dilococtl.spec import load_spec
    from dilococtl.spec_summary import notes
    from dilococtl.store import Store

    spec = load_spec(spec_path)
    from dilococtl.sinks import check_installed

    check_installed(spec.metrics.sinks)  # as spec check: a sink's missing package, before anything starts
    for line in notes(spec):
        progress(f"note: {line}")
    if dry_run:
        from dilococtl import grace
        from dilococtl.paths import db_path

        if spec.diloco.grace and db_path(create=False).exists():  # the window launch would set; a dry run
            with Store.open() as store:  # makes no store
                spec, _ = grace.apply(spec, store, progress)
        plan = plan_mod.build(spec, "RUN_ID", make_keys=False)
        if json_out:
            relay = plan.lighthouse.relay
            emit_json({"lighthouse": {"host": plan.lighthouse.host, "command": plan.lighthouse.command},
                       "relay": {"host": relay.host, "command": relay.command_for("DOOR")}
                       if relay else None,
                       "nodes": [{"site": n.site, "host": n.host, "node_rank": n.node_rank, "nnodes": n.nnodes,
                                  "nproc": n.nproc, "command": n.command} for n in plan.nodes]})
            return
        what = "outer parameter service" if plan.lighthouse.kind == "outer_service" else "lighthouse"
        print(f"# {what} on {plan.lighthouse.host}\n{plan.lighthouse.command}")
        if plan.lighthouse.relay:  # DOOR: the Lighthouse's door (trainer.service.lighthouse --door), known once it runs
            print(f"# its TLS relay on {plan.lighthouse.relay.host}\n{plan.lighthouse.relay.command_for('DOOR')}")
        for n in plan.nodes:
            print(f"# {n.site} node {n.node_rank}/{n.nnodes} on {n.host}\n{n.command}")
        from dilococtl.site_backend import dry_run_script

        for j in plan.jobs:  # Slurm sites: the batch script sbatch gets through the login node
            print(f"# {j.site}: Slurm job of {j.nnodes} node(s), submitted on {j.login}\n{dry_run_script(spec, j)}")
        return

    from dilococtl import runs as runs_mod
    from dilococtl.data_check import check_local
    from dilococtl.nodes import NodePool

    for line in check_local(spec):  # local data: doctor's checks before the plan is shown; a failure is exit 2
        progress(f"note: {line}")
    with Store.open() as store:
        plan_info = runs_mod.plan_summary(spec, store)
        _show_plan(plan_info)
        if not confirm(f"start {plan_info['processes']} process(es) on {plan_info['nodes']} node(s)?", yes=yes):
            progress("nothing started")
            raise SystemExit(EXIT_FAILED)
        res = runs_mod.launch(spec, store=store, force=force, accept_new=accept_new, progress=progress)
        run = res.run
        progress(f"run {run.id} launched: {len(res.plan.nodes)} node(s) in {len(spec.sites)} site(s)")
        if not wait:
            # supervision (a coordinator restarted or moved, dilococtl/supervise.py) runs in the collector
            progress(f"supervised while a collector runs: dilococtl watch {run.id} (or resume {run.id} --auto)")
            if json_out:
                emit_json({"id": run.id, "name": run.name, "state": run.state, "started": res.started})
            else:
                print(run.id)
            return
        with NodePool(spec.ssh, accept_new=accept_new) as pool:
            run = runs_mod.wait(run, store=store, pool=pool, progress=progress)
        summary = runs_mod.run_summary(run, store)
    if json_out:
        emit_json(summary)
    else:
        _print_summary(summary)
    if run.state != RunState.FINISHED:
        raise typer.Exit(EXIT_FAILED)


@app.command()
def status(run: OptRunArg = None, json_out: JsonOpt = False,
           refresh: Annotated[bool, typer.Option("--refresh/--no-refresh",
                                                 help="Collect from the nodes first.")] = True,
           accept_new: AcceptNewOpt = False) -> None:
    """Per site: state, round, step, efficiency, last sync seconds, perplexity.

    Example: dilococtl status local-2site --json
    """
    from dilococtl import runs as runs_mod
    from dilococtl.nodes import NodePool

    with read_store() as store:
        r = pick_run(store, run)
        if refresh and r.state in ACTIVE_RUN_STATES:
            with NodePool(r.spec().ssh, accept_new=accept_new) as pool:
                r = runs_mod.refresh(r, store=store, pool=pool)
        summary = runs_mod.run_summary(r, store)
    if json_out:
        emit_json(summary)
    else:
        _print_summary(summary)


@app.command()
def stop(run: RunArg,
         grace: Annotated[float, typer.Option("--grace", help="Seconds between SIGTERM and SIGKILL.")] = 30.0,
         force: Annotated[bool, typer.Option(
             "--force", help="End the run's record even if its nodes or stored spec cannot be used.")] = False,
         json_out: JsonOpt = False, accept_new: AcceptNewOpt = False) -> None:
    """Stop a run: SIGTERM to every process, SIGKILL after the grace period.

    Example: dilococtl stop local-2site --grace 60
    """
    from dilococtl import runs as runs_mod
    from dilococtl.store import Store

    with Store.open() as store:
        r = store.get_run(run)
        if r.state not in ACTIVE_RUN_STATES and not any(n.pid and n.state in LIVE_SITE_STATES
                                                        for n in store.nodes(r.id)):
            # an ended run: nothing to signal, and saying so beats a silent status table (as resume does)
            if json_out:
                emit_json({"id": r.id, "name": r.name, "state": r.state, "reason": r.exit_reason, "stopped": False})
            else:
                print(f"nothing to stop: run {r.id} {r.state}" + (f" ({r.exit_reason})" if r.exit_reason else ""))
            return
        r = runs_mod.stop(r, store=store, grace_s=grace, progress=progress, accept_new=accept_new, force=force)
        try:
            summary = runs_mod.run_summary(r, store)
        except DilocoError:
            if not force:
                raise
            # the record is ended; what cannot be summed up (a damaged stored spec) is not shown
            summary = {"id": r.id, "name": r.name, "state": r.state, "reason": r.exit_reason, "sites": []}
    if json_out:
        emit_json(summary)
    else:
        _print_summary(summary)
