"""Operations on runs: launch, collect metrics, derive states, wait, stop.

The CLI (dilococtl/cli/runs.py) is a thin layer over these functions.
"""

from __future__ import annotations

import math
import posixpath
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dilococtl import metrics, procs, queries
from dilococtl import plan as plan_mod
from dilococtl.coordinators import (
    end_lighthouse,
    is_ours,
    lighthouse_alive,
    lighthouse_pids,
    put_files,
    start_coordinator,
)
from dilococtl.errors import BadInput, DilocoError, Unreachable
from dilococtl.nodes import NodePool
from dilococtl.plan import LIGHTHOUSE_SITE, LaunchPlan
from dilococtl.site_backend import cancel_jobs, refresh_jobs, stop_jobs, submit_jobs
from dilococtl.spec_types import RunSpec
from dilococtl.states import ACTIVE_RUN_STATES, LIVE_SITE_STATES, RunState, SiteState
from dilococtl.store import Run, Store
from trainer.records import METRICS_FILE, PROBLEM_EVENTS
from trainer.rules.outer_rule import land_step
from trainer.rules.tables import MAX_WAIT_S

Progress = Callable[[str], None]
STOP_GRACE_S = 30.0  # stop: SIGKILL after this many seconds if SIGTERM was not enough
EXIT_PREEMPTED = 143  # the trainer's exit code after a SIGTERM and a saved checkpoint


def _noop(_msg: str) -> None:
    pass


@dataclass(kw_only=True, slots=True)
class LaunchResult:
    run: Run
    plan: LaunchPlan
    started: list[str] = field(default_factory=list)  # "site/host" of every started process


def plan_summary(spec: RunSpec, store: Store) -> dict[str, Any]:
    """What `launch` is about to start, for the operator to confirm: sites, nodes, processes, H,
    the sync share tune-h predicted for this spec and H (None without a tune), the transport launch
    derives from measured links (None: the spec's), where the run writes."""
    from dilococtl import grace
    from dilococtl.derive_transport import derive
    from dilococtl.spec_summary import summary
    from dilococtl.tune.history import newest_tune, tuned_land

    s = summary(spec)
    derived = derive(spec, store)
    tune = newest_tune(store, spec.path, spec.diloco.h)
    land = tuned_land(store, spec)
    return {"name": s["name"], "sites": [{"name": x["name"], "processes": x["processes"],
                                          "hosts": x["hosts"] or [f"Slurm job of {site.nodes} node(s) via {site.login}"]}
                                         for x, site in zip(s["sites"], spec.sites, strict=True)],
            "nodes": s["nodes"], "processes": s["processes"], "h": s["h"], "rounds": s["rounds"], "mode": s["mode"],
            "predicted_sync_share": tune.prediction.get("sync_share") if tune else None,
            "land": land[0] if land else None,  # overlap, async: tune-h's landing that launch applies
            "transport": derived,  # streams and pacing launch derives from measured links (derive_transport)
            "grace": grace.window(spec, store),  # the Lighthouse's join window launch derives (dilococtl/grace.py)
            "writes": list(dict.fromkeys(  # sites on one host with one work_dir share the directory
                f"{site.login if site.scheduler == 'slurm' else site.hosts[0] if len(site.hosts) == 1 else ','.join(site.hosts)}:"
                f"{posixpath.join(site.work_dir, 'runs', 'RUN_ID')}" for site in spec.sites)),
            "lighthouse": s["lighthouse"]}


def _with_tuned_land(spec: RunSpec, store: Store, run_id: str, progress: Progress) -> RunSpec:
    """`spec` with diloco.overlap_land set from its tune (dilococtl.tune.history.tuned_land), recorded as a `land` event."""
    import dataclasses

    from dilococtl.tune.history import tuned_land

    found = tuned_land(store, spec)
    if found is None:
        return spec
    land, tune_id = found
    steps = land_step(spec.diloco.h, land)
    msg = (f"{spec.diloco.mode}: the update lands {steps} of {spec.diloco.h} steps into the next round, "
           f"when the exchange tune {tune_id} predicted is done")
    progress(msg)
    store.add_event(run_id, "land", msg, detail={"overlap_land": land, "steps": steps, "tune_id": tune_id})
    return dataclasses.replace(spec, diloco=dataclasses.replace(spec.diloco, overlap_land=land))


def launch(spec: RunSpec, *, store: Store, force: bool = False, accept_new: bool = False,
           progress: Progress = _noop, sites: list[str] | None = None, run: Run | None = None,
           reason: str = "launch", resume_round: int | None = None) -> LaunchResult:
    """Record the run, start the Lighthouse and torchrun on every node; all or nothing.

    With `run` given (resume), only `sites` are (re)started under the same run id.
    `resume_round`: every site restarts from that round and waits for the others (see plan.build).
    If any node fails to start, everything this call started is stopped again and the run is
    recorded as failed with the reason.
    """
    fresh = run is None
    if run is None:
        active = store.active_run(spec.run.name)
        if active and not force:
            raise BadInput(f"run {spec.run.name!r} is already active as {active.id} ({active.state}); "
                           f"stop it first or pass --force")
        if active and force:
            stop(active, store=store, progress=progress, reason="replaced by a forced launch")
        from dilococtl import grace

        # before the run is recorded: its spec carries the window to every later start of the Lighthouse
        spec, window = grace.apply(spec, store, progress)
        run = store.create_run(spec)
        if window is not None:
            store.add_event(run.id, grace.EVENT, grace.describe(window), detail=window)
    spec = _with_tuned_land(spec, store, run.id, progress)
    from dilococtl import derive_transport

    spec = derive_transport.apply(spec, store, run.id, fresh=fresh, progress=progress)
    todo: list = []
    jobs: list = []
    started: list[tuple[str, str, int]] = []  # (site, host, pid)
    submitted: list[tuple[str, str, str]] = []  # (site, login, job id) of Slurm sites
    with NodePool(spec.ssh, accept_new=accept_new) as pool:
        try:
            plan = plan_mod.build(spec, run.id, resume_round=resume_round)
            todo = [n for n in plan.nodes if sites is None or n.site in sites]
            # keys and certificates; a partial relaunch copies nothing to the hosts of the sites it leaves
            # alone (one may be down: a coordinator moving away from it relaunches the others)
            others = set() if sites is None else \
                {n.host for n in plan.nodes if n.site not in sites} - {n.host for n in todo} - {plan.lighthouse.host}
            put_files(pool, [f for f in plan.files if f[0] not in others])
            if fresh:  # every fixed port the run binds must be free before anything starts (issue 41)
                from dilococtl import ports

                if found := ports.taken(spec, pool.get):
                    raise DilocoError(ports.refusal(found))
            if sites is None or not lighthouse_alive(run, pool):
                from dilococtl.supervise import CoordinatorLock

                # a collector may be restarting it this moment: the lock, then look again
                with CoordinatorLock(run.id, wait=True):
                    if fresh or not lighthouse_alive(store.get_run(run.id), pool):
                        if not fresh:  # what is left of the old pair (a relay without its Lighthouse) frees the port
                            end_lighthouse(run, pool)
                        store.set_lighthouse(run.id, start_coordinator(plan, pool.get(plan.lighthouse.host), run.id,
                                                                       started, progress))

            direct = plan_mod.lighthouse_loopback_configs(
                plan, store.get_run(run.id).lighthouse.get("loopback_port", 0))

            def write_config(n) -> None:
                pool.get(n.host).write_text(n.config_path, direct.get(n.site, n.config_toml))

            results = pool.map(lambda node: [write_config(n) for n in todo if n.host == node.host],
                               sorted({n.host for n in todo}))
            _raise_first(results)
            for n in todo:
                progress(f"starting {n.site} node {n.node_rank} on {n.host}")
                pid = pool.get(n.host).start_detached(n.command, n.log_path, env=procs.marker_env(run.id))
                started.append((n.site, n.host, pid))
                store.set_node(run.id, n.site, n.host, pid=pid, state=SiteState.RUNNING, log_path=n.log_path,
                               run_dir=n.run_dir)
            # Slurm sites: one batch job each, through the login node (dilococtl.site_backend)
            jobs = [j for j in plan.jobs if sites is None or j.site in sites]
            submitted += submit_jobs(jobs, spec=spec, store=store, pool=pool, run_id=run.id, progress=progress)
            for name in sorted({n.site for n in todo} | {j.site for j in jobs}):
                store.set_site_state(run.id, name, SiteState.RUNNING)
                store.add_launch(run.id, name, reason=reason, ok=True)
            if run.state != RunState.RUNNING:
                run = store.set_run_state(run.id, RunState.RUNNING)
        except BaseException as e:  # whatever failed (an OSError, Ctrl-C too), the run does not stay launching
            why = str(e) if isinstance(e, DilocoError) else _one_line(e)
            _abort(pool, started, progress, run.id)
            cancel_jobs(submitted, pool=pool, progress=progress)
            for name in sorted({n.site for n in todo} | {j.site for j in jobs}):
                store.add_launch(run.id, name, reason=reason, ok=False, message=why)
            store.add_event(run.id, "error", f"launch failed: {why}")
            if fresh:  # a relaunch that failed leaves the sites that still train as they are
                store.set_run_state(run.id, RunState.FAILED, reason=f"launch failed: {why}")
            if isinstance(e, Exception) and not isinstance(e, DilocoError):
                raise DilocoError(f"launch of run {run.id} failed: {why}") from e
            raise
    return LaunchResult(run=store.get_run(run.id), plan=plan, started=[f"{s}/{h}" for s, h, _ in started])


def _raise_first(results: dict[str, Any]) -> None:
    for value in results.values():
        if isinstance(value, BaseException):
            raise value


def _one_line(e: BaseException) -> str:
    """An unexpected exception as one line: its type and message (KeyboardInterrupt: 'interrupted')."""
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _abort(pool: NodePool, started: list[tuple[str, str, int]], progress: Progress, run_id: str) -> None:
    """Stop what a failed launch started, so nothing is left running half-launched."""
    for site, host, pid in reversed(started):
        progress(f"launch failed: stopping {site} on {host}")
        try:
            procs.signal_if_ours(pool.get(host), pid, run_id, "KILL")
        except DilocoError:
            pass


# --- collecting ------------------------------------------------------------------------------

def metrics_path(run_dir: str, site: str) -> str:
    return f"{run_dir}/{site}/{METRICS_FILE}"


def collect(run: Run, *, store: Store, pool: NodePool) -> dict[str, str]:
    """Pull new metric lines from each site's leader node into the store, by offset.

    Returns {site: error message} for sites whose node could not be read (the others are
    collected anyway). Collecting twice inserts nothing twice.
    """
    errors: dict[str, str] = {}
    leaders = [n for n in store.nodes(run.id) if n.rank == 0]
    for n in leaders:
        path = metrics_path(n.run_dir, n.site)
        off = store.offset(run.id, n.site, n.host, path)
        try:
            while True:
                data = pool.get(n.host).read_from(path, off)
                end = data.rfind(b"\n")
                if end < 0:
                    break
                chunk = data[:end + 1]
                lines = chunk.decode("utf-8", "replace").splitlines()
                off += len(chunk)
                store.ingest(run.id, n.site, n.host, path, off, lines)
                if len(data) < (4 << 20):
                    break
        except Unreachable as e:
            errors[n.site] = str(e)
    _feed_sinks(run, store)
    return errors


def _feed_sinks(run: Run, store: Store) -> None:
    """The new rows to the run's [metrics] sinks, in the background (dilococtl.sinks.feed: collection never
    waits on a sink; a failing sink is one event)."""
    from dilococtl.sinks import feed

    feed.schedule(run, store)


# --- states ------------------------------------------------------------------------------------

def refresh(run: Run, *, store: Store, pool: NodePool) -> Run:
    """Collect, then derive node, site and run states from processes, exit codes and events; supervise
    the run's coordinators (dilococtl.supervise: a dead one is restarted, an ended run's are ended)."""
    from dilococtl import supervise

    # the record, not the caller's copy: a resume in another process may have started a new Lighthouse
    # since (a stale copy ended the old pids and leaked the new pair, issue 41)
    run = store.get_run(run.id)
    errors = collect(run, store=store, pool=pool)
    if run.state not in ACTIVE_RUN_STATES:
        supervise.reap(run, store=store, pool=pool)
        return store.get_run(run.id)
    refresh_jobs(run, store=store, pool=pool)  # Slurm sites: their node row's state is their job's
    for n in store.nodes(run.id):
        if n.state not in LIVE_SITE_STATES or n.pid is None:
            continue
        try:
            node = pool.get(n.host)
            if procs.identify(node, n.pid, run.id) == "ours":  # not a pid the OS handed on
                if n.state == SiteState.LOST:
                    store.set_node(run.id, n.site, n.host, state=SiteState.RUNNING)
                continue
            exit_file = shlex.quote(f"{n.run_dir}/{n.site}/node{n.rank}.exit")  # work_dir may hold spaces
            code = node.run(f"cat {exit_file} 2>/dev/null", timeout=20).stdout.strip()
        except Unreachable:
            if n.state != SiteState.LOST:
                store.set_node(run.id, n.site, n.host, state=SiteState.LOST)
                store.add_event(run.id, "error", f"{n.host} stopped answering", site=n.site)
            continue
        state = {"0": SiteState.FINISHED, str(EXIT_PREEMPTED): SiteState.PREEMPTED}.get(code, SiteState.FAILED)
        store.set_node(run.id, n.site, n.host, state=state)
    for site in store.sites(run.id):
        states = {n.state for n in store.nodes(run.id, site.name)}
        if SiteState.RUNNING in states or SiteState.STARTING in states:
            new = SiteState.RUNNING
        elif SiteState.FAILED in states or SiteState.LOST in states:
            new = SiteState.FAILED
        elif SiteState.PREEMPTED in states:
            new = SiteState.PREEMPTED
        elif states == {SiteState.FINISHED}:
            new = SiteState.FINISHED
        else:
            new = site.state
        if new != site.state:
            store.set_site_state(run.id, site.name, new)
    site_states = {s.state for s in store.sites(run.id)}
    if SiteState.RUNNING in site_states:
        new_run = RunState.RUNNING
    elif site_states == {SiteState.FINISHED}:
        new_run = RunState.FINISHED
    elif SiteState.FAILED in site_states:
        new_run = RunState.FAILED
    elif SiteState.PREEMPTED in site_states:
        new_run = RunState.PREEMPTED
    else:
        new_run = run.state
    if new_run != run.state:
        reason = None
        if new_run == RunState.FAILED:
            bad = sorted(s.name for s in store.sites(run.id) if s.state == SiteState.FAILED)
            reason = f"site(s) {', '.join(bad)} failed; see `dilococtl logs {run.id}`"
            early = _early_failure(run, store, pool, bad)
            if early:
                reason = early
        elif new_run == RunState.FINISHED:  # `runs` shows why every run ended, a finished one too
            reason = "every site finished its rounds"
        if new_run in (RunState.FINISHED, RunState.FAILED, RunState.PREEMPTED):
            end_lighthouse(run, pool)  # SIGKILL after the grace: an ended run leaves no process behind
        run = store.set_run_state(run.id, new_run, reason=reason)
        if run.state not in ACTIVE_RUN_STATES:
            supervise.reap(run, store=store, pool=pool)
        if run.state not in ACTIVE_RUN_STATES:
            retire_keys(run, store)
            _feed_sinks(run, store)  # an ended run's last rounds wait for no site
    del errors
    if run.state == RunState.RUNNING:  # after the states: a run whose sites all died gets no new coordinator
        run = supervise.check(run, store=store, pool=pool, relaunch=launch)
    return run


def _early_failure(run: Run, store: Store, pool: NodePool, bad: list[str]) -> str | None:
    """For sites that failed before recording a round: "<site> failed before its first round: <the
    first error line of its log>" (the cause, not torchrun's ChildFailedError), recorded as an event."""
    from dilococtl.logs import first_error

    rounds = store.latest_rounds(run.id)
    for site in bad:
        if site in rounds:
            continue
        for n in store.nodes(run.id, site):
            if n.state != SiteState.FAILED or not n.log_path:
                continue
            try:
                line = first_error(pool.get(n.host).read_from(n.log_path, 0).decode("utf-8", "replace"))
            except DilocoError:
                continue
            if line:
                msg = f"{site} failed before its first round: {line}"
                store.add_event(run.id, "error", msg, site=site)
                return msg
    return None


def wait(run: Run, *, store: Store, pool: NodePool, poll_s: float = 2.0, progress: Progress = _noop,
         timeout_s: float | None = None) -> Run:
    """Refresh until the run leaves the running states; reports each new round on `progress`."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s if timeout_s else None
    while True:
        run = refresh(run, store=store, pool=pool)
        for site, rec in store.latest_rounds(run.id).items():
            if rec.round != seen.get(site):
                seen[site] = rec.round
                ppl = f" val_ppl {rec.val_ppl:.2f}" if rec.val_ppl is not None else ""
                progress(f"{site}: round {rec.round} (step {rec.step}, K_active {rec.k_active}){ppl}")
        if run.state not in (RunState.LAUNCHING, RunState.RUNNING):
            return run
        if deadline and time.monotonic() > deadline:
            raise DilocoError(f"run {run.id} still {run.state} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def stop(run: Run, *, store: Store, progress: Progress = _noop, grace_s: float = STOP_GRACE_S,
         reason: str = "stopped by the operator", accept_new: bool = False, force: bool = False) -> Run:
    """SIGTERM every process of the run, SIGKILL after the grace period; recorded.

    A recorded pid is signalled only while it is still the run's process (dilococtl.procs): once a
    process has ended the OS may give its pid to an unrelated one. `force`: whatever fails on the
    way (the stored spec, a node, a signal), the record is ended anyway (nodes, sites, run stopped).
    """
    if not 0 <= grace_s <= MAX_WAIT_S:  # nan and inf too: the wait below must end
        raise BadInput(f"--grace: must be in [0, {MAX_WAIT_S:g}] seconds, got {grace_s:g}")
    live = [n for n in store.nodes(run.id) if n.pid and n.state in LIVE_SITE_STATES]
    try:
        _signal_all(run, store, live, progress, grace_s, accept_new)
    except Exception as e:
        if not force:
            raise
        why = str(e) if isinstance(e, DilocoError) else _one_line(e)
        progress(f"--force: {why}; ending the record anyway")
        reason = f"{reason} (forced; {why})"
    jobs = store.site_jobs(run.id)  # a Slurm site's node row (its login node) has no pid
    for n in live + [n for n in store.nodes(run.id) if n.site in jobs and n.state in LIVE_SITE_STATES]:
        store.set_node(run.id, n.site, n.host, state=SiteState.STOPPED)
    for s in store.sites(run.id):
        if s.state in (SiteState.RUNNING, SiteState.PENDING, SiteState.PREEMPTED, SiteState.STARTING):
            store.set_site_state(run.id, s.name, SiteState.STOPPED)
    store.add_event(run.id, "stopped", reason)
    if run.state in ACTIVE_RUN_STATES:
        run = store.set_run_state(run.id, RunState.STOPPED, reason=reason)
    retire_keys(run, store)
    _feed_sinks(run, store)
    return run


def retire_keys(run: Run, store: Store) -> None:
    """An ended run's CA and site private keys are deleted here (dilococtl.run_ca.retire says which
    stay and why); a key that cannot be deleted is an event, not a failure of the run's end."""
    from dilococtl import run_ca

    try:
        run_ca.retire(plan_mod.run_ca_dir(run.id))
    except DilocoError as e:
        store.add_event(run.id, "error", str(e))


def _signal_all(run: Run, store: Store, live: list, progress: Progress, grace_s: float, accept_new: bool) -> None:
    """stop's work on the nodes: SIGTERM, wait, SIGKILL, each only to the run's own processes."""
    spec = run.spec()
    with NodePool(spec.ssh, accept_new=accept_new) as pool:
        targets = [(n.site, n.host, n.pid) for n in live]
        targets += [(LIGHTHOUSE_SITE, run.lighthouse["host"], pid) for pid in lighthouse_pids(run)]

        def send(site: str, host: str, pid: int, sig: str) -> bool:
            try:
                found = procs.signal_if_ours(pool.get(host), pid, run.id, sig)
            except DilocoError as e:
                progress(f"{host}: {e}")
                return False
            if found == "foreign":
                progress(f"{site} on {host}: pid {pid} is no longer this run's process; not signalled")
            return found == "ours"

        remaining = [t for t in targets if send(*t, "TERM")]
        for site, host, _ in remaining:
            progress(f"SIGTERM {site} on {host}")
        deadline = time.monotonic() + grace_s
        stop_jobs(run, store=store, pool=pool, grace_s=grace_s, progress=progress)  # Slurm sites: scancel
        while remaining and time.monotonic() < deadline:
            remaining = [t for t in remaining if is_ours(pool, run.id, t[1], t[2])]
            if remaining:
                time.sleep(0.5)
        for site, host, pid in remaining:
            progress(f"SIGKILL {site} on {host} (grace of {grace_s:.0f}s over)")
            send(site, host, pid, "KILL")
        collect(run, store=store, pool=pool)


# --- summaries -----------------------------------------------------------------------------

def site_summaries(run: Run, store: Store, stats: list[queries.SiteStat] | None = None) -> list[dict[str, Any]]:
    """Per site: state, round, step, efficiency, staleness, tokens/s, MFU, last sync seconds, perplexity.

    The figures are the dashboard's (dilococtl.queries.site_stats, dilococtl.metrics).
    """
    if stats is None:
        stats = queries.site_stats(store, run.id)
    return [{"site": s.site, "state": s.state, "round": s.round, "step": s.step, "k_active": s.k_active,
             "k_nominal": s.k_nominal, "efficiency": s.efficiency, "staleness": s.staleness,
             "tokens_per_s": s.tokens_per_s, "mfu": s.mfu, "wan_bps": s.wan_bps, "train_loss": s.train_loss,
             "last_sync_s": s.last_sync_s, "val_ppl": s.val_ppl, "bytes_sent": s.bytes_sent,
             "bytes_recv": s.bytes_recv} for s in stats]


PROBLEMS_SHOWN = 5  # problem events status lists under its table


def run_summary(run: Run, store: Store, *, now: float | None = None) -> dict[str, Any]:
    """What `status` shows: the run, its sites and its figures (dilococtl.metrics), beside tune-h's prediction."""
    spec = run.spec()
    series = queries.series(store, run.id)
    stats = queries.site_stats(store, run.id, series)
    sites = site_summaries(run, store, stats)
    ppls = [s["val_ppl"] for s in sites if s["val_ppl"] is not None and math.isfinite(s["val_ppl"])]
    from dilococtl import goodput
    from dilococtl.tune.history import prediction_for

    figures = metrics.run_metrics(run, series.round_time, stats, now=now)
    pred = prediction_for(store, run)
    return {
        "id": run.id, "name": run.name, "state": run.state, "reason": run.exit_reason,
        "created": run.created, "finished": run.finished, "rounds_planned": spec.diloco.rounds,
        "h": spec.diloco.h, "final_val_ppl": min(ppls) if ppls else None,
        "sync_share": figures.sync_share,  # of round time (dilococtl.metrics)
        "predicted_sync_share": pred["predicted_sync_share"] if pred else None,
        # with the goodput ledger: the share of wall time that reached θ and where the rest went (issue 36)
        "metrics": {**figures.to_json(), **goodput.ledger(run, store, now).to_json()},
        "sites": sites,
        # Slurm sites: {site: {job_id, detail (state, pending reason, nodes), nodes, submits}}
        "jobs": {k: {f: v[f] for f in ("job_id", "detail", "nodes", "submits")} for k, v in store.site_jobs(run.id).items()},
        # sites waiting on a coordinator they cannot reach: {"since", "cause", "sites"} or None (issue 41)
        "stalled": queries.stall(store, run.id) if run.state in ACTIVE_RUN_STATES else None,
        # the newest problems (rejected contributions, divergence, errors), oldest first
        "problems": [{"site": e.site, "event": e.event, "round": e.round, "message": e.message, "t": e.t}
                     for e in store.events(run.id, kinds=PROBLEM_EVENTS, limit=PROBLEMS_SHOWN)],
    }
