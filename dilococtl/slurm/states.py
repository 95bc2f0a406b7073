"""Slurm job states as dilococtl's site states (dilococtl.states.SiteState).

A queued job is STARTING, not PENDING: dilococtl's PENDING means "never started" and no site moves
back to it, while a requeued job waits in the queue again. A job that ended by the scheduler's hand
(preempted, timed out) or with the trainer's preempted code 143 (checkpoint saved) is PREEMPTED: resume
can carry it on. A suspended job keeps its allocation but runs nothing: LOST, "its process may still
run", as for a node that stopped answering.
"""

from __future__ import annotations

from dilococtl.slurm.parse import JobInfo
from dilococtl.states import SiteState

EXIT_PREEMPTED = 143  # trainer.modes.loop.EXIT_PREEMPTED: stopped on SIGTERM after saving a checkpoint

_STATES: dict[str, SiteState] = {
    **dict.fromkeys(("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"),
                    SiteState.STARTING),
    **dict.fromkeys(("RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING"), SiteState.RUNNING),
    **dict.fromkeys(("SUSPENDED", "STOPPED"), SiteState.LOST),
    "COMPLETED": SiteState.FINISHED,
    "CANCELLED": SiteState.STOPPED,
    **dict.fromkeys(("PREEMPTED", "TIMEOUT", "DEADLINE"), SiteState.PREEMPTED),
    **dict.fromkeys(("FAILED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"), SiteState.FAILED),
}

# ended jobs that `resume --auto` may submit again (the "preempted, failed, node fail, timeout")
RESUBMITTABLE = ("PREEMPTED", "TIMEOUT", "NODE_FAIL", "FAILED", "BOOT_FAIL", "DEADLINE")


def site_state(job: JobInfo) -> SiteState:
    """The site state a job in this state stands for (an unknown state: FAILED, never silently live)."""
    if job.state == "FAILED" and job.exit_code == EXIT_PREEMPTED:
        return SiteState.PREEMPTED
    return _STATES.get(job.state, SiteState.FAILED)


def detail(job: JobInfo) -> str:
    """One line for status and watch: state, reason, nodes, restarts."""
    parts = [f"job {job.job_id} {job.state.lower()}"]
    if job.reason:
        parts.append(f"({job.reason})")
    if job.nodes:
        parts.append(f"on {job.nodes}")
    if job.restarts:
        parts.append(f"restarts {job.restarts}")
    if job.exit_code is not None:
        parts.append(f"exit {job.exit_code}" + (f" signal {job.signal}" if job.signal else ""))
    return " ".join(parts)
