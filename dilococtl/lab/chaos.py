"""`dilococtl lab chaos SCENARIO.toml`: replay a schedule of faults (dilococtl/lab/scenario.py) against a
running lab run, each fault a run event, and restore everything it changed (dilococtl/lab/faults.py)."""

from __future__ import annotations

import heapq
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dilococtl.errors import BadInput, DilocoError
from dilococtl.lab.model import LabState
from dilococtl.lab.scenario import Fault, Scenario, Schedule, fmt_s

RUN_LOOK_S = 2.0  # how often the replay looks whether its run has ended
RELAUNCH_TRIES = 3  # kill: resume tries before the relaunch counts as failed
RELAUNCH_RETRY_S = 5.0  # kill: wait between two tries


# --- replay --------------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class Outcome:
    index: int
    kind: str
    target: str
    planned_at: float  # seconds from the run's start
    applied_at: float | None = None
    ended_at: float | None = None  # everything it changed restored (kill: relaunched, or killed if no relaunch)
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        r = lambda v: None if v is None else round(v, 3)  # noqa: E731
        return {"index": self.index, "kind": self.kind, "target": self.target, "planned_at": r(self.planned_at),
                "applied_at": r(self.applied_at), "ended_at": r(self.ended_at), "detail": self.detail}


class Replay:
    """Applies a schedule's faults at their times (from the run's start), ends each after its `for`
    (counted from when it was applied: a fault already due when chaos starts is applied at once and
    still lasts its time) and restores everything it changed, on success, error or `stop`."""

    def __init__(self, schedule: Schedule, *, state: LabState, run_id: str, start: float, store_path: Path,
                 say, stop) -> None:
        from dilococtl.lab.faults import Ledger

        self.schedule, self.state, self.run_id, self.start = schedule, state, run_id, start
        self.store_path, self.say, self.stop = store_path, say, stop
        self.ledger = Ledger()
        self.outcomes = {p.fault.index: Outcome(index=p.fault.index, kind=p.fault.kind, target=p.fault.target,
                                                planned_at=p.at_s) for p in schedule.items}
        self._heap: list = []
        self._seq = 0
        self._workers: dict[int, threading.Thread] = {}
        self._errors: list[str] = []

    def now(self) -> float:
        return time.time() - self.start

    def _push(self, at: float, fn, f: Fault) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, fn, f))

    def _event(self, f: Fault, phase: str, msg: str, store=None, **detail: Any) -> None:
        from dilococtl.store import Store

        self.say(f"[{self.now():7.1f}s] chaos: {msg}")
        own = store is None
        store = store or Store.open(self.store_path)
        try:
            store.add_event(self.run_id, "chaos", f"chaos: {msg}", site=f.site, detail={
                "fault": f.index, "kind": f.kind, "target": f.target, "phase": phase, **detail})
        finally:
            if own:
                store.close()

    def run(self) -> list[Outcome]:
        for p in self.schedule.items:
            self._push(p.at_s, self._apply, p.fault)
        next_look = 0.0
        try:
            while not self.stop.is_set():
                if self._errors:
                    raise DilocoError(self._errors[0])
                if self.now() >= next_look:  # a run that ended: its lab may run another run next
                    next_look = self.now() + RUN_LOOK_S
                    if self._run_ended():
                        break
                if not self._heap and not any(w.is_alive() for w in self._workers.values()):
                    break
                wait = self._heap[0][0] - self.now() if self._heap else 0.5
                if wait > 0:
                    self.stop.wait(min(wait, 0.5))
                    continue
                _, _, fn, f = heapq.heappop(self._heap)
                try:
                    fn(f)
                except DilocoError as e:
                    raise DilocoError(f"fault {f.index} ({f.describe()}): {e}") from None
        finally:
            self._finish()
        if self._errors:
            raise DilocoError(self._errors[0])
        return [self.outcomes[p.fault.index] for p in self.schedule.items]

    def _run_ended(self) -> bool:
        """True once the run left the active states: the faults not yet applied are skipped."""
        from dilococtl.states import ACTIVE_RUN_STATES
        from dilococtl.store import Store

        with Store.open(self.store_path) as store:
            state = store.get_run(self.run_id).state
        if state in ACTIVE_RUN_STATES:
            return False
        left = [o for o in self.outcomes.values() if o.applied_at is None]
        for o in left:
            o.detail["skipped"] = f"the run was {state} first"
        self.say(f"chaos: run {self.run_id} is {state}: " + (
            f"the {len(left)} fault(s) not yet applied are skipped" if left else "ending what still holds"))
        return True

    def _finish(self) -> None:
        """End what is still applied (restoring it); wait for kill workers (no relaunch once stopped)."""
        self.stop.set()
        for p in reversed(self.schedule.items):
            out = self.outcomes[p.fault.index]
            if p.fault.kind != "kill" and out.applied_at is not None and out.ended_at is None:
                try:
                    self._end(p.fault)
                except Exception as e:
                    self._errors.append(f"fault {p.fault.index} ({p.fault.describe()}): restoring failed: {e}")
        self._errors += self.ledger.restore_all()  # nothing should be left; if it is, it goes too
        for index, w in self._workers.items():
            if w.is_alive():
                self.say(f"chaos: waiting for fault {index}'s kill/relaunch to finish")
            w.join(600)

    # --- apply and end ---------------------------------------------------------------------------

    def _apply(self, f: Fault) -> None:
        from dilococtl.lab import faults

        out = self.outcomes[f.index]
        out.applied_at = self.now()
        key = f"{f.index}:{f.kind}"
        if f.kind == "kill":
            self._start_kill(f)
            return
        if f.kind in ("cut", "flap"):
            faults.cut(self.state, f.sites)
            self.ledger.add(key, lambda: faults.heal(self.state, f.sites))
            if f.kind == "flap":
                out.detail["toggles"] = 1
                half, k = f.period_s / 2, 1
                while k * half < f.for_s - 1e-6:
                    self._push(out.applied_at + k * half, self._toggle, f)
                    k += 1
        elif f.kind == "degrade":
            before = faults.degrade(*f.sites, rate=f.rate, rtt=f.rtt)
            self.ledger.add(key, lambda: faults.restore_shapes(before))
            out.detail["before"] = {k: {"rate_bit": v.rate_bit, "rtt_ms": v.delay_ms * 2} for k, v in before.items()}
        elif f.kind == "loss":
            faults.add_loss(self.state, f.sites, f.percent)
            self.ledger.add(key, lambda: faults.remove_loss(self.state, f.sites, f.percent))
        elif f.kind == "slow":
            dc = faults.DutyCycle([n.netns for n in self.state.nodes if n.name in f.nodes], f.factor)
            dc.start()
            self.ledger.add(key, lambda: (dc.stop(), dc)[1])
        self._event(f, "start", f.describe(), planned_at=out.planned_at)
        self._push(out.applied_at + f.for_s, self._end, f)

    def _toggle(self, f: Fault) -> None:
        from dilococtl.lab import faults

        key = f"{f.index}:{f.kind}"
        if self.outcomes[f.index].ended_at is not None:
            return
        if key in self.ledger.keys():
            self.ledger.restore(key)
        else:
            faults.cut(self.state, f.sites)
            self.ledger.add(key, lambda: faults.heal(self.state, f.sites))
        self.outcomes[f.index].detail["toggles"] += 1

    def _end(self, f: Fault) -> None:
        out = self.outcomes[f.index]
        if out.ended_at is not None:
            return
        result = self.ledger.restore(f"{f.index}:{f.kind}")
        out.ended_at = self.now()
        if f.kind == "loss":
            out.detail["dropped_packets"] = result
        if f.kind == "slow" and result is not None:
            out.detail.update(cycles=result.cycles, processes=len(result.stopped),
                              stopped_share=round(result.stopped_s / max(out.ended_at - out.applied_at, 1e-9), 3))
        what = {"slow": f"{f.target} runs at full speed again", "kill": ""}.get(f.kind, f"{f.target} restored")
        why = "" if not self.stop.is_set() or out.applied_at is None else " (chaos stopped early)"
        self._event(f, "end", what + why, **out.detail)

    def _start_kill(self, f: Fault) -> None:
        self._event(f, "start", f.describe() + f" (grace {fmt_s(f.grace_s)})",
                    planned_at=self.outcomes[f.index].planned_at)
        w = threading.Thread(target=self._kill, args=(f,), daemon=True, name=f"kill-{f.target}")
        self._workers[f.index] = w
        w.start()

    def _kill(self, f: Fault) -> None:
        """Worker: ops.kill, then (restart_after later, unless stopped) resume the node's run site."""
        from dilococtl.lab import ops

        out = self.outcomes[f.index]
        try:
            pids = ops.kill(f.target, f.grace_s)
            out.detail["signalled"] = len(pids)
            if f.restart_after_s is None:
                out.ended_at = self.now()
                self._event(f, "end", f"{f.target} killed ({len(pids)} processes), not relaunched", **out.detail)
                return
            if self.stop.wait(max(0.0, out.applied_at + f.restart_after_s - self.now())):
                out.ended_at = self.now()
                self._event(f, "end", f"{f.target} killed, not relaunched: chaos stopped first", **out.detail)
                return
            self._relaunch(f, out)
        except Exception as e:  # the main loop stops the replay and reports it
            self._errors.append(f"fault {f.index} ({f.describe()}): {e}")

    def _relaunch(self, f: Fault, out: Outcome) -> None:
        from dilococtl import resume as resume_mod
        from dilococtl.states import ACTIVE_RUN_STATES
        from dilococtl.store import Store

        addresses = {n.address for n in self.state.nodes if n.name in f.nodes}
        with Store.open(self.store_path) as store:
            run = store.get_run(self.run_id)
            site = next(s.name for s in store.sites(run.id) if addresses & set(s.hosts))
            if run.state not in ACTIVE_RUN_STATES:
                out.ended_at = self.now()
                self._event(f, "end", f"{f.target} not relaunched: the run is {run.state}", store, **out.detail)
                return
            for attempt in range(1, RELAUNCH_TRIES + 1):
                try:
                    res = resume_mod.resume(run, store=store, sites=[site],
                                            progress=lambda m: self.say(f"chaos: {m}"))
                    if site in res.blocked:
                        raise DilocoError(f"relaunch of {site} blocked: {res.blocked[site]}")
                    out.detail["relaunch_tries"] = attempt
                    break
                except BadInput:
                    raise
                except DilocoError as e:
                    # a collector (launch --wait, watch) may be restarting the coordinator the kill took down
                    # at the same moment: its port is then taken for this relaunch; the next try finds it up
                    if attempt == RELAUNCH_TRIES:
                        raise
                    self.say(f"chaos: relaunch of {site} failed ({e}); trying again in {RELAUNCH_RETRY_S:g}s")
                    if self.stop.wait(RELAUNCH_RETRY_S):
                        out.ended_at = self.now()
                        self._event(f, "end", f"{site} not relaunched: chaos stopped first", store, **out.detail)
                        return
                    run = store.get_run(run.id)
            done = next((r for r in res.relaunched if r.site == site), None)
            out.detail.update(relaunched=done is not None, attempt=done.attempt if done else None,
                              round=done.round if done else None)
            out.ended_at = self.now()
            msg = (f"{site} relaunched (attempt {done.attempt}, "
                   + (f"from round {done.round})" if done.round is not None else "from scratch)")
                   if done else f"{site} was not dead at relaunch time: nothing relaunched")
            self._event(f, "end", msg, store, **out.detail)


# --- the command ---------------------------------------------------------------------------------

LAUNCH_WAIT_S = 60.0  # a launching run gets this long to start


def choose_run(store, run_arg: str | None, state: LabState, say, wait_s: float = LAUNCH_WAIT_S):
    """--run, else the newest running run (a launching one gets wait_s to start); it must be this lab's."""
    from dilococtl.states import RunState

    deadline = time.monotonic() + wait_s
    told = False
    while True:
        if run_arg:
            run = store.get_run(run_arg)
        else:
            runs = [r for r in store.list_runs() if r.state in (RunState.RUNNING, RunState.LAUNCHING)]
            run = runs[0] if runs else None
            if run is None:
                raise BadInput("no running run in this DILOCOCTL_HOME: launch one first, or name it with --run")
        check_run_in_lab(run, store, state)
        if run.state == RunState.RUNNING:
            return run
        if run.state != RunState.LAUNCHING:
            raise BadInput(f"run {run.id} is {run.state}: chaos replays faults against a running run")
        if time.monotonic() > deadline:
            raise BadInput(f"run {run.id} is still launching after {wait_s:.0f}s")
        if not told:
            say(f"chaos: run {run.id} is launching; waiting up to {wait_s:.0f}s for it to start")
            told = True
        time.sleep(1.0)


def check_run_in_lab(run, store, state: LabState) -> None:
    """Every host of every site of the run is a node of this home's lab."""
    addresses = {n.address for n in state.nodes}
    hosts = [h for s in store.sites(run.id) for h in s.hosts]
    outside = [h for h in hosts if h not in addresses]
    if not hosts or outside:
        raise BadInput(f"run {run.id} is not a run of this lab ({state.id}): "
                       f"{outside[0] if outside else 'it has no hosts'} is no lab node")


def check_kills(scenario: Scenario, run, store, state: LabState) -> None:
    """A kill that relaunches must hit a node of the run: its site is what resume starts again."""
    hosts = {h for s in store.sites(run.id) for h in s.hosts}
    for f in scenario.faults:
        if f.kind == "kill" and f.restart_after_s is not None:
            addresses = {n.address for n in state.nodes if n.name in f.nodes}
            if not addresses & hosts:
                raise BadInput(f"fault {f.index} ({f.describe()}): {f.target} runs no site of run {run.id}: "
                               "nothing to relaunch")


def execute(schedule: Schedule, *, run, state: LabState, store_path: Path, say) -> tuple[list[Outcome], int | None]:
    """Replay `schedule` against `run`; SIGINT/SIGTERM stop it early (everything changed is restored
    first). Returns the outcomes and the signal that stopped it (None: it ran to the end)."""
    stop = threading.Event()
    got: list[int] = []

    def handler(signum, _frame) -> None:
        got.append(signum)
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        replay = Replay(schedule, state=state, run_id=run.id, start=run.created, store_path=store_path,
                        say=say, stop=stop)
        last = max((p.at_s + p.fault.for_s for p in schedule.items), default=0.0)
        say(f"chaos: run {run.id}, {len(schedule.items)} faults, seed {schedule.seed}; now {replay.now():.0f}s "
            f"into the run, the last fault due to end near {last:.0f}s")
        outcomes = replay.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return outcomes, (got[0] if got else None)
