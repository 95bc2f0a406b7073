"""Supervision of the run's coordinators: the torchft Lighthouse (and its TLS relay) or the outer service.

The sites survive each other's death but not their coordinator's (issue 41): a Lighthouse killed
mid-run left both sites waiting at their round boundary, silently, for minutes. The collector
(dilococtl.runs.refresh, under `launch --wait`, `status`, `watch`, `resume`) calls `check` each pass:

- a live run whose coordinator (or its relay) is gone gets it back on the same host and the same
  address (the public port is fixed by the spec; the relay takes its old loopback port again, which the
  sites on its host dial), recorded as a `coordinator_restart` event; a Lighthouse waits for every site
  that is training (min_replicas, see `restart`). The sites' torchft Managers dial
  the Lighthouse's address again on their next quorum; the async sites retry the service. The outer
  service restores θ, momentum and version from its own state directory (trainer.param_service saves
  it every async_checkpoint_every versions, atomically, and loads the newest at start);
- an ended run's coordinators are ended: SIGTERM at the end (refresh), SIGKILL at a later pass for one that
  ignored it, until none of the pids recorded is still the run's (then the record says `reaped`).

Several collectors may look at one run at once (watch beside launch --wait): a restart is done under an
exclusive lock on a file of the run in the control plane's home, and health is checked again under it.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable

from dilococtl import coordinators, paths, procs
from dilococtl import plan as plan_mod
from dilococtl.errors import DilocoError
from dilococtl.nodes import NodePool
from dilococtl.states import SiteState
from dilococtl.store import Run, Store

RESTART_MIN_INTERVAL_S = 10.0  # two restarts of one run's coordinator are at least this far apart
MAX_RESTARTS = 10  # restarts per run before the collector gives up (an error event says so)

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


class _RunLock:
    """An exclusive flock on the run's supervision file in the home directory (None when another holds it)."""

    def __init__(self, run_id: str):
        d = paths.home() / "locks"
        d.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(d / f"{run_id}.coordinator", os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # releases the lock


def _waits_for_dead(run: Run, store: Store) -> str:
    """"" unless the run's Lighthouse was restarted to wait for more sites than now train (a site died since):
    then why it must be restarted again, for the sites that are left (or its quorum would never form)."""
    need = int(run.lighthouse.get("min_replicas", 0) or 0)
    live = sum(1 for x in store.sites(run.id) if x.state == SiteState.RUNNING)
    if need and live < need:
        return f"the torchft Lighthouse waits for {need} sites and {live} train now"
    return ""


def check(run: Run, *, store: Store, pool: NodePool, progress: Progress = _noop) -> Run:
    """One supervision pass over a live run: restart its coordinator if it is gone (see the module note)."""
    if not health(run, pool) and not _waits_for_dead(run, store):
        return run
    with _RunLock(run.id) as mine:
        if not mine:
            return run  # another collector is at it
        run = store.get_run(run.id)
        why = health(run, pool) or _waits_for_dead(run, store)
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
        return restart(run, store=store, pool=pool, why=why, progress=progress)


def restart(run: Run, *, store: Store, pool: NodePool, why: str, progress: Progress = _noop) -> Run:
    """End what is left of the run's coordinator pair and start it again at the same address, as launch did."""
    lh = dict(run.lighthouse)
    last = coordinators.last_line(pool.get(lh["host"]), lh["log_path"]) if lh.get("log_path") else ""
    coordinators.end_lighthouse(run, pool, grace_s=5.0)
    spec = run.spec()
    plan = plan_mod.build(spec, run.id, make_keys=False)
    live = [x.name for x in store.sites(run.id) if x.state == SiteState.RUNNING]
    if plan.lighthouse.kind == "lighthouse" and len(live) > spec.diloco.min_sites:
        # a fresh Lighthouse gives a quorum to whichever site reconnects first (the others are not heartbeating
        # there yet): measured, one site then trained alone and the next round waited out its exchange timeout.
        # So the new one waits for every site that is training now; if one of them stops training, check
        # restarts it again for those that are left (_waits_for_dead)
        plan.lighthouse.command = plan.lighthouse.command.replace(
            f"--min_replicas {spec.diloco.min_sites} ", f"--min_replicas {len(live)} ")
        raised = len(live)
    else:
        raised = 0
    started: list = []
    t0 = time.time()
    try:
        info = coordinators.start_coordinator(plan, pool.get(plan.lighthouse.host), run.id, started, progress,
                                      loopback_port=int(lh.get("loopback_port", 0) or 0))
    except DilocoError as e:
        for _site, host, pid in started:
            try:
                procs.signal_if_ours(pool.get(host), pid, run.id, "KILL")
            except DilocoError:
                pass
        store.set_lighthouse(run.id, {**lh, "restarts": int(lh.get("restarts", 0)) + 1, "restarted_at": time.time()})
        store.add_event(run.id, "error", f"{why}; its restart failed: {e}")
        return store.get_run(run.id)
    info.update(restarts=int(lh.get("restarts", 0)) + 1, restarted_at=time.time(), min_replicas=raised)
    store.set_lighthouse(run.id, info)
    msg = f"{why}" + (f" (its log's last line: {last})" if last else "") + \
        f"; restarted on {info['host']} at the same address in {time.time() - t0:.1f} s"
    progress(msg)
    store.add_event(run.id, "coordinator_restart", msg, detail={
        "why": why, "last_line": last, "pid": info["pid"], "relay_pid": info.get("relay_pid"),
        "restarts": info["restarts"], "seconds": round(time.time() - t0, 2)})
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
