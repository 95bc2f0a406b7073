"""What a launch starts where: the Lighthouse and one torchrun per node, as exact shell commands.

No network, no store. `dilococtl launch --dry-run` prints this plan. In async mode
(diloco.mode = "async") the outer parameter service (trainer.service.outer_service) takes the Lighthouse's
place, host and port, and the run's TLS certificate, key and token are made once under the control
plane's home (dilococtl.service_keys): only their paths appear in commands and configs. With the
TLS transport (diloco.transport "tls", or "auto", the default) the run's CA and one identity per site are made there too
(dilococtl.run_ca); each site gets the CA certificate and its own certificate and key, nothing else.
With that transport the Lighthouse listens on 127.0.0.1 inside a network namespace of its own, reached
only through its door (trainer.service.lighthouse --door), and a relay (trainer.transport.relay) takes its public
port: it shows the identity of the site on whose host it runs (dilococtl.spec_sites.lighthouse_site) and admits
only this run's sites; each trainer dials it through an in-process relay client (run.lighthouse_site),
except a site led from the Lighthouse's own host, which dials the relay's plaintext loopback port, open
to the run's uid only (run.lighthouse_loopback). The gloo transport keeps the plaintext Lighthouse.

A Slurm site (scheduler = "slurm") gets no NodePlan: its nodes are its job's allocation. It gets a
JobPlan instead, what dilococtl.site_backend submits: the same trainer config as an SSH site's (its
nodes publish their own host names to the transport), its interpreter (the venv on the cluster's shared
filesystem), and its files (keys, credentials) addressed to its login node, through which they land
on that shared filesystem where every compute node reads them.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dilococtl import paths, run_ca, store_creds
from dilococtl import spec_sites as spec_mod
from dilococtl.nodes import node_python
from dilococtl.service_keys import ServiceKeys
from dilococtl.service_keys import ensure as ensure_keys
from dilococtl.site_backend import SiteLaunch
from dilococtl.spec_types import RunSpec, SiteSection
from trainer.rules import config as config_mod

LIGHTHOUSE_SITE = "_lighthouse"  # pseudo-site name of the Lighthouse process in records


@dataclass(kw_only=True, slots=True)
class NodePlan:
    site: str  # site name
    site_index: int  # its index in the spec
    host: str  # node address ("local" for this machine)
    node_rank: int  # rank of the node inside its site
    nnodes: int  # nodes in the site
    nproc: int  # processes on this node
    python: str  # interpreter, absolute path where known
    run_dir: str  # RUN_DIR on the node (work_dir/runs/RUN_ID)
    config_path: str  # the trainer TOML on the node
    config_toml: str  # its content (written by launch, identical on every node of the site)
    log_path: str  # torchrun's output
    exit_path: str  # the exit code of torchrun is written here when it ends
    layout: str  # the site's parallel layout and this node's pipeline stage(s), e.g. "tp=8 pp=4 ... stage=1/4"
    command: str  # the exact shell command started detached


@dataclass(kw_only=True, slots=True)
class RelayPlan:
    """The mutual-TLS relay in front of a loopback-only Lighthouse (its target port is known once the
    Lighthouse has started: `command_for(port)`)."""

    host: str  # where it runs: the Lighthouse's host
    log_path: str
    command: str  # without its target: launch appends `--target unix:DOOR` (or `127.0.0.1:PORT`)

    def command_for(self, target: int | str) -> str:
        """With the Lighthouse's door (a path: trainer.service.lighthouse --door), or its loopback port."""
        if isinstance(target, str):
            return f"{self.command} --target {shlex.quote('unix:' + target)}"
        return f"{self.command} --target 127.0.0.1:{int(target)}"


@dataclass(kw_only=True, slots=True)
class LighthousePlan:
    host: str  # where it runs
    port: int
    python: str
    log_path: str
    command: str
    url: str  # what the trainers connect to
    kind: str = "lighthouse"  # "lighthouse" (torchft) or "outer_service" (async mode)
    config_path: str = ""  # outer_service: where launch writes its config before starting it
    config_toml: str = ""  # outer_service: the trainer config the sites get (its [diloco] is what it serves)
    relay: RelayPlan | None = None  # TLS transport: the Lighthouse binds loopback and this takes `port`


@dataclass(kw_only=True, slots=True)
class JobPlan:
    """A scheduler site (Slurm): one batch job submitted through its login node. Its files (keys, the
    trainer config, the job script) go to the cluster's shared filesystem through that node."""

    site: str
    site_index: int
    login: str  # where sbatch runs and the files are written
    nnodes: int  # nodes of the job
    launch: SiteLaunch  # what the site backend submits (dilococtl.site_backend)
    layout: str  # as NodePlan.layout, for the whole site

    @property
    def log_paths(self) -> list[str]:
        """Each node's torchrun output, where the login node reads it."""
        return [f"{self.launch.run_dir}/{self.site}/node{k}.log" for k in range(self.nnodes)]


@dataclass(kw_only=True, slots=True)
class LaunchPlan:
    run_id: str
    lighthouse: LighthousePlan
    nodes: list[NodePlan]
    # async mode: (host, remote path, local file) copied with mode 0600 before anything starts
    files: list[tuple[str, str, Path]] = field(default_factory=list)
    jobs: list[JobPlan] = field(default_factory=list)  # Slurm sites (their nodes are the allocation's)


def _addr(host: str) -> str:
    return "127.0.0.1" if spec_mod.is_local(host) else host


def build(spec: RunSpec, run_id: str, resume_round: int | None = None, make_keys: bool = True) -> LaunchPlan:
    """The commands for every node of `spec`, for run `run_id`.

    `resume_round`: a whole-run restart from that round (trainer run.resume_round).
    `make_keys=False` (a dry run): async mode's keys are neither made nor looked for.
    """
    lh_host = spec_mod.lighthouse_host(spec)
    lh_index = next((i for i, s in enumerate(spec.sites) if lh_host in s.hosts), 0)
    lh_site = spec.sites[lh_index]
    lh_dir = spec_mod.site_run_dir(spec, lh_index, run_id)
    lh_python = node_python(lh_site, lh_host)
    lh_log = f"{lh_dir}/lighthouse.log"
    lh_bind = f"{'127.0.0.1' if spec_mod.is_local(lh_host) else '0.0.0.0'}:{spec.run.lighthouse_port}"
    relayed = spec_mod.lighthouse_relayed(spec)
    # behind the relay the Lighthouse takes any free loopback port in a network namespace of its own,
    # reachable only through its door (a Unix socket in a 0700 directory); launch reads the door's path
    # from its log and gives it to the relay
    lh_cmd = (f"mkdir -p {shlex.quote(lh_dir)} && exec {shlex.quote(lh_python)} -m trainer.service.lighthouse "
              f"--min_replicas {spec.diloco.min_sites} --bind {'127.0.0.1:0' if relayed else lh_bind} "
              f"--join_timeout_ms {spec.run.join_timeout_ms}" + (" --door" if relayed else ""))
    url = spec_mod.lighthouse_url(spec)
    lighthouse = LighthousePlan(host=lh_host, port=spec.run.lighthouse_port, python=lh_python,
                                log_path=lh_log, command=lh_cmd, url=url)
    keys = None
    files: list[tuple[str, str, Path]] = []
    tls_ids = None
    # every mode checkpoints: the run's signing key reaches each node like its TLS key (by path only)
    ckpt_key = run_ca.ensure_checkpoint_key(run_ca_dir(run_id)) if make_keys else \
        run_ca_dir(run_id) / run_ca.CHECKPOINT_KEY
    # each site's identity under the run's CA: for the TLS transport, and in async mode for the
    # outer service, which knows a site by its certificate
    if spec.diloco.transport != "gloo" or spec.diloco.mode == "async":
        names = [s.name for s in spec.sites]
        lh_name = spec_mod.lighthouse_site(spec)
        if relayed and lh_name not in names:  # a Lighthouse host in no site gets an identity of its own
            names.append(lh_name)
        tls_ids = run_ca.ensure(run_ca_dir(run_id), run_id, names) if make_keys else \
            {n: run_ca.site_identity(run_ca_dir(run_id), n) for n in names}
        if relayed:
            lighthouse.relay, relay_files = _relay(spec, lh_host, lh_dir, lh_python, lh_bind, tls_ids[lh_name])
            files += relay_files
    if spec.diloco.mode == "async":
        lighthouse, keys = _outer_service(spec, run_id, lh_index, lh_dir, lh_python, lh_bind, make_keys,
                                          ckpt_key=ckpt_key, files=files)
        if not spec_mod.is_local(lh_host):
            files += [(lh_host, _remote_key(lh_dir, f), getattr(keys, f)) for f in ("cert", "key", "token")]
            files.append((lh_host, f"{lh_dir}/_keys/ca.crt", run_ca_dir(run_id) / run_ca.CA_CERT))
    nodes = []
    jobs: list[JobPlan] = []
    for i, site in enumerate(spec.sites):
        run_dir = spec_mod.site_run_dir(spec, i, run_id)
        if site.scheduler == "slurm":  # its files go to the shared filesystem through the login node
            site = dataclasses.replace(site, hosts=[site.login])
        tcfg = spec_mod.trainer_config(spec, i, run_id, run_dir)
        if resume_round is not None:
            tcfg.run.resume_round = resume_round
        if tls_ids is not None:
            files += _tls_files(tcfg, site, run_dir, tls_ids[site.name])
            if lighthouse.relay is not None:
                tcfg.run.lighthouse_site = spec_mod.lighthouse_site(spec)
        key_there = _checkpoint_key_files(site, run_dir, ckpt_key, files, make_keys)
        store_env = store_creds.site_env(tcfg.checkpoint.store, site, run_dir, run_ca_dir(run_id), files, make_keys)
        if keys is not None:
            tcfg.run.service_url = lighthouse.url
            if spec_mod.is_local(site.hosts[0]):
                tcfg.run.service_cert, tcfg.run.service_token_file = str(keys.cert), str(keys.token)
            else:  # the trainers read copies on their nodes (the same path on every node of the site)
                tcfg.run.service_cert, tcfg.run.service_token_file = (_remote_key(run_dir, "cert"),
                                                                      _remote_key(run_dir, "token"))
                files += [(h, _remote_key(run_dir, f), getattr(keys, f)) for h in site.hosts for f in ("cert", "token")
                          if (h, _remote_key(run_dir, f)) not in {(x[0], x[1]) for x in files}]
        toml = config_mod.dump_toml(tcfg)
        nproc = spec_mod.nproc_per_node(site)
        leader = _addr(site.hosts[0])
        port = spec.run.base_port + i
        cfg_path = f"{run_dir}/{site.name}/config.toml"
        if site.scheduler == "slurm":
            lay = spec_mod.layout(site)
            env = {"TORCHFT_LIGHTHOUSE": url, **threads_env(site), run_ca.CHECKPOINT_KEY_ENV: key_there, **store_env}
            jobs.append(JobPlan(site=site.name, site_index=i, login=site.login, nnodes=site.nodes, layout=(
                f"tp={lay['tp']} pp={lay['pp']} dp_shard={lay['dp_shard']} dp_replicate={lay['dp_replicate']}"),
                launch=SiteLaunch(run_id=run_id, run_dir=run_dir, python=node_python(site, site.login),
                                  config_path=cfg_path, config_toml=toml, nproc_per_node=nproc, rdzv_port=port,
                                  grace_s=spec.run.grace_s, env={k: v for k, v in env.items() if v})))
            continue
        for rank, host in enumerate(site.hosts):
            python = node_python(site, host)
            log = f"{run_dir}/{site.name}/node{rank}.log"
            exit_path = f"{run_dir}/{site.name}/node{rank}.exit"
            marker = shlex.quote(f"{run_dir}/{site.name}/node{rank}.preempted")  # the trainer's, after its checkpoint
            lay = spec_mod.layout(site)
            first, last = spec_mod.node_stages(site, rank)
            stages = f"{first}" if first == last else f"{first}-{last}"
            layout = (f"tp={lay['tp']} pp={lay['pp']} dp_shard={lay['dp_shard']} "
                      f"dp_replicate={lay['dp_replicate']} stage={stages}/{site.pp}")
            env = {"TORCHFT_LIGHTHOUSE": url, **threads_env(site), "PYTHONUNBUFFERED": "1",
                   run_ca.CHECKPOINT_KEY_ENV: key_there, **store_env}
            env_s = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if v)
            torchrun = (f"{shlex.quote(python)} -m torch.distributed.run --nnodes={len(site.hosts)} "
                        f"--nproc_per_node={nproc} --node_rank={rank} --master_addr={leader} "
                        f"--master_port={port} --shutdown-timeout={config_mod.torchrun_shutdown_s(spec.run.grace_s)} "
                        f"--tee=3 -m trainer --config {shlex.quote(cfg_path)}")
            # The wrapper shell records torchrun's exit code (a failed run must never look finished).
            # It outlives a SIGTERM to the process group (trap, then wait again) so that the code of
            # a preempted trainer (143, after its checkpoint) is recorded too; torchrun itself exits 1 on
            # SIGTERM, so the trainer's marker file says the checkpoint landed.
            # the layout leads as a no-op (`:`) so that a dry run and the node's process list show it
            cmd = (f": {layout}; cd {shlex.quote(run_dir)} || exit 1; rm -f {marker}; env {env_s} {torchrun} & child=$!; "
                   f"trap 'kill -TERM $child 2>/dev/null' TERM INT; "
                   f"while :; do wait $child; rc=$?; kill -0 $child 2>/dev/null || break; done; "
                   f"[ $rc -ne 0 ] && [ -e {marker} ] && rc=143; echo $rc > {shlex.quote(exit_path)}")
            nodes.append(NodePlan(site=site.name, site_index=i, host=host, node_rank=rank,
                                  nnodes=len(site.hosts), nproc=nproc, python=python, run_dir=run_dir,
                                  config_path=cfg_path, config_toml=toml, log_path=log,
                                  exit_path=exit_path, layout=layout, command=cmd))
    files = list({(h, remote): (h, remote, local) for h, remote, local in files}.values())  # one copy each
    return LaunchPlan(run_id=run_id, lighthouse=lighthouse, nodes=nodes, files=files, jobs=jobs)


def lighthouse_loopback_configs(plan: LaunchPlan, lighthouse_port: int) -> dict[str, str]:
    """{site: its config TOML} for each site whose leader node shares the relayed Lighthouse's host:
    its trainer dials `lighthouse_port`, the relay's loopback port for this uid, without TLS (run.lighthouse_loopback),
    known only once the Lighthouse has started. Every node of such a site gets the same file."""
    import tomllib

    lh = plan.lighthouse
    if lh.relay is None or not lighthouse_port:
        return {}
    out = {}
    for n in plan.nodes:
        if n.node_rank == 0 and n.host == lh.host:
            cfg = config_mod.from_dict(tomllib.loads(n.config_toml))
            cfg.run.lighthouse_loopback = f"http://127.0.0.1:{int(lighthouse_port)}"
            out[n.site] = config_mod.dump_toml(cfg)
    return out


def service_keys_dir(run_id: str) -> Path:
    """Where the control plane keeps a run's outer-service certificate, key and token."""
    return paths.service_keys_dir(run_id)


def run_ca_dir(run_id: str) -> Path:
    """Where the control plane keeps a run's CA, its sites' certificates and keys, and its checkpoint key."""
    return paths.run_ca_dir(run_id)


def _checkpoint_key_files(site: SiteSection, run_dir: str, key: Path, files: list, make: bool) -> str:
    """Where the site's trainers read the run's checkpoint key; adds the copies remote nodes need to `files`.

    A local site's work_dir is made here, 0700 and ours (paths.private_dir): a directory another user
    made first is refused before anything is written under it.
    """
    if spec_mod.is_local(site.hosts[0]):
        if make:
            paths.private_dir(Path(site.work_dir))
        return str(key)
    there = f"{run_dir}/_keys/{run_ca.CHECKPOINT_KEY}"
    files += [(h, there, key) for h in site.hosts]
    return there


def _tls_files(tcfg, site: SiteSection, run_dir: str, ident: run_ca.SiteIdentity) -> list:
    """Point the site's trainer config at its identity; the copies remote nodes need (`files`).

    A single-node site is dialled at the address the spec names it by; nodes of a multi-node site
    publish their own host names, and so do a Slurm site's (its one host here is its login node).
    """
    if len(site.hosts) == 1 and site.scheduler != "slurm":
        tcfg.run.transport_host = _addr(site.hosts[0])
    if spec_mod.is_local(site.hosts[0]):
        tcfg.run.tls_ca, tcfg.run.tls_cert, tcfg.run.tls_key = str(ident.ca), str(ident.cert), str(ident.key)
        return []
    there = {"ca": f"{run_dir}/_keys/ca.crt", "cert": f"{run_dir}/_keys/{site.name}.crt",
             "key": f"{run_dir}/_keys/{site.name}.key"}
    tcfg.run.tls_ca, tcfg.run.tls_cert, tcfg.run.tls_key = there["ca"], there["cert"], there["key"]
    return [(h, there[f], getattr(ident, f)) for h in site.hosts for f in ("ca", "cert", "key")]


def _relay(spec: RunSpec, host: str, lh_dir: str, python: str, bind: str,
           ident: run_ca.SiteIdentity) -> tuple[RelayPlan, list]:
    """The Lighthouse's relay, with the identity it shows, and the copies a remote host needs (`files`).

    On a site's host the relay uses the files that site's trainers get (the same paths: lh_dir is
    that site's run directory); a host in no site receives the run's "lighthouse" identity.
    """
    q = shlex.quote
    if spec_mod.is_local(host):
        there = {"ca": str(ident.ca), "cert": str(ident.cert), "key": str(ident.key)}
        files = []
    else:
        there = {"ca": f"{lh_dir}/_keys/ca.crt", "cert": f"{lh_dir}/_keys/{ident.site}.crt",
                 "key": f"{lh_dir}/_keys/{ident.site}.key"}
        files = [(host, there[f], getattr(ident, f)) for f in ("ca", "cert", "key")]
    allow = ",".join(s.name for s in spec.sites)
    cmd = (f"exec {q(python)} -m trainer.transport.relay --bind {bind} --site {q(ident.site)} "
           f"--cert {q(there['cert'])} --key {q(there['key'])} --ca {q(there['ca'])} --allow {q(allow)} --local")
    return RelayPlan(host=host, log_path=f"{lh_dir}/lighthouse-relay.log", command=cmd), files


def threads_env(site: SiteSection) -> dict[str, str]:
    """The thread setting a site's trainer processes get: one OpenMP thread each on CPU or with several
    processes per node (as torchrun would set), so the cores are not oversubscribed. Whatever measures
    the trainer's step (tune-h's benchmark) must run under the same setting."""
    one = spec_mod.nproc_per_node(site) > 1 or site.gpus_per_node == 0
    return {"OMP_NUM_THREADS": "1"} if one else {}


def _remote_key(run_dir: str, name: str) -> str:
    """Where a node keeps its copy of the run's service certificate, key or token."""
    return f"{run_dir}/_keys/{ {'cert': 'service.crt', 'key': 'service.key', 'token': 'token'}[name] }"


def _outer_service(spec: RunSpec, run_id: str, site_index: int, run_dir: str, python: str,
                   bind: str, make_keys: bool = True, ckpt_key: Path | None = None,
                   files: list | None = None) -> tuple[LighthousePlan, ServiceKeys]:
    """The async mode's outer parameter service in the Lighthouse's place, and the run's keys.

    The keys are made on this machine; for a remote service host launch copies them to the
    paths the command names (`files` of the plan). The service reads the trainer config of the
    site it runs beside: every [diloco] knob the sites run with reaches it unchanged, and so do
    that site's checkpoint stores. It signs its checkpoints with the run's checkpoint key and reaches
    the stores with the environment the sites get (store_creds.site_env: paths and endpoints only,
    never a key on the command line; a local service inherits this shell's environment).
    """
    host = spec_mod.lighthouse_host(spec)
    kdir = service_keys_dir(run_id)
    keys = ensure_keys(kdir, [_addr(host)]) if make_keys else \
        ServiceKeys(cert=kdir / "service.crt", key=kdir / "service.key", token=kdir / "token")
    if not spec_mod.is_local(host):
        keys_there = ServiceKeys(cert=Path(_remote_key(run_dir, "cert")), key=Path(_remote_key(run_dir, "key")),
                                 token=Path(_remote_key(run_dir, "token")))
    else:
        keys_there = keys
    q = shlex.quote
    client_ca = str(run_ca_dir(run_id) / run_ca.CA_CERT) if spec_mod.is_local(host) else f"{run_dir}/_keys/ca.crt"
    config_path = f"{run_dir}/outer_service.toml"
    tcfg = spec_mod.trainer_config(spec, site_index, run_id, run_dir)
    config_toml = config_mod.dump_toml(tcfg)
    files = [] if files is None else files
    # the service's host as a site of one node: the key and credential copies go to that host
    beside = dataclasses.replace(spec.sites[site_index], hosts=[host])
    env = {run_ca.CHECKPOINT_KEY_ENV: _checkpoint_key_files(beside, run_dir, ckpt_key, files, False)} \
        if ckpt_key is not None else {}
    env.update(store_creds.site_env(tcfg.checkpoint.store, beside, run_dir, run_ca_dir(run_id), files, make_keys))
    env_s = "".join(f"{k}={q(v)} " for k, v in env.items() if v)
    cmd = (f"mkdir -p {q(run_dir)} && exec {'env ' + env_s if env_s else ''}{q(python)} -m trainer.service.outer_service "
           f"--bind {bind} "
           f"--cert {q(str(keys_there.cert))} --key {q(str(keys_there.key))} --token-file {q(str(keys_there.token))} "
           f"--state-dir {q(run_dir + '/_outer_service')} --client-ca {q(client_ca)} --config {q(config_path)}")
    url = f"https://{_addr(host)}:{spec.run.lighthouse_port}"
    plan = LighthousePlan(host=host, port=spec.run.lighthouse_port, python=python,
                          log_path=f"{run_dir}/outer_service.log", command=cmd, url=url, kind="outer_service",
                          config_path=config_path, config_toml=config_toml)
    return plan, keys
