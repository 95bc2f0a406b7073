"""The sbatch script of one Slurm site: one job, one srun task per node, torchrun in each.

What the script does, and why:

- `--requeue`: a preempted or failed-node job goes back to the queue and restarts; the trainer
  starts again from the site's newest checkpoint (trainer.rules.config run.resume) and heals from peers.
- `--signal=B:USR1@LEAD`: Slurm signals the batch shell LEAD seconds before the time limit. The shell
  then sends SIGTERM (the signal the trainer saves a checkpoint on, trainer/modes/loop.py) to every task of
  its steps with `scancel -s TERM JOBID` (measured: srun itself, on SIGTERM, kills its step instead of
  forwarding; scancel without --full spares the batch shell). If the trainer saved its checkpoint the
  shell requeues its own job: a run longer than the partition's limit goes on as a chain of jobs.
  LEAD is the trainer's grace plus SIGNAL_MARGIN_S; Slurm may signal up to a minute early, which
  only costs time.
- the batch shell's own lines (slurm-JOBID.out) carry the time, as `dilococtl logs` reads stamps;
- each node's task writes `nodeN.log` and `nodeN.exit` (N = SLURM_NODEID) under the site's directory,
  as an SSH node's wrapper does, so logs and exit codes are read the same way; exit 143 = preempted
  after a checkpoint (the trainer's marker file), as on SSH nodes.
- torchrun uses c10d rendezvous on the allocation's first node; the rendezvous id carries the job's
  restart count, so a requeued job never meets the state of its previous start.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

from dilococtl.slurm.config import SlurmSite
from trainer.rules.config import torchrun_shutdown_s

SIGNAL_MARGIN_S = 30  # beyond the trainer's grace: torchrun's teardown and the requeue itself
TERM_SIGNAL = "TERM"  # what the trainer checkpoints on (trainer/modes/loop.py installs a SIGTERM handler)
BATCH_SIGNAL = "USR1"  # what Slurm sends the batch shell before the time limit (the shell relays TERM)


@dataclass(kw_only=True, slots=True)
class SiteJob:
    """What the job of one site runs: paths on the cluster's shared filesystem and the trainer's knobs."""

    run_id: str  # the run's id (job name, marker environment)
    run_dir: str  # the run's directory on the cluster (the job's working directory)
    python: str  # absolute path of the cluster's interpreter (the venv provision made)
    config_path: str  # the site's trainer config.toml
    nproc_per_node: int  # torchrun processes per node
    rdzv_port: int  # c10d rendezvous port on the first node of the allocation
    grace_s: float  # the trainer's checkpoint grace (run.grace_s)
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the trainer (Lighthouse URL...)


def signal_lead_s(grace_s: float) -> int:
    """Seconds before the time limit the batch shell is signalled."""
    return math.ceil(grace_s) + SIGNAL_MARGIN_S


def job_name(run_id: str, site: str) -> str:
    return f"dilococtl-{run_id}-{site}"


def sbatch_options(site: SlurmSite, job: SiteJob) -> list[str]:
    """The #SBATCH options, in order: the site's request, then dilococtl's, then sbatch_args."""
    opts = [f"--job-name={job_name(job.run_id, site.name)}", f"--nodes={site.nodes}", "--ntasks-per-node=1"]
    if site.partition:
        opts.append(f"--partition={site.partition}")
    if site.account:
        opts.append(f"--account={site.account}")
    if site.qos:
        opts.append(f"--qos={site.qos}")
    if site.gpus_per_node > 0:
        opts.append(f"--gpus-per-node={site.gpus_per_node}")
    if site.time_limit:
        opts.append(f"--time={site.time_limit}")
    if site.constraint:
        opts.append(f"--constraint={site.constraint}")
    site_dir = f"{job.run_dir}/{site.name}"
    opts += ["--requeue", f"--signal=B:{BATCH_SIGNAL}@{signal_lead_s(job.grace_s)}",
             f"--chdir={job.run_dir}", f"--output={site_dir}/slurm-%j.out", "--open-mode=append"]
    return opts + list(site.sbatch_args)


def _node_command(site: SlurmSite, job: SiteJob) -> str:
    """What each srun task (one per node) runs, as one shell string."""
    site_dir = shlex.quote(f"{job.run_dir}/{site.name}")
    env = {"PYTHONUNBUFFERED": "1", **job.env}
    env_s = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if v)
    torchrun = (f"{shlex.quote(job.python)} -m torch.distributed.run --nnodes={site.nodes} "
                f"--nproc_per_node={job.nproc_per_node} --rdzv_backend=c10d "
                f'--rdzv_endpoint="$DILOCOCTL_HEAD:{job.rdzv_port}" '
                f'--rdzv_id="$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}" '
                f"--shutdown-timeout={torchrun_shutdown_s(job.grace_s)} --tee=3 -m trainer "
                f"--config {shlex.quote(job.config_path)}")
    # The task's own TERM (scancel -s TERM reaches every process of the step) must not end it before
    # torchrun does: a handler (not an ignore, which children would inherit), then wait again. The trainer
    # names its marker by torchrun's GROUP_RANK, which c10d rendezvous assigns in join order, not by
    # SLURM_NODEID: any marker of this start means the site checkpointed.
    return (f"n=$SLURM_NODEID; d={site_dir}; rm -f \"$d/node$n.preempted\" \"$d/node$n.exit\"; "
            f"env {env_s} {torchrun} >> \"$d/node$n.log\" 2>&1 & child=$!; trap 'true' TERM INT; "
            f"while :; do wait $child; rc=$?; kill -0 $child 2>/dev/null || break; done; "
            f"[ $rc -ne 0 ] && ls \"$d\"/node*.preempted >/dev/null 2>&1 && rc=143; echo $rc > \"$d/node$n.exit\"; "
            "exit $rc")


def batch_script(site: SlurmSite, job: SiteJob) -> str:
    """The whole sbatch script of `site`'s job (bash)."""
    lines = ["#!/bin/bash"] + [f"#SBATCH {o}" for o in sbatch_options(site, job)]
    site_dir = shlex.quote(f"{job.run_dir}/{site.name}")
    lines += [
        f"# dilococtl run {job.run_id}, site {site.name}",
        f"export DILOCOCTL_RUN_ID={shlex.quote(job.run_id)}",
        f"mkdir -p {site_dir}",
        "timelimit=0",
        # before the time limit: checkpoint (TERM to the tasks), then requeue below
        f"trap 'timelimit=1; scancel -s {TERM_SIGNAL} \"$SLURM_JOB_ID\"' {BATCH_SIGNAL}",
        # scancel and preemption TERM the tasks themselves; the shell stays to record the outcome
        "trap 'true' TERM",
        'export DILOCOCTL_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'echo "$(date "+%F %T") dilococtl: job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST, '
        'rendezvous $DILOCOCTL_HEAD"',
        f"srun --kill-on-bad-exit=0 --ntasks-per-node=1 bash -c {shlex.quote(_node_command(site, job))} & step=$!",
        "while :; do wait $step; rc=$?; kill -0 $step 2>/dev/null || break; done",
        # chained jobs: the time limit came, the trainer checkpointed: go on in a fresh job
        f'if [ $timelimit = 1 ] && [ $rc -ne 0 ] && ls {site_dir}/node*.preempted >/dev/null 2>&1; then',
        '  echo "$(date "+%F %T") dilococtl: time limit: checkpoint saved, requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"
