"""What a run spec says about its sites: which hosts are this machine, each site's nodes, processes and
their parallel layout, where the torchft Lighthouse runs and how it is reached, and each site's work
and run directories, checkpoint stores and trainer config.
"""

from __future__ import annotations

import dataclasses
import posixpath

from dilococtl.errors import BadInput
from dilococtl.spec_types import RunSpec, SiteSection, SpecError, SSHSection
from trainer.rules.config import ParallelConfig, RunConfig, TrainerConfig, validate
from trainer.rules.tables import ConfigError

LOCAL_HOSTS = ("local", "localhost", "127.0.0.1")  # hosts that mean this machine


def is_local(host: str) -> bool:
    """True for hosts that mean this machine: run without SSH."""
    return host.strip().lower() in LOCAL_HOSTS


def site_nodes(site: SiteSection) -> int:
    """Nodes of a site: its hosts, or a Slurm site's allocation."""
    return site.nodes if site.scheduler == "slurm" else len(site.hosts)


def refuse_slurm_sites(spec: RunSpec, command: str) -> None:
    """BadInput naming the first Slurm site: `command` drives SSH sites only (tune-h: it probes links and
    benchmarks steps on each site's first host; doctor, provision, launch and the rest drive Slurm sites)."""
    for i, s in enumerate(spec.sites):
        if s.scheduler == "slurm":
            raise BadInput(f"sites[{i}] ({s.name}) is a Slurm site: `dilococtl {command}` does not drive Slurm "
                           "sites yet (spec check does; see README, Slurm sites)")


def nproc_per_node(site: SiteSection) -> int:
    """Trainer processes per node: explicit, or one per GPU, or 1 on CPU."""
    return site.nproc_per_node or site.gpus_per_node or 1


def lighthouse_host(spec: RunSpec) -> str:
    """Where the torchft Lighthouse runs: run.lighthouse, or the first site's first host (a Slurm site's
    login node when no site has hosts)."""
    return spec.run.lighthouse or next((s.hosts[0] for s in spec.sites if s.hosts), spec.sites[0].login)


LIGHTHOUSE_CERT = "lighthouse"  # the identity the Lighthouse's relay shows when its host is in no site


def lighthouse_relayed(spec: RunSpec) -> bool:
    """Whether the Lighthouse listens on loopback behind a mutual-TLS relay (trainer.transport.relay):
    every run over the TLS transport ("tls", or "auto", for which launch makes the identities); the
    gloo transport keeps the plaintext Lighthouse, and async mode has the outer service instead."""
    return spec.diloco.transport != "gloo" and spec.diloco.mode != "async"


def lighthouse_site(spec: RunSpec) -> str:
    """The name the Lighthouse relay's certificate bears, which every site expects: the site whose host
    runs the Lighthouse (its own identity, so no other key goes to that host), or LIGHTHOUSE_CERT for
    a Lighthouse on a host outside every site."""
    return lighthouse_hosting_site(spec) or LIGHTHOUSE_CERT


def lighthouse_hosting_site(spec: RunSpec) -> str | None:
    """The name of the site one of whose hosts runs the Lighthouse, or None."""
    host = lighthouse_host(spec)
    norm = "local" if is_local(host) else host.lower()
    for s in spec.sites:
        if norm in {"local" if is_local(h) else h.lower() for h in s.hosts}:
            return s.name
    return None


def lighthouse_url(spec: RunSpec) -> str:
    """The URL every trainer is given for the Lighthouse (a local host becomes 127.0.0.1)."""
    host = lighthouse_host(spec)
    if is_local(host):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"http://{host}:{spec.run.lighthouse_port}"


def site_run_dir(spec: RunSpec, site_index: int, run_id: str) -> str:
    """The run directory on a site's nodes; the trainer writes under RUN_DIR/SITE/."""
    return posixpath.join(spec.sites[site_index].work_dir, "runs", run_id)


def site_parallel(spec: RunSpec, site: SiteSection) -> ParallelConfig:
    """The trainer's [parallel] section for `site`: the shared knobs plus the site's tp/pp/dp_shard."""
    return dataclasses.replace(spec.parallel, tp=site.tp, pp=site.pp, dp_shard=site.dp_shard)


def layout(site: SiteSection) -> dict[str, int]:
    """How a site's processes split: tp, pp, dp_shard and the plain data-parallel rest (dp_replicate)."""
    procs = site_nodes(site) * nproc_per_node(site)
    return {"tp": site.tp, "pp": site.pp, "dp_shard": site.dp_shard,
            "dp_replicate": procs // (site.tp * site.pp * site.dp_shard)}


def node_stages(site: SiteSection, node_rank: int) -> tuple[int, int]:
    """First and last pipeline stage run by node `node_rank` (pp is the outermost mesh dimension)."""
    nproc = nproc_per_node(site)
    per_stage = site_nodes(site) * nproc // site.pp
    return node_rank * nproc // per_stage, ((node_rank + 1) * nproc - 1) // per_stage


def site_stores(spec: RunSpec, site_index: int, every: bool = False) -> dict:
    """[checkpoint] store and replica_stores of one site: its own store, then the next sites' (in spec order,
    distinct URLs) until `replicas` stores hold each round (`every`: all of them, for validation)."""
    urls = [s.checkpoint_store or spec.checkpoint.store for s in spec.sites]
    urls = urls[site_index:] + urls[:site_index]
    distinct = [u for i, u in enumerate(urls) if u and u not in urls[:i]]
    if not distinct:
        return {"store": "", "replica_stores": []}
    return {"store": distinct[0], "replica_stores": distinct[1:None if every else spec.checkpoint.replicas]}


def trainer_config(spec: RunSpec, site_index: int, run_id: str, run_dir: str) -> TrainerConfig:
    """The validated per-site config that launch writes for the trainer of site `site_index`."""
    site = spec.sites[site_index]
    cfg = TrainerConfig(
        model=dataclasses.replace(spec.model),
        data=dataclasses.replace(spec.data),
        train=dataclasses.replace(spec.train),
        diloco=dataclasses.replace(spec.diloco, sites=len(spec.sites)),
        checkpoint=dataclasses.replace(spec.checkpoint, **site_stores(spec, site_index)),
        run=RunConfig(run_id=run_id, run_dir=run_dir, site=site.name, site_index=site_index,
                      lighthouse=lighthouse_url(spec), grace_s=spec.run.grace_s),
        parallel=site_parallel(spec, site),
    )
    try:
        return validate(cfg)
    except ConfigError as e:
        raise SpecError(f"{spec.path}: {e}") from None


def default_work_dir(site: SiteSection, ssh: SSHSection) -> str:
    """~/.dilococtl/work of the user that runs the site: the control plane's home for a local site,
    else the SSH user's home as Linux lays it out (/root, /home/USER); set work_dir where it differs."""
    if site.hosts and is_local(site.hosts[0]):
        from dilococtl.paths import default_work_dir as local_default

        return str(local_default())
    import getpass

    user = ssh.user or getpass.getuser()
    return f"{'/root' if user == 'root' else '/home/' + user}/.dilococtl/work"
