"""Slurm commands through a login node: submit, query, stop (signal first, kill after the grace).

`login` is anything with dilococtl.nodes.Node's `run(cmd, timeout) -> CmdResult` (and
`write_text` to submit): an SSH login node, the lab's, or a LocalNode where Slurm is local.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from dilococtl.errors import DilocoError
from dilococtl.nodes import CmdResult
from dilococtl.slurm.parse import (
    SACCT_FORMAT,
    SQUEUE_FORMAT,
    JobInfo,
    parse_sacct_parsable,
    parse_squeue_json,
    parse_squeue_text,
)

QUERY_TIMEOUT_S = 60.0  # one squeue/sacct/sbatch call on a busy login node
POLL_S = 1.0  # between state queries while waiting for a job to end
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED")  # final states of a job (REQUEUED is not: it queues again)


class Login(Protocol):
    host: str

    def run(self, cmd: str, timeout: float = 60, env: dict | None = None) -> CmdResult: ...
    def write_text(self, remote: str, text: str) -> None: ...


def _last_line(r: CmdResult) -> str:
    lines = (r.stderr.strip() or r.stdout.strip()).splitlines()
    return lines[-1].strip() if lines else f"exit {r.rc}"


def submit(login: Login, script: str, script_path: str) -> str:
    """Write `script` to `script_path` on the cluster and sbatch it; returns the job id."""
    login.write_text(script_path, script)
    r = login.run(f"sbatch --parsable {shlex.quote(script_path)}", timeout=QUERY_TIMEOUT_S)
    job_id = r.stdout.strip().split(";")[0] if r.ok else ""
    if not job_id.isdigit():
        raise DilocoError(f"sbatch on {login.host} failed: {_last_line(r)}")
    return job_id


def query(login: Login, job_ids: Iterable[str]) -> dict[str, JobInfo]:
    """The jobs' states: squeue's JSON where the installed Slurm has it, else its text; jobs squeue
    no longer shows (ended longer ago than MinJobAge) from sacct where accounting keeps them."""
    ids = {str(j) for j in job_ids}
    if not ids:
        return {}
    out: dict[str, JobInfo] = {}
    r = login.run("squeue --json", timeout=QUERY_TIMEOUT_S)
    if r.ok:
        out = {j.job_id: j for j in parse_squeue_json(r.stdout, ids)}
    else:
        r = login.run(f"squeue -h -t all -o {shlex.quote(SQUEUE_FORMAT)} -j {','.join(sorted(ids))}",
                      timeout=QUERY_TIMEOUT_S)
        out = {j.job_id: j for j in parse_squeue_text(r.stdout) if j.job_id in ids} if r.ok else {}
    missing = ids - set(out)
    if missing:
        r = login.run(f"sacct -X -n --parsable2 -o {SACCT_FORMAT} -j {','.join(sorted(missing))}",
                      timeout=QUERY_TIMEOUT_S)
        if r.ok:
            out.update({j.job_id: j for j in parse_sacct_parsable(r.stdout) if j.job_id in missing})
    return out


def wait_ended(login: Login, job_id: str, timeout_s: float, *, sleep: Callable[[float], None] = time.sleep,
               clock: Callable[[], float] = time.monotonic) -> JobInfo | None:
    """Poll until the job is in a final state (returned) or `timeout_s` passed (None)."""
    deadline = clock() + timeout_s
    while True:
        job = query(login, [job_id]).get(job_id)
        if job is not None and job.state in ENDED:
            return job
        if clock() >= deadline:
            return None
        sleep(POLL_S)


def stop(login: Login, job_id: str, grace_s: float, *, sleep: Callable[[float], None] = time.sleep,
         clock: Callable[[], float] = time.monotonic) -> JobInfo | None:
    """SIGTERM the job's tasks (the trainer saves its checkpoint; the batch shell then ends the job),
    then, if it has not ended within `grace_s`, cancel it outright (Slurm's SIGKILL after KillWait).
    Returns the job's final record (None if Slurm no longer shows it)."""
    r = login.run(f"scancel -s TERM {shlex.quote(job_id)}", timeout=QUERY_TIMEOUT_S)
    if not r.ok:
        raise DilocoError(f"scancel -s TERM {job_id} on {login.host} failed: {_last_line(r)}")
    job = wait_ended(login, job_id, grace_s, sleep=sleep, clock=clock)
    if job is not None:
        return job
    r = login.run(f"scancel {shlex.quote(job_id)}", timeout=QUERY_TIMEOUT_S)
    if not r.ok:
        raise DilocoError(f"scancel {job_id} on {login.host} failed: {_last_line(r)}")
    return wait_ended(login, job_id, 30.0, sleep=sleep, clock=clock) or query(login, [job_id]).get(job_id)
