"""Where a site's processes run, behind one interface: launch, status, stop, logs for one site.

Two schedulers run sites today: SSH (dilococtl starts torchrun on every host itself; that code is in
dilococtl.runs and dilococtl.procs) and Slurm (one batch job per site through the cluster's login
node: `SlurmBackend`, over dilococtl.slurm). The commands that operate a run (launch, status, stop,
logs, resume, doctor, provision) are to ask `backend_for(site)` instead of branching on the scheduler,
so a Kubernetes backend would be one more class.

What a backend is handed and returns is scheduler-neutral: a `SiteLaunch` (the site's trainer config,
run directory, interpreter, rendezvous port, grace and environment) and a `SiteStatus` (dilococtl's
site state, one line of detail, the nodes). A Slurm site's handle is its job id (recorded in SQLite
by the caller).

The run commands reach Slurm sites through the functions at the end: `submit_jobs` (launch, and resume's
resubmission), `refresh_jobs` (status, watch, wait: the job's state into its site's one node row, the
login node), `stop_jobs` (stop) and `job_log_paths` (logs). A Slurm site's node row has no pid, so the
SSH code paths that signal or probe processes pass it by, and those that read files on a site's first
node (metrics, checkpoints, logs) read them through its login node on the shared filesystem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from dilococtl.slurm import commands, script, states
from dilococtl.slurm.commands import Login
from dilococtl.slurm.config import SlurmSite
from dilococtl.slurm.parse import JobInfo
from dilococtl.states import SiteState


@dataclass(kw_only=True, slots=True)
class SiteLaunch:
    """What one site's launch needs, whatever runs it."""

    run_id: str
    run_dir: str  # the run's directory where the site's nodes see it (a Slurm cluster's shared filesystem)
    python: str  # absolute path of the site's interpreter
    config_path: str  # the site's trainer config.toml (under run_dir/SITE/)
    config_toml: str  # its text, written there before the start
    nproc_per_node: int
    rdzv_port: int  # torchrun's rendezvous port on the site's first node
    grace_s: float  # run.grace_s: the trainer's checkpoint time on SIGTERM
    env: dict[str, str] = field(default_factory=dict)  # the trainer's environment (Lighthouse URL, key paths...)


@dataclass(kw_only=True, slots=True)
class SiteStatus:
    state: SiteState  # dilococtl's site state
    detail: str  # one line for status and watch (a job's state, pending reason, nodes)
    nodes: str = ""  # where it runs ("" while queued)
    resubmit: bool = False  # it ended by preemption, node failure or time limit: resume --auto may start it again


class SiteBackend(Protocol):
    """One site's processes, as one unit."""

    def launch(self, spec: SiteLaunch) -> str:
        """Start the site; returns its handle (a Slurm job id)."""
        ...

    def status(self, handle: str) -> SiteStatus: ...

    def stop(self, handle: str, grace_s: float) -> SiteStatus:
        """SIGTERM first (the trainer checkpoints), kill after `grace_s`."""
        ...

    def log_paths(self, spec: SiteLaunch, nodes: int) -> list[str]:
        """The files `dilococtl logs` merges for this site, where the login/leader node reads them."""
        ...


class SlurmBackend:
    """A Slurm cluster: one sbatch job per site, submitted, queried and cancelled through `login`."""

    def __init__(self, login: Login, site: SlurmSite) -> None:
        self.login = login
        self.site = site

    def _job(self, spec: SiteLaunch) -> script.SiteJob:
        return script.SiteJob(run_id=spec.run_id, run_dir=spec.run_dir, python=spec.python,
                              config_path=spec.config_path, nproc_per_node=spec.nproc_per_node,
                              rdzv_port=spec.rdzv_port, grace_s=spec.grace_s, env=dict(spec.env))

    def script(self, spec: SiteLaunch) -> str:
        """The sbatch script launch submits (launch --dry-run prints it)."""
        return script.batch_script(self.site, self._job(spec))

    def launch(self, spec: SiteLaunch) -> str:
        self.login.write_text(spec.config_path, spec.config_toml)
        path = f"{spec.run_dir}/{self.site.name}/job.sbatch"
        return commands.submit(self.login, self.script(spec), path)

    def _status(self, handle: str, job: JobInfo | None) -> SiteStatus:
        if job is None:  # older than MinJobAge and no accounting: nothing says how it ended
            return SiteStatus(state=SiteState.LOST, detail=f"job {handle}: Slurm no longer shows it")
        return SiteStatus(state=states.site_state(job), detail=states.detail(job), nodes=job.nodes,
                          resubmit=job.state in states.RESUBMITTABLE)

    def status(self, handle: str) -> SiteStatus:
        return self._status(handle, commands.query(self.login, [handle]).get(handle))

    def stop(self, handle: str, grace_s: float) -> SiteStatus:
        return self._status(handle, commands.stop(self.login, handle, grace_s))

    def log_paths(self, spec: SiteLaunch, nodes: int) -> list[str]:
        site_dir = f"{spec.run_dir}/{self.site.name}"
        return [f"{site_dir}/node{k}.log" for k in range(nodes)]


def backend_for(site, login: Login) -> SiteBackend:
    """The backend of a run spec's [[sites]] table (dilococtl.spec_types.SiteSection) reached through `login`.
    SSH sites are still driven by dilococtl.runs directly: refused here until they move behind it."""
    from dilococtl.slurm.config import slurm_site

    if site.scheduler == "slurm":
        return SlurmBackend(login, slurm_site(site))
    raise NotImplementedError(f"site {site.name}: the SSH backend is dilococtl.runs' own code, not yet a SiteBackend")


# --- a run's scheduler sites: what runs.launch, refresh and stop call (duck-typed store and pool: this
# module is imported by dilococtl.plan, below dilococtl.store and dilococtl.runs) ---------------------

def _section(spec, name: str):
    return next(s for s in spec.sites if s.name == name)


def submit_jobs(jobs: list, *, spec, store, pool, run_id: str, progress) -> list[tuple[str, str, str]]:
    """Submit each planned job (dilococtl.plan.JobPlan) through its login node and record it: the site's
    login node row (rank 0, where its metrics and logs are read), its job id. Returns (site, login, job
    id) of what was submitted, for the caller to cancel if the launch fails after."""
    out = []
    before = store.site_jobs(run_id)
    for job in jobs:
        if job.site in before:  # a resubmission: the old job must not run beside the new one (a LOST site's)
            cancel_jobs([(job.site, before[job.site]["login"], before[job.site]["job_id"])], pool=pool,
                        progress=lambda _m: None)
        progress(f"submitting {job.site}'s job ({job.nnodes} nodes) through {job.login}")
        backend = backend_for(_section(spec, job.site), pool.get(job.login))
        job_id = backend.launch(job.launch)
        out.append((job.site, job.login, job_id))
        store.add_job_node(run_id, job.site, job.login, run_dir=job.launch.run_dir, log_path=job.log_paths[0])
        store.set_node(run_id, job.site, job.login, state=SiteState.STARTING)
        store.set_site_job(run_id, job.site, job_id=job_id, login=job.login, run_dir=job.launch.run_dir)
        progress(f"{job.site}: Slurm job {job_id}")
    return out


def cancel_jobs(submitted: list[tuple[str, str, str]], *, pool, progress) -> None:
    """A failed launch's jobs, cancelled outright (nothing of them has trained yet)."""
    for site, login, job_id in submitted:
        progress(f"launch failed: cancelling {site}'s job {job_id}")
        try:
            pool.get(login).run(f"scancel {int(job_id)}", timeout=commands.QUERY_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - best effort: the launch's own error is the one to report
            pass


def refresh_jobs(run, *, store, pool) -> dict[str, SiteStatus]:
    """Each live job's state from the scheduler into its site's node row and the job's status line.
    A login node that does not answer leaves the site LOST (its job may still run)."""
    from dilococtl.errors import Unreachable

    out: dict[str, SiteStatus] = {}
    jobs = store.site_jobs(run.id)
    if not jobs:
        return out
    spec = run.spec()
    for site, job in jobs.items():
        node = next((n for n in store.nodes(run.id, site) if n.host == job["login"]), None)
        if node is None or node.state not in (SiteState.RUNNING, SiteState.STARTING, SiteState.LOST):
            continue
        try:
            st = backend_for(_section(spec, site), pool.get(job["login"])).status(job["job_id"])
        except Unreachable as e:
            if node.state != SiteState.LOST:
                store.set_node(run.id, site, job["login"], state=SiteState.LOST)
                store.add_event(run.id, "error", f"login node {job['login']} stopped answering: {e}", site=site)
            continue
        out[site] = st
        if st.detail != job["detail"] or st.nodes != job["nodes"]:
            store.set_job_status(run.id, site, detail=st.detail, nodes=st.nodes)
            store.add_event(run.id, "job", st.detail, site=site)
        store.set_node(run.id, site, job["login"], state=st.state)
    return out


def stop_jobs(run, *, store, pool, grace_s: float, progress) -> None:
    """Every live job of the run: scancel TERM (the trainer checkpoints), a plain scancel after the grace."""
    spec = run.spec()
    for site, job in store.site_jobs(run.id).items():
        node = next((n for n in store.nodes(run.id, site) if n.host == job["login"]), None)
        if node is None or node.state not in (SiteState.RUNNING, SiteState.STARTING, SiteState.LOST):
            continue
        progress(f"scancel -s TERM {site}'s job {job['job_id']} (kill after {grace_s:.0f}s)")
        st = backend_for(_section(spec, site), pool.get(job["login"])).stop(job["job_id"], grace_s)
        store.set_job_status(run.id, site, detail=st.detail, nodes=st.nodes)
        progress(f"{site}: {st.detail}")


def job_log_paths(run, store) -> list[tuple[str, int | None, str, str]]:
    """(site, node rank or None for the batch shell's output, login host, path) of each job's files that
    `dilococtl logs` merges: every node's torchrun output and the current job's slurm-JOBID.out."""
    jobs = store.site_jobs(run.id)
    spec = run.spec() if jobs else None
    out = []
    for site, job in jobs.items():
        sec = _section(spec, site)
        site_dir = f"{job['run_dir']}/{site}"
        out += [(site, k, job["login"], f"{site_dir}/node{k}.log") for k in range(sec.nodes)]
        out.append((site, None, job["login"], f"{site_dir}/slurm-{job['job_id']}.out"))
    return out


def dry_run_script(spec, job) -> str:
    """The sbatch script of a planned job (dilococtl.plan.JobPlan) of run spec `spec`, submitting nothing."""
    from dilococtl.slurm.config import slurm_site

    return SlurmBackend(None, slurm_site(_section(spec, job.site))).script(job.launch)  # type: ignore[arg-type]
