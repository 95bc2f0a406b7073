"""Supervision of the run's coordinators: the torchft Lighthouse (and its TLS relay) or the outer service.

The sites survive each other's death but not their coordinator's (issue 41): a Lighthouse killed
mid-run left both sites waiting at their round boundary, silently, for minutes. The collector
(dilococtl.runs.refresh, under `launch --wait`, `status`, `watch`, `resume`) calls `check` each pass:

- a live run whose coordinator (or its relay) is gone gets it back on the same host and the same
  address (the public port is fixed by the spec; the relay takes its old loopback port again, which the
  sites on its host dial), recorded as a `coordinator_restart` event; a Lighthouse waits for every site
  that is training (min_replicas, see `restart`). The sites' torchft Managers dial
  the Lighthouse's address again on their next quorum; the async sites retry the service. The outer
  service restores θ, momentum and version from its own state directory (trainer.service.param_service saves
  it every async_checkpoint_every versions, atomically, and loads the newest at start);
- an ended run's coordinators are ended: SIGTERM at the end (refresh), SIGKILL at a later pass for one that
  ignored it, until none of the pids recorded is still the run's (then the record says `reaped`).

- a coordinator that runs but that most training sites cannot reach (its region cut off) or whose host no
  longer answers the control plane is moved (`move`): after MOVE_AFTER_S of such a stall, to the first
  host of a stalled site; every training site is stopped (a stalled one cannot reach a safe point: it is
  killed after STALLED_GRACE_S, having lost only the uncommitted round it waited to exchange) and
  relaunched from its newest checkpoint with the new address, recorded in the run's spec. A coordinator
  left on a host that did not answer is killed when the host answers again, and a site that kept the old
  address (its node did not answer either) is relaunched with the new one. With no other host to go to but
  its own answering, it is restarted where it is (as if it were gone): the pair runs, yet the sites cannot
  get through it.

Several collectors may look at one run at once (watch beside launch --wait): a restart is done under an
exclusive lock on a file of the run in the control plane's home, and health is checked again under it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import time
from collections.abc import Callable
from typing import Any

from dilococtl import coordinators, paths, procs, queries
from dilococtl import plan as plan_mod
from dilococtl.errors import DilocoError, Unreachable
from dilococtl.nodes import NodePool
from dilococtl.states import ACTIVE_RUN_STATES, SiteState
from dilococtl.store import Run, Store

RESTART_MIN_INTERVAL_S = 10.0  # two restarts of one run's coordinator are at least this far apart
MAX_RESTARTS = 10  # restarts per run before the collector gives up (an error event says so)
MOVE_AFTER_S = 30.0  # most training sites stalled this long on a coordinator that runs (or whose host does
# not answer the control plane): it moves to another site's host (async sites give up on the service at 60 s)
STALLED_GRACE_S = 5.0  # SIGTERM -> SIGKILL for a stalled site when its coordinator moves (it waits in a
# quorum that cannot form: it never reaches the safe point where it would checkpoint)

AFTER_MOVE_EVERY_S = 30.0  # how often a host left behind by a move is tried (each try may wait out an SSH timeout)

Relaunch = Callable[..., Any]  # dilococtl.runs.launch, passed in by the collector (runs imports this module)

Progress = Callable[[str], None]


def _noop(_msg: str) -> None:
    pass


def _gone(pool: NodePool, run_id: str, host: str, pid: int) -> bool:
    """Whether `pid` is no longer the run's process on `host` (False when the host does not answer: a host
    that is unreachable is the refresh's `lost` node, not a reason to start a second coordinator)."""
    try:
        return procs.identify(pool.get(host), pid, run_id) != "ours"
    except DilocoError:
        return False


def health(run: Run, pool: NodePool) -> str:
    """"" when the run's coordinator (and its relay) run, else what is gone, in a few words."""
    lh = run.lighthouse
    if not lh.get("pid"):
        return ""  # nothing recorded (a launch still starting, or an old record): nothing to supervise
    what = "the outer parameter service" if lh.get("kind") == "outer_service" else "the torchft Lighthouse"
    gone = []
    if _gone(pool, run.id, lh["host"], int(lh["pid"])):
        gone.append(f"{what} (pid {lh['pid']})")
    if lh.get("relay_pid") and _gone(pool, run.id, lh["host"], int(lh["relay_pid"])):
        gone.append(f"its TLS relay (pid {lh['relay_pid']})")
    return " and ".join(gone) + f" on {lh['host']} exited" if gone else ""


_HELD: set[str] = set()  # runs whose coordinator lock this process holds


class CoordinatorLock:
    """An exclusive flock on the run's coordinator file in the home directory: whoever (re)starts a run's
    coordinator holds it, so a collector's restart and a relaunch's (resume, lab chaos) never race for its
    port. Entering gives False when another process holds it (with `wait`, it waits instead); this process
    entering again while it holds it (a move relaunching the sites) gives True at once."""

    def __init__(self, run_id: str, wait: bool = False):
        self.run_id, self.wait, self.fd = run_id, wait, None

    def __enter__(self) -> bool:
        if self.run_id in _HELD:
            return True
        d = paths.home() / "locks"
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / f"{self.run_id}.coordinator", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        _HELD.add(self.run_id)
        return True

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            _HELD.discard(self.run_id)
            os.close(self.fd)  # releases the lock


def _waits_for_dead(run: Run, store: Store) -> str:
    """"" unless the run's Lighthouse was restarted to wait for more sites than now train (a site died since):
    then why it must be restarted again, for the sites that are left (or its quorum would never form)."""
    need = int(run.lighthouse.get("min_replicas", 0) or 0)
    live = sum(1 for x in store.sites(run.id) if x.state == SiteState.RUNNING)
    if need and live < need:
        return f"the torchft Lighthouse waits for {need} sites and {live} train now"
    return ""


def stranded(run: Run, store: Store, now: float | None = None) -> tuple[str, list[str]]:
    """("why", the stalled sites) when most sites that train have waited more than MOVE_AFTER_S on a
    coordinator they cannot reach, counting only outages that began after its last start or move; else
    ("", [])."""
    st = queries.stall(store, run.id)
    if st is None:
        return "", []
    now = time.time() if now is None else now
    started = float(run.lighthouse.get("restarted_at", 0) or 0)
    live = [x.name for x in store.sites(run.id) if x.state == SiteState.RUNNING]
    stuck = [s for s in live if s in st["by_site"] and started < st["by_site"][s] <= now - MOVE_AFTER_S]
    if not live or 2 * len(stuck) <= len(live):
        return "", []
    return (f"{', '.join(stuck)} of {len(live)} training sites have not reached the coordinator on "
            f"{run.lighthouse.get('host', '?')} for over {MOVE_AFTER_S:.0f} s ({st['cause']})"), stuck


def check(run: Run, *, store: Store, pool: NodePool, progress: Progress = _noop,
          relaunch: Relaunch | None = None) -> Run:
    """One supervision pass over a live run: restart its coordinator if it is gone, move it if the sites cannot
    reach it (with `relaunch`, runs.launch), relaunch a site left on an old address (see the module note)."""
    if (run.lighthouse.get("abandoned") or run.lighthouse.get("behind")) and \
            time.time() - float(run.lighthouse.get("looked_at", 0) or 0) > AFTER_MOVE_EVERY_S:
        with CoordinatorLock(run.id) as mine:
            if mine:
                run = _after_move(store.get_run(run.id), store=store, pool=pool, progress=progress,
                                  relaunch=relaunch)
    stuck: list[str] = []
    if not health(run, pool) and not _waits_for_dead(run, store):
        if relaunch is None or not stranded(run, store)[1]:
            return run
    with CoordinatorLock(run.id) as mine:
        if not mine:
            return run  # another collector is at it
        run = store.get_run(run.id)
        if run.state not in ACTIVE_RUN_STATES:
            return run  # a `stop` elsewhere ended it since this pass began: nothing to supervise
        why = health(run, pool) or _waits_for_dead(run, store)
        if not why and relaunch is not None:
            why, stuck = stranded(run, store)
        if not why:
            return run
        lh = dict(run.lighthouse)
        restarts = int(lh.get("restarts", 0))
        if restarts >= MAX_RESTARTS:
            if not lh.get("gave_up"):
                msg = f"{why}; not restarted: {restarts} restarts already (see its log {lh.get('log_path', '')})"
                store.add_event(run.id, "error", msg)
                store.set_lighthouse(run.id, {**lh, "gave_up": True})
            return store.get_run(run.id)
        if time.time() - float(lh.get("restarted_at", 0)) < RESTART_MIN_INTERVAL_S:
            return run
        if stuck:
            assert relaunch is not None
            return move(run, store=store, pool=pool, why=why, stuck=stuck, relaunch=relaunch, progress=progress)
        return restart(run, store=store, pool=pool, why=why, progress=progress)


def restart(run: Run, *, store: Store, pool: NodePool, why: str, progress: Progress = _noop) -> Run:
    """End what is left of the run's coordinator pair and start it again at the same address, as launch did."""
    lh = dict(run.lighthouse)
    node = pool.get(lh["host"])
    # why it failed, in its own words: the relay's last line says when the Lighthouse behind it did not answer
    last = "; ".join(f"{what}: {line}" for what, key in (("its log's last line", "log_path"),
                                                          ("its relay's", "relay_log_path"))
                     if lh.get(key) and (line := coordinators.last_line(node, lh[key])))
    coordinators.end_lighthouse(run, pool, grace_s=5.0)
    spec = run.spec()
    plan = plan_mod.build(spec, run.id, make_keys=False)
    raised = _wait_for(plan, spec, len([x for x in store.sites(run.id) if x.state == SiteState.RUNNING]))
    started: list = []
    t0 = time.time()
    try:
        info = coordinators.start_coordinator(plan, pool.get(plan.lighthouse.host), run.id, started, progress,
                                      loopback_port=int(lh.get("loopback_port", 0) or 0))
    except DilocoError as e:
        _kill_started(pool, run.id, started)
        store.set_lighthouse(run.id, {**lh, "restarts": int(lh.get("restarts", 0)) + 1, "restarted_at": time.time()})
        store.add_event(run.id, "error", f"{why}; its restart failed: {e}")
        return store.get_run(run.id)
    info.update(restarts=int(lh.get("restarts", 0)) + 1, restarted_at=time.time(), min_replicas=raised)
    store.set_lighthouse(run.id, info)
    msg = f"{why}" + (f" ({last})" if last else "") + \
        f"; restarted on {info['host']} at the same address in {time.time() - t0:.1f} s"
    progress(msg)
    store.add_event(run.id, "coordinator_restart", msg, detail={
        "why": why, "last_line": last, "pid": info["pid"], "relay_pid": info.get("relay_pid"),
        "restarts": info["restarts"], "seconds": round(time.time() - t0, 2)})
    run = store.get_run(run.id)
    if run.state not in ACTIVE_RUN_STATES:  # stopped while it started (stop does not wait on this lock)
        reap(run, store=store, pool=pool)
    return run


def _kill_started(pool: NodePool, run_id: str, started: list) -> None:
    """SIGKILL what a failed coordinator start left: the (site, host, pid) of `started`."""
    for _site, host, pid in started:
        try:
            procs.signal_if_ours(pool.get(host), pid, run_id, "KILL")
        except DilocoError:
            pass


def _wait_for(plan, spec, sites: int) -> int:
    """Make the plan's fresh Lighthouse wait for `sites` replicas (returned; 0 when it keeps min_sites).

    A fresh Lighthouse gives a quorum to whichever site reconnects first (the others are not heartbeating
    there yet): measured, one site then trained alone and the next round waited out its exchange timeout.
    So it waits for every site that will reach it; if one of them stops training, check restarts it again
    for those that are left (_waits_for_dead)."""
    if plan.lighthouse.kind != "lighthouse" or sites <= spec.diloco.min_sites:
        return 0
    plan.lighthouse.command = plan.lighthouse.command.replace(
        f"--min_replicas {spec.diloco.min_sites} ", f"--min_replicas {sites} ")
    return sites


def _answers(pool: NodePool, host: str) -> bool:
    try:
        return pool.get(host).run("true", timeout=30).rc == 0
    except (Unreachable, DilocoError):
        return False


def _new_host(run: Run, store: Store, pool: NodePool, stuck: list[str]) -> str:
    """The first node of the first stalled site that answers and is not the coordinator's host, or ""."""
    old = run.lighthouse.get("host", "")
    for site in stuck:
        leader = next((n for n in store.nodes(run.id, site) if n.rank == 0), None)
        if leader is not None and leader.host != old and _answers(pool, leader.host):
            return leader.host
    return ""


def _stop_sites(run: Run, store: Store, pool: NodePool, grace: dict[str, float]) -> None:
    """SIGTERM the nodes of the sites in `grace` (site -> seconds), SIGKILL each after its grace; their nodes
    are recorded stopped, the sites keep their state (refresh leaves a site whose nodes are stopped alone), so
    the run stays running until they are relaunched."""
    t0 = time.monotonic()
    nodes = [n for n in store.nodes(run.id) if n.site in grace and n.pid and n.state in (SiteState.RUNNING,
                                                                                          SiteState.STARTING)]
    left = []
    for n in nodes:
        try:
            if procs.signal_if_ours(pool.get(n.host), n.pid, run.id, "TERM") == "ours":
                left.append(n)
        except DilocoError:
            pass
    while left:
        time.sleep(0.5)
        left = [n for n in left if coordinators.is_ours(pool, run.id, n.host, n.pid)]
        for n in [n for n in left if time.monotonic() - t0 > grace[n.site]]:
            try:
                procs.signal_if_ours(pool.get(n.host), n.pid, run.id, "KILL")
            except DilocoError:
                pass
    for n in nodes:
        store.set_node(run.id, n.site, n.host, state=SiteState.STOPPED)


def move(run: Run, *, store: Store, pool: NodePool, why: str, stuck: list[str], relaunch: Relaunch,
         progress: Progress = _noop) -> Run:
    """Start the run's coordinator on a stalled site's host and relaunch every training site with its new
    address (see the module note); `relaunch` is runs.launch."""
    lh = dict(run.lighthouse)
    restarts = int(lh.get("restarts", 0)) + 1
    host = _new_host(run, store, pool, stuck)
    if not host and _answers(pool, lh["host"]):
        # nowhere else to go (every site on one host, as local runs are), yet the host answers: the pair
        # itself is what the sites cannot get through (a relay whose door failed), so it starts afresh there
        return restart(run, store=store, pool=pool, why=f"{why}; no other host to move it to", progress=progress)
    if not host:
        if not lh.get("no_move"):
            store.add_event(run.id, "error", f"{why}; no other host of a stalled site answers: not moved")
            store.set_lighthouse(run.id, {**lh, "no_move": True})
        return store.get_run(run.id)
    t0 = time.time()
    spec = run.spec()
    old_answers = _answers(pool, lh["host"])
    coordinators.end_lighthouse(run, pool, grace_s=5.0)
    abandoned = list(lh.get("abandoned", []))
    if not old_answers:  # killed when its host answers again (_after_move)
        abandoned.append({"host": lh["host"], "pids": coordinators.lighthouse_pids(run)})
    live = [x.name for x in store.sites(run.id) if x.state == SiteState.RUNNING]
    answering = [n for n in live if all(_answers(pool, x.host) for x in store.nodes(run.id, n))]
    # on hosts that do not answer (lost nodes, or one that stopped answering just now): relaunched when they do
    behind = sorted({n.site for n in store.nodes(run.id) if n.state == SiteState.LOST} | (set(live) - set(answering)))
    _stop_sites(run, store, pool, {n: STALLED_GRACE_S if n in stuck else spec.run.grace_s for n in answering})
    spec = dataclasses.replace(spec, run=dataclasses.replace(spec.run, lighthouse=host))
    store.set_spec(run.id, spec)
    plan = plan_mod.build(spec, run.id, make_keys=False)
    raised = _wait_for(plan, spec, len(stuck))
    base = {"restarts": restarts, "restarted_at": time.time(), "moved_at": time.time(), "abandoned": abandoned,
            "behind": behind}
    started: list = []
    try:
        coordinators.put_files(pool, plan.files, host=host)
        info = coordinators.start_coordinator(plan, pool.get(host), run.id, started, progress)
        store.set_lighthouse(run.id, {**info, **base, "min_replicas": raised})
        relaunch(spec, store=store, sites=sorted(answering), run=store.get_run(run.id),
                 reason="coordinator moved", progress=progress)
    except DilocoError as e:
        _kill_started(pool, run.id, started)
        store.set_lighthouse(run.id, {**store.get_run(run.id).lighthouse, **base})
        for name in answering:  # stopped and not back: the run says so (and `resume` relaunches them)
            if name not in {n.site for n in store.nodes(run.id) if n.state == SiteState.RUNNING}:
                store.set_site_state(run.id, name, SiteState.FAILED)
        store.add_event(run.id, "error", f"{why}; moving it to {host} failed: {e}")
        return store.get_run(run.id)
    msg = (f"{why}; moved to {host} in {time.time() - t0:.1f} s, sites {', '.join(sorted(answering))} "
           f"relaunched with its address" + (f"; {', '.join(behind)} when their hosts answer" if behind else ""))
    progress(msg)
    store.add_event(run.id, "coordinator_restart", msg, detail={
        "why": why, "moved_from": lh["host"], "moved_to": host, "pid": info["pid"],
        "relay_pid": info.get("relay_pid"), "restarts": restarts, "relaunched": sorted(answering),
        "behind": behind, "seconds": round(time.time() - t0, 2)})
    return store.get_run(run.id)


def _after_move(run: Run, *, store: Store, pool: NodePool, progress: Progress, relaunch: Relaunch | None) -> Run:
    """After a move: kill a coordinator left on a host that did not answer, once it does; a site left behind
    on such a host that trains again (with the old address) is stopped and relaunched with the new one."""
    lh = dict(run.lighthouse)
    left = []
    for entry in lh.get("abandoned", []):
        if not _answers(pool, entry["host"]):
            left.append(entry)
            continue
        for pid in entry["pids"]:
            try:
                procs.signal_if_ours(pool.get(entry["host"]), int(pid), run.id, "KILL")
            except DilocoError:
                pass
    behind = []
    if relaunch is not None:
        for site in lh.get("behind", []):
            nodes = store.nodes(run.id, site)
            if any(x.started > float(lh.get("moved_at", 0)) for x in store.launches(run.id, site=site)) or \
                    (nodes and all(n.state == SiteState.FINISHED for n in nodes)):
                continue  # relaunched since (a `resume`), or done
            if not all(_answers(pool, n.host) for n in nodes):
                behind.append(site)
                continue
            _stop_sites(run, store, pool, {site: STALLED_GRACE_S})
            try:
                relaunch(run.spec(), store=store, sites=[site], run=store.get_run(run.id), reason="coordinator moved",
                         progress=progress)
            except DilocoError as e:
                store.add_event(run.id, "error", f"{site} could not be relaunched with the coordinator's new "
                                f"address: {e}", site=site)
    else:
        behind = list(lh.get("behind", []))
    store.set_lighthouse(run.id, {**store.get_run(run.id).lighthouse, "abandoned": left, "behind": behind,
                                  "looked_at": time.time()})
    return store.get_run(run.id)


def reap(run: Run, *, store: Store, pool: NodePool) -> None:
    """An ended run: SIGKILL what is left of its coordinators (SIGTERM went at the end); once none of the
    recorded pids is the run's any more, the record says `reaped` and later passes look no further."""
    lh = run.lighthouse
    if not lh.get("pid") or lh.get("reaped"):
        return
    pids = [int(lh[k]) for k in ("pid", "relay_pid") if lh.get(k)]
    left = [p for p in pids if coordinators.is_ours(pool, run.id, lh["host"], p)]
    for pid in left:
        try:
            procs.signal_if_ours(pool.get(lh["host"]), pid, run.id, "KILL")
        except DilocoError:
            return  # the host does not answer: a later pass tries again
    if not left:
        store.set_lighthouse(run.id, {**lh, "reaped": True})
