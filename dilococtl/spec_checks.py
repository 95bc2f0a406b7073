"""The rules of a run spec beyond its keys' types (`validate_spec`), one SpecError naming the key.

- numbers are finite; waits and timeouts are at most a day (trainer.rules.tables.MAX_WAIT_S);
- text holds no control characters; names (run, sites) are 1..64 letters, digits, '.', '_' and '-'
  (they become directory names and record keys); hosts are names or addresses (letters, digits,
  '.', '-', '_', ':', '%', '[', ']'), at most 253 characters;
- a host appears once in the whole spec; a local host ("local", "localhost", "127.0.0.1") may serve
  several sites but appears once per site, and a spec is either all local or all remote
  (remote nodes cannot reach this machine's loopback);
- parallelism inside a site: tp divides nproc_per_node (tensor parallel stays inside a node),
  nodes * nproc_per_node is divisible by tp * pp * dp_shard (the rest is plain data parallel), tp
  divides the model's attention and key/value heads, pp is at most the model's layers, and
  nproc_per_node is at most gpus_per_node on GPU nodes; [parallel] holds the knobs shared by all
  sites (microbatches, schedule, ...), tp/pp/dp_shard are set per site and equal at every site;
- ports are in 1..65535, the Lighthouse port is outside the rendezvous ports base_port + i;
- paths on nodes (python, venv, work_dir) are absolute, at most 1024 bytes, each part at most 255;
- diloco.sites, when given, equals the number of [[sites]] tables (absent: it is set to it);
- the trainer's own rules hold for its tables at every site (trainer.rules.config.validate).
"""

from __future__ import annotations

import dataclasses
import re
import stat
from pathlib import Path

from dilococtl.errors import BadInput
from dilococtl.spec_sites import (
    LIGHTHOUSE_CERT,
    is_local,
    lighthouse_hosting_site,
    lighthouse_relayed,
    nproc_per_node,
    site_nodes,
    site_parallel,
    site_stores,
)
from dilococtl.spec_types import (
    METRIC_SINKS,
    SCHEDULERS,
    WANDB_MODES,
    MetricsSection,
    RunSpec,
    SiteSection,
    SpecError,
)
from trainer.rules.config import TrainerConfig, validate
from trainer.rules.diloco_config import parse_link_key
from trainer.rules.model_config import resolve_model
from trainer.rules.tables import MAX_WAIT_S, ConfigError, check_values

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # fullmatch: `$` would let a trailing newline in
NAME_MAX = 64  # run and site names: directory names, record keys, log prefixes
_HOST_RE = re.compile(r"[A-Za-z0-9._:%\[\]-]+")  # a host name, IPv4 or IPv6 address: nothing a shell reads
HOST_MAX = 253  # DNS's limit
PATH_MAX = 1024  # bytes of a path on a node (the run's own files go below it)
_SLURM_KEYS = ("login", "partition", "account", "qos", "time_limit", "constraint", "sbatch_args")  # slurm-only


def validate_spec(spec: RunSpec) -> None:
    """Check what the types cannot (see the module docstring); raises SpecError."""
    try:
        _check(spec)
    except ConfigError as e:
        raise SpecError(f"{spec.path}: {e}") from None


def _check_metrics(m: MetricsSection) -> None:
    for i, sink in enumerate(m.sinks):
        if sink not in METRIC_SINKS:
            raise ConfigError(f"metrics.sinks[{i}]: unknown sink {sink!r} (known: {', '.join(METRIC_SINKS)})")
        if sink in m.sinks[:i]:
            raise ConfigError(f"metrics.sinks[{i}]: {sink!r} is listed twice")
    if m.wandb_mode not in WANDB_MODES:
        raise ConfigError(f"metrics.wandb_mode: must be one of {', '.join(WANDB_MODES)}, got {m.wandb_mode!r}")


def _port(value: int, key: str) -> None:
    if not 1 <= value <= 65535:
        raise ConfigError(f"{key}: port must be in 1..65535, got {value}")


def _name(value: str, key: str) -> None:
    if not _NAME_RE.fullmatch(value) or len(value) > NAME_MAX:
        raise ConfigError(f"{key}: use letters, digits, '.', '_' or '-', at most {NAME_MAX}, the first a letter or "
                          f"digit (got {len(value)} characters: {value[:NAME_MAX + 16]!r}"
                          f"{'...' if len(value) > NAME_MAX + 16 else ''})")


def _host(value: str, key: str) -> None:
    if not _HOST_RE.fullmatch(value) or len(value) > HOST_MAX:
        raise ConfigError(f"{key}: not a host name or address: {value[:HOST_MAX]!r}")


def _local_work_dir(value: str, key: str) -> None:
    """A local work_dir must be this user's and not writable by others (or not exist yet under a
    parent that no other user can create it in): else a planted run tree could be loaded as ours."""
    from dilococtl.paths import check_private_dir

    p = Path(value)
    if p.exists():
        try:
            check_private_dir(p)
        except BadInput as e:
            raise ConfigError(f"{key}: {e}") from None
        return
    parent = next((a for a in p.parents if a.exists()), Path("/"))
    st = parent.stat()
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"{key}: {p} does not exist and its parent {parent} lets other users create it "
                          f"(mode {stat.S_IMODE(st.st_mode):o}): refusing to use it")


def _node_path(value: str, key: str) -> None:
    if not value.startswith("/"):
        raise ConfigError(f"{key}: must be an absolute path on the node, got {value!r}")
    if len(value.encode()) > PATH_MAX or any(len(part.encode()) > 255 for part in value.split("/")):
        raise ConfigError(f"{key}: too long (at most {PATH_MAX} bytes, 255 per directory name)")


def _wait(value: float, key: str, low_open: bool = False) -> None:
    """A wait or timeout: finite (checked before), positive or >= 0, and at most MAX_WAIT_S."""
    if (value <= 0 if low_open else value < 0) or value > MAX_WAIT_S:
        raise ConfigError(f"{key}: must be in {'(' if low_open else '['}0, {MAX_WAIT_S:g}] seconds, got {value:g}")


def _check(spec: RunSpec) -> None:
    run, ssh, sites = spec.run, spec.ssh, spec.sites
    check_values([("run", run), ("ssh", ssh), ("metrics", spec.metrics),
                   *((f"sites[{i}]", s) for i, s in enumerate(sites))])
    _check_metrics(spec.metrics)
    _name(run.name, "run.name")
    _port(run.lighthouse_port, "run.lighthouse_port")
    _port(run.base_port, "run.base_port")
    _port(ssh.port, "ssh.port")
    if not 0 < run.join_timeout_ms <= MAX_WAIT_S * 1000:
        raise ConfigError(f"run.join_timeout_ms: must be in (0, {MAX_WAIT_S * 1000:.0f}], got {run.join_timeout_ms}")
    _wait(run.grace_s, "run.grace_s")
    if run.lighthouse:
        _host(run.lighthouse, "run.lighthouse")
    _wait(ssh.connect_timeout_s, "ssh.connect_timeout_s", low_open=True)
    _wait(ssh.keepalive_s, "ssh.keepalive_s")
    if not 1 <= ssh.parallel <= 1024:
        raise ConfigError(f"ssh.parallel: must be in [1, 1024], got {ssh.parallel}")
    if not sites:
        raise ConfigError("sites: at least one [[sites]] table is required")
    if run.base_port + len(sites) - 1 > 65535:
        raise ConfigError(f"run.base_port: {len(sites)} sites need ports {run.base_port}.."
                          f"{run.base_port + len(sites) - 1}, beyond 65535")
    if run.base_port <= run.lighthouse_port < run.base_port + len(sites):
        raise ConfigError(f"run.lighthouse_port: {run.lighthouse_port} collides with the rendezvous ports "
                          f"{run.base_port}..{run.base_port + len(sites) - 1} (base_port + site index)")

    _check_sites(spec)
    if lighthouse_relayed(spec) and lighthouse_hosting_site(spec) is None \
            and any(s.name == LIGHTHOUSE_CERT for s in sites):
        raise ConfigError(f"run.lighthouse: on a host outside every site, the Lighthouse's relay is known as "
                          f"{LIGHTHOUSE_CERT!r}, which a site already names; rename that site")

    if spec.diloco.sites != len(sites):
        raise ConfigError(f"diloco.sites: {spec.diloco.sites} does not match the {len(sites)} [[sites]] tables "
                          "(leave it out to use their count)")
    par = spec.parallel
    if (par.tp, par.pp, par.dp_shard) != (1, 1, 1):
        raise ConfigError("parallel: tp, pp and dp_shard are set per site ([[sites]] tables), not in [parallel]")
    trainer = TrainerConfig(model=spec.model, data=spec.data, train=spec.train, diloco=spec.diloco,
                            checkpoint=dataclasses.replace(spec.checkpoint, **site_stores(spec, 0, every=True)),
                            parallel=par)
    validate(trainer)  # ConfigError "key: problem", the trainer's own rules (h, rounds, preset, codec...)
    model = resolve_model(spec.model)

    for i, s in enumerate(sites):
        where = f"sites[{i}]"
        nproc = nproc_per_node(s)
        if spec.train.device == "cuda" and s.gpus_per_node == 0:
            raise ConfigError(f"train.device: 'cuda' but {where} ({s.name}) has gpus_per_node = 0")
        if nproc % s.tp:
            raise ConfigError(f"{where}.tp: {s.tp} does not divide nproc_per_node {nproc} "
                              "(tensor parallelism stays inside a node)")
        if (site_nodes(s) * nproc) % (s.tp * s.pp):
            raise ConfigError(f"{where}.pp: nodes * nproc_per_node = {site_nodes(s) * nproc} is not divisible "
                              f"by tp * pp = {s.tp * s.pp}")
        if (site_nodes(s) * nproc) % (s.tp * s.pp * s.dp_shard):
            raise ConfigError(f"{where}.dp_shard: nodes * nproc_per_node = {site_nodes(s) * nproc} is not "
                              f"divisible by tp * pp * dp_shard = {s.tp * s.pp * s.dp_shard}")
        if model.n_heads % s.tp or model.n_kv_heads % s.tp:
            raise ConfigError(f"{where}.tp: {s.tp} does not divide the model's heads "
                              f"(n_heads {model.n_heads}, n_kv_heads {model.n_kv_heads})")
        if s.pp > model.n_layers:
            raise ConfigError(f"{where}.pp: {s.pp} stages for {model.n_layers} layers")
        try:  # the trainer's own rules for this site's layout (microbatches, tied embeddings...)
            validate(dataclasses.replace(trainer, parallel=site_parallel(spec, s)))
        except ConfigError as e:
            raise ConfigError(f"{where} ({s.name}): {e}") from None
    first = sites[0]
    procs = site_nodes(first) * nproc_per_node(first)
    for i, s in enumerate(sites[1:], 1):
        # torchft pairs local rank r of every site: a rank with no peer at another site never syncs
        if site_nodes(s) * nproc_per_node(s) != procs:
            raise ConfigError(f"sites[{i}]: {site_nodes(s) * nproc_per_node(s)} processes "
                              f"(nodes * nproc_per_node) where sites[0] has {procs}; every site needs the same "
                              f"number (the outer exchange pairs rank r of each site)")
        # the outer exchange pairs local rank r of every site: their shards must be the same slices
        if (s.tp, s.pp, s.dp_shard) != (first.tp, first.pp, first.dp_shard):
            raise ConfigError(f"sites[{i}]: tp/pp/dp_shard {s.tp}/{s.pp}/{s.dp_shard} differ from sites[0]'s "
                              f"{first.tp}/{first.pp}/{first.dp_shard} (sites exchange shards rank by rank)")


def _check_sites(spec: RunSpec) -> None:
    names: dict[str, int] = {}
    owner: dict[str, str] = {}  # remote host -> "sites[i]" that has it
    kinds = set()  # "local" / "remote" hosts seen
    for i, s in enumerate(spec.sites):
        where = f"sites[{i}]"
        _name(s.name, f"{where}.name")
        if s.name in names:
            raise ConfigError(f"{where}.name: duplicate site name {s.name!r} (also sites[{names[s.name]}])")
        names[s.name] = i
        _check_scheduler(s, where)
        if not s.hosts and s.scheduler == "ssh":
            raise ConfigError(f"{where}.hosts: a site needs at least one host")
        seen_here: set[str] = set()
        for j, h in enumerate(s.hosts):
            key = f"{where}.hosts[{j}]"
            _host(h, key)
            norm = "local" if is_local(h) else h.lower()
            if norm in seen_here:
                raise ConfigError(f"{key}: duplicate host {h!r} in site {s.name!r}")
            seen_here.add(norm)
            if norm != "local":
                if norm in owner:
                    raise ConfigError(f"{key}: duplicate host {h!r} (also in {owner[norm]})")
                owner[norm] = where
            kinds.add("local" if norm == "local" else "remote")
        for knob in ("gpus_per_node", "nproc_per_node"):
            if not 0 <= getattr(s, knob) <= 1024:
                raise ConfigError(f"{where}.{knob}: must be in [0, 1024], got {getattr(s, knob)}")
        for knob in ("tp", "pp", "dp_shard"):
            if getattr(s, knob) < 1:
                raise ConfigError(f"{where}.{knob}: must be >= 1, got {getattr(s, knob)}")
        if s.gpus_per_node and s.nproc_per_node > s.gpus_per_node:
            raise ConfigError(f"{where}.nproc_per_node: {s.nproc_per_node} processes for "
                              f"{s.gpus_per_node} GPUs per node")
        for knob in ("python", "venv", "work_dir"):
            value = getattr(s, knob)
            if value or knob == "work_dir":
                _node_path(value, f"{where}.{knob}")
        if s.hosts and is_local(s.hosts[0]):
            _local_work_dir(s.work_dir, f"{where}.work_dir")
    for key in spec.diloco.transport_link_pace_mbit:
        try:
            unknown = [x for x in parse_link_key(key) if x not in names]
        except ValueError:
            continue  # not SRC->DST: the trainer config's check names it
        if unknown:
            raise ConfigError(f"diloco.transport_link_pace_mbit.{key!r}: no site named {unknown[0]!r} "
                              f"(sites: {', '.join(names)})")
    if spec.run.lighthouse:
        kinds.add("local" if is_local(spec.run.lighthouse) else "remote")
    if len(kinds) > 1:
        raise ConfigError("sites: local and remote hosts cannot be mixed (remote nodes cannot reach this "
                          "machine's loopback); use addresses for every node, or 'local' for all")


def _check_scheduler(s: SiteSection, where: str) -> None:
    """scheduler is known; a Slurm site has a login node, no hosts and valid Slurm keys
    (dilococtl.slurm.config.validate); an SSH site sets none of the Slurm keys."""
    if s.scheduler not in SCHEDULERS:
        raise ConfigError(f"{where}.scheduler: must be one of {', '.join(SCHEDULERS)}, got {s.scheduler!r}")
    if s.scheduler == "ssh":
        for key in _SLURM_KEYS:
            if getattr(s, key):
                raise ConfigError(f"{where}.{key}: only for scheduler = \"slurm\" sites")
        if s.nodes != 1:
            raise ConfigError(f"{where}.nodes: only for scheduler = \"slurm\" sites (an SSH site's nodes are its hosts)")
        return
    if s.hosts:
        raise ConfigError(f"{where}.hosts: a Slurm site's nodes come from its allocation: set nodes, not hosts")
    if s.login:
        _host(s.login, f"{where}.login")
    from dilococtl.slurm.config import slurm_site
    from dilococtl.slurm.config import validate as validate_slurm

    try:
        validate_slurm(slurm_site(s), where)
    except BadInput as e:
        raise ConfigError(str(e)) from None
