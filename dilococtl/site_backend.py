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

    def launch(self, spec: SiteLaunch) -> str:
        self.login.write_text(spec.config_path, spec.config_toml)
        path = f"{spec.run_dir}/{self.site.name}/job.sbatch"
        return commands.submit(self.login, script.batch_script(self.site, self._job(spec)), path)

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
    """The backend of a run spec's [[sites]] table (dilococtl.spec.SiteSection) reached through `login`.
    SSH sites are still driven by dilococtl.runs directly: refused here until they move behind it."""
    from dilococtl.slurm.config import slurm_site

    if site.scheduler == "slurm":
        return SlurmBackend(login, slurm_site(site))
    raise NotImplementedError(f"site {site.name}: the SSH backend is dilococtl.runs' own code, not yet a SiteBackend")
