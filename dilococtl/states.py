"""The states of runs, sites and nodes, and the moves between them, written once.

Values are the strings stored in SQLite (`runs.state`, `sites.state`, `nodes.state`): a StrEnum
member compares equal to its string, so rows written before these enums read back unchanged.
`check_run_move` and `check_site_move` refuse an impossible move; the store calls them on every
state change, so no caller can skip them.
"""

from __future__ import annotations

from enum import StrEnum

from dilococtl.errors import BadInput


class RunState(StrEnum):
    LAUNCHING = "launching"  # recorded, processes being started
    RUNNING = "running"  # at least one site trains
    FINISHED = "finished"  # every site finished its rounds
    FAILED = "failed"  # a site failed (or the launch did)
    STOPPED = "stopped"  # the operator stopped it
    PREEMPTED = "preempted"  # sites were preempted and saved a checkpoint on SIGTERM


class SiteState(StrEnum):
    """Where the processes of a site (or of one node) are."""

    PENDING = "pending"  # recorded, never started
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    LOST = "lost"  # the node stopped answering; its process may still run


ACTIVE_RUN_STATES = (RunState.LAUNCHING, RunState.RUNNING, RunState.PREEMPTED)  # a run that still holds its name
ENDED_RUN_STATES = (RunState.FINISHED, RunState.FAILED, RunState.STOPPED, RunState.PREEMPTED)  # set runs.finished
LIVE_SITE_STATES = (SiteState.RUNNING, SiteState.STARTING, SiteState.LOST)  # a process may still be there

# run state -> states it may move to; failed/stopped/preempted -> launching is `dilococtl resume`;
# finished is final.
RUN_MOVES: dict[RunState, tuple[RunState, ...]] = {
    RunState.LAUNCHING: (RunState.RUNNING, RunState.FAILED, RunState.STOPPED, RunState.PREEMPTED),
    RunState.RUNNING: (RunState.FINISHED, RunState.FAILED, RunState.STOPPED, RunState.PREEMPTED),
    RunState.PREEMPTED: (RunState.LAUNCHING, RunState.RUNNING, RunState.FAILED, RunState.STOPPED),
    RunState.FAILED: (RunState.LAUNCHING,),
    RunState.STOPPED: (RunState.LAUNCHING,),
    RunState.FINISHED: (),
}

# site/node state -> states it may move to. A site's state is derived from its nodes' processes
# (runs.refresh), so most moves happen; what never happens: back to pending, and out of finished
# other than by a relaunch (resume restarts every node of a site that had one finished node).
_ANY_BUT_PENDING = tuple(s for s in SiteState if s is not SiteState.PENDING)
SITE_MOVES: dict[SiteState, tuple[SiteState, ...]] = {
    **{s: _ANY_BUT_PENDING for s in SiteState},
    SiteState.FINISHED: (SiteState.STARTING, SiteState.RUNNING),
}


def run_state(value: str) -> RunState:
    """`value` as a RunState; BadInput naming the known states otherwise."""
    try:
        return RunState(value)
    except ValueError:
        raise BadInput(f"unknown run state {value!r} (known: {', '.join(RunState)})") from None


def site_state(value: str) -> SiteState:
    """`value` as a SiteState; BadInput naming the known states otherwise."""
    try:
        return SiteState(value)
    except ValueError:
        raise BadInput(f"unknown site/node state {value!r} (known: {', '.join(SiteState)})") from None


def check_run_move(what: str, old: str, new: str) -> RunState:
    """Refuse a run moving from `old` to `new` (staying put is always allowed); returns `new`."""
    o, n = run_state(old), run_state(new)
    if n is not o and n not in RUN_MOVES[o]:
        raise BadInput(f"{what} is {o}: it cannot become {n}")
    return n


def check_site_move(what: str, old: str, new: str) -> SiteState:
    """Refuse a site or node moving from `old` to `new` (staying put is always allowed); returns `new`."""
    o, n = site_state(old), site_state(new)
    if n is not o and n not in SITE_MOVES[o]:
        raise BadInput(f"{what} is {o}: it cannot become {n}")
    return n
