"""The run spec (TOML): what to train, where, and how to reach the nodes.

Sections: [run], [model], [data], [train], [diloco], [checkpoint], [parallel], [ssh], [[sites]].
[model]/[data]/[train]/[diloco]/[checkpoint]/[parallel] are the trainer's own config sections
(`trainer.config`), validated by the same classes; the rest belongs to the control plane.

Every problem is a `SpecError` with one line, `FILE: KEY: problem`; KEY names the table and key,
with sites indexed from 0 in file order (`sites[1].hosts` is the second [[sites]] table).

Rules beyond the types (checked by `validate_spec`):
- numbers are finite; waits and timeouts are at most a day (trainer.config.MAX_WAIT_S);
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
- diloco.sites, when given, equals the number of [[sites]] tables (absent: it is set to it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import posixpath
import re
import stat
import tomllib
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dilococtl.errors import BadInput
from trainer.config import (
    MAX_WAIT_S,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DilocoConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    TrainerConfig,
    param_count,
    parse_link_key,
    resolve_model,
    section_from_dict,
    validate,
)


class SpecError(BadInput):
    """A bad run spec; the message is one line: `FILE: KEY: problem`."""

    def __init__(self, msg: str) -> None:
        # whatever the spec holds (newlines, escape sequences, a megabyte string), the line stays one
        # printable line of bounded length
        super().__init__(_one_line(msg))


@dataclass(kw_only=True, slots=True)
class RunSection:
    name: str  # the run's name; a second launch of an active name is refused without --force
    lighthouse: str = ""  # host running the torchft Lighthouse ("" = the first site's first host)
    lighthouse_port: int = 29510  # its port
    base_port: int = 29600  # first port used on nodes: site i's rendezvous is base_port + i
    join_timeout_ms: int = 5000  # Lighthouse: wait this long for more replicas before a quorum
    grace_s: float = 30.0  # on stop/preemption: seconds a trainer gets for its final checkpoint


@dataclass(kw_only=True, slots=True)
class SSHSection:
    user: str = ""  # login user ("" = the local user name)
    port: int = 22  # sshd port
    identity_file: str = ""  # private key ("" = ssh-agent and ~/.ssh defaults)
    known_hosts: str = ""  # extra known_hosts file read beside ~/.ssh and dilococtl's own
    connect_timeout_s: float = 10.0  # TCP + handshake
    keepalive_s: float = 15.0  # SSH keepalive interval
    parallel: int = 16  # nodes contacted at once


@dataclass(kw_only=True, slots=True)
class SiteSection:
    name: str  # site name: unique, used in records and logs
    # node addresses; "local" runs on this machine without SSH (a Slurm site has none: its allocation's)
    hosts: list[str] = field(default_factory=list)
    gpus_per_node: int = 0  # GPUs expected per node (0: CPU)
    nproc_per_node: int = 0  # trainer processes per node (0: gpus_per_node, or 1 on CPU)
    tp: int = 1  # tensor-parallel degree inside a node
    pp: int = 1  # pipeline stages (across nodes)
    dp_shard: int = 1  # FSDP2 degree: parameters and optimizer state sharded over this many replicas
    python: str = ""  # absolute path of the node's interpreter ("" = venv's, or python3)
    venv: str = ""  # provision creates/reuses a venv here ("" = use `python` as it is)
    # run directories, logs and checkpoints go under it ("" = the node user's ~/.dilococtl/work, never
    # /tmp where another user could make it first: see default_work_dir); one filesystem
    work_dir: str = ""
    # for all the nodes of a site (each writes its shards of the site's checkpoints there): doctor checks
    checkpoint_store: str = ""  # this site's object store, near it ("" = [checkpoint] store): see CheckpointConfig.store
    # "ssh": dilococtl starts torchrun on `hosts`; "slurm": one sbatch job through `login`, nodes from the
    # allocation (dilococtl/slurm/; the keys below are for Slurm sites only)
    scheduler: str = "ssh"
    login: str = ""  # the cluster's login node, reached over SSH under the same host-key rules as hosts
    partition: str = ""  # sbatch -p ("" = the cluster's default partition)
    account: str = ""  # sbatch -A ("" = the user's default account)
    qos: str = ""  # sbatch -q ("" = the association's default QoS)
    nodes: int = 1  # nodes of the site's job
    # sbatch -t in Slurm's syntax (MM, HH:MM:SS, D-HH:MM:SS; "" = the partition's default): a longer run is
    # carried by chained jobs, each ending with a checkpoint
    time_limit: str = ""
    constraint: str = ""  # sbatch -C feature expression ("" = none)
    sbatch_args: list[str] = field(default_factory=list)  # further sbatch options, one per item (["--exclusive"])


METRIC_SINKS = ("tensorboard", "wandb", "mlflow")  # [metrics] sinks the collector writes (dilococtl/sinks/)
WANDB_MODES = ("offline", "online")


@dataclass(kw_only=True, slots=True)
class MetricsSection:
    sinks: list[str] = field(default_factory=list)  # any of METRIC_SINKS; each is an extra: pip install 'dilococtl[NAME]'
    wandb_project: str = "dilococtl"  # the W&B project runs are logged under
    wandb_mode: str = "offline"  # "offline": files under the run's directory, upload later with `wandb sync`
    mlflow_tracking_uri: str = ""  # "" = $MLFLOW_TRACKING_URI, else a file store under the run's directory
    mlflow_experiment: str = "dilococtl"  # the MLflow experiment runs are logged under


@dataclass(kw_only=True, slots=True)
class RunSpec:
    path: str  # the file it was read from
    run: RunSection
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ssh: SSHSection = field(default_factory=SSHSection)
    sites: list[SiteSection] = field(default_factory=list)
    metrics: MetricsSection = field(default_factory=MetricsSection)  # where else the rounds are written


# top-level table -> its dataclass; the trainer's tables go through trainer.config.section_from_dict
_TRAINER_TABLES = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig,
                   "diloco": DilocoConfig, "checkpoint": CheckpointConfig, "parallel": ParallelConfig}
_PLANE_TABLES = {"run": RunSection, "ssh": SSHSection, "metrics": MetricsSection}
_TOP_KEYS = ("run", *_TRAINER_TABLES, "ssh", "sites", "metrics")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # fullmatch: `$` would let a trailing newline in
NAME_MAX = 64  # run and site names: directory names, record keys, log prefixes
_HOST_RE = re.compile(r"[A-Za-z0-9._:%\[\]-]+")  # a host name, IPv4 or IPv6 address: nothing a shell reads
HOST_MAX = 253  # DNS's limit
PATH_MAX = 1024  # bytes of a path on a node (the run's own files go below it)
SPEC_MAX_BYTES = 1 << 20  # a run spec is a small TOML file; refuse to read more
_LOCAL = ("local", "localhost", "127.0.0.1")


# --- helpers other modules use -------------------------------------------------------------------

def is_local(host: str) -> bool:
    """True for hosts that mean this machine: run without SSH."""
    return host.strip().lower() in _LOCAL


SCHEDULERS = ("ssh", "slurm")  # [[sites]] scheduler values
_SLURM_KEYS = ("login", "partition", "account", "qos", "time_limit", "constraint", "sbatch_args")  # slurm-only


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
    return _lighthouse_hosting_site(spec) or LIGHTHOUSE_CERT


def _lighthouse_hosting_site(spec: RunSpec) -> str | None:
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


def summary(spec: RunSpec) -> dict[str, Any]:
    """What the spec would run: sites, nodes, processes, model size, tokens per round.

    Data-parallel replicas per site = processes / (tp * pp); each takes data.batch_size sequences
    of data.seq_len tokens per inner step, so a round trains sum(replicas) * batch * seq * h tokens.
    """
    sites = []
    for s in spec.sites:
        nproc = nproc_per_node(s)
        procs = site_nodes(s) * nproc
        sites.append({"name": s.name, "hosts": list(s.hosts), "nodes": site_nodes(s), "gpus_per_node": s.gpus_per_node,
                      "nproc_per_node": nproc, "processes": procs, "tp": s.tp, "pp": s.pp,
                      "dp_shard": s.dp_shard, "dp": procs // (s.tp * s.pp), "scheduler": s.scheduler, "login": s.login})
    tokens_per_step = sum(s["dp"] for s in sites) * spec.data.batch_size * spec.data.seq_len
    per_round = tokens_per_step * spec.diloco.h
    return {
        "path": spec.path,
        "name": spec.run.name,
        "sites": sites,
        "nodes": sum(s["nodes"] for s in sites),
        "processes": sum(s["processes"] for s in sites),
        "preset": spec.model.preset,
        "params": param_count(spec.model),
        "h": spec.diloco.h,
        "rounds": spec.diloco.rounds,
        "algorithm": spec.diloco.algorithm,
        "mode": spec.diloco.mode,
        "compression": spec.diloco.compression,
        "tokens_per_round": per_round,
        "tokens_total": per_round * spec.diloco.rounds,
        "lighthouse": lighthouse_url(spec),
        "data": spec.data.source,
        "notes": notes(spec),
    }


def notes(spec: RunSpec) -> list[str]:
    """Valid settings that measured worse than an alternative: one line each, with the fix."""
    from trainer.codec_spec import codec_max_h, parse_codec_spec  # no torch
    from trainer.outer_rule import outer_hparams  # no torch

    d = spec.diloco
    out = []
    stages = parse_codec_spec(d.compression)  # valid: load_spec checked it
    momentum = outer_hparams(d)[1]  # unset: the default rule's
    if stages and stages[0].name in ("topk", "sparse") and d.algorithm == "diloco" and d.error_feedback \
            and (momentum > 0 or d.error_feedback_decay < 0.9):
        codec = "top-k" if stages[0].name == "topk" else "the sparse codec"
        out.append(f"diloco: {codec} did best with outer_momentum = 0, outer_lr = 1.0, error_feedback_decay = "
                   f"0.95 (BENCHMARKS.md, compression); this spec has outer_momentum = {momentum:g}, "
                   f"error_feedback_decay = {d.error_feedback_decay:g}")
    cap = codec_max_h(d.compression)
    longest = d.h_max if d.h_auto else d.h
    if cap is not None and d.algorithm == "diloco" and longest > cap:
        knob = "h_max" if d.h_auto else "h"
        out.append(f"diloco: {knob} = {longest} is past {cap}, the most the sparse codec keeps its quality at (it sends "
                   f"a few values a round and its residual holds the rest: simulator, tiny, H 1000 ended at 60.6 ppl "
                   f"where 100 ended 4.9; BENCHMARKS.md); keep H <= {cap}, with mode = \"overlap\" on a slow link")
    k, majority = len(spec.sites), len(spec.sites) // 2 + 1
    if k >= 3 and d.mode != "async" and d.min_sites < majority:
        out.append(f"diloco: min_sites = {d.min_sites} of {k} sites lets a straggler or a cut-off site form a quorum "
                   f"of its own and commit a round the others also commit: the sites then hold different θ for good "
                   f"(3 sites, min_sites 1, one site 6x slower: it ended on its own θ); min_sites = {majority} keeps "
                   f"one quorum and still trains through the loss of {k - majority}")
    if note := store_note(spec):
        out.append(note)
    return out


# --- checkpoint uploads across the WAN (issue 35) -------------------------------------------------
# Whether a run's checkpoint uploads share the WAN links with the exchange (tune-h and the plan say so).
# A site's own `[[sites]] checkpoint_store` is taken to be in its region (that is what the field is for):
# its uploads stay on the site's network. Every other store a site uploads to is not: a replica is by
# definition another site's own store, and a store several sites name (the run-wide `[checkpoint] store`
# among them) is in at most one of their regions. Uploads to those cross links the exchange also uses,
# and a round-boundary upload then competes with the round's exchange for the link.


def crossing(spec: RunSpec) -> dict[str, list[str]]:
    """site -> the stores it uploads to outside its region ({} when every upload stays in its region)."""
    if len(spec.sites) < 2:
        return {}
    own = {i: s.checkpoint_store or spec.checkpoint.store for i, s in enumerate(spec.sites)}
    named_by = {u: sum(1 for v in own.values() if v == u) for u in own.values()}
    out: dict[str, list[str]] = {}
    for i, site in enumerate(spec.sites):
        stores = site_stores(spec, i)
        far = list(stores["replica_stores"])
        if stores["store"] and (not site.checkpoint_store or named_by[stores["store"]] > 1):
            far.insert(0, stores["store"])
        if far:
            out[site.name] = far
    return out


def store_note(spec: RunSpec) -> str | None:
    """One line when some site's checkpoint uploads cross the WAN links of the exchange, else None."""
    far = crossing(spec)
    if not far:
        return None
    who = ", ".join(f"{site} ({len(urls)} store{'s' if len(urls) > 1 else ''})" for site, urls in far.items())
    return (f"checkpoint: uploads share the WAN links with the exchange: {who} upload outside their region "
            f"(replicas, or a store several sites share); tune-h's H does not count that traffic")


# --- loading -------------------------------------------------------------------------------------

def load_spec(path: str | Path) -> RunSpec:
    """Read and validate a run spec; every problem raises SpecError (`FILE: KEY: problem`)."""
    p = Path(path)
    text = _read_spec_text(p)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{p}: invalid TOML: {e}") from None
    except RecursionError:
        raise SpecError(f"{p}: invalid TOML: arrays or tables nested too deeply") from None
    return spec_from_dict(data, str(p))


def _read_spec_text(p: Path) -> str:
    """The spec file's text; only a regular file of at most SPEC_MAX_BYTES is read. Opened without
    blocking and checked on the open descriptor: a FIFO (or a device) is refused, not waited on."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SpecError(f"{p}: no such run spec") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise SpecError(f"{p}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise SpecError(f"{p}: {kind}; a run spec is a TOML file")
        data = os.read(fd, SPEC_MAX_BYTES + 1)
        while len(data) <= SPEC_MAX_BYTES and (more := os.read(fd, SPEC_MAX_BYTES + 1 - len(data))):
            data += more
    except OSError as e:
        raise SpecError(f"{p}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > SPEC_MAX_BYTES:
        raise SpecError(f"{p}: larger than {SPEC_MAX_BYTES} bytes; a run spec is a small TOML file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{p}: cannot read: not UTF-8 text ({e.reason} at byte {e.start})") from None


def spec_from_dict(data: dict[str, Any], path: str) -> RunSpec:
    """Build and validate a RunSpec from a parsed TOML document; `path` prefixes the errors."""
    try:
        spec = _parse(data, path)
    except ConfigError as e:
        raise SpecError(_one_line(f"{path}: {e}")) from None
    validate_spec(spec)
    return spec


def validate_spec(spec: RunSpec) -> None:
    """Check what the types cannot (see the module docstring); raises SpecError."""
    try:
        _check(spec)
    except ConfigError as e:
        raise SpecError(_one_line(f"{spec.path}: {e}")) from None


def spec_to_json(spec: RunSpec) -> str:
    """The spec as JSON text (what the store keeps: the run as launched, even if the file changes)."""
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


def spec_from_json(text: str) -> RunSpec:
    """Inverse of `spec_to_json` (validated again).

    A run recorded before a validation rule was added may break it (a site name longer than names
    may now be): its record stays readable (status, stop, report), with the types checked but not the
    newer rules, so the run can still be seen and ended."""
    try:
        data = json.loads(text)
    except (TypeError, ValueError) as e:
        raise SpecError(f"<stored spec>: not valid JSON ({e}); the run's record is damaged") from None
    if not isinstance(data, dict):
        raise SpecError("<stored spec>: not a JSON object; the run's record is damaged")
    data, path = {k: v for k, v in data.items() if k != "path"}, str(data.get("path", "<stored spec>"))
    try:
        return spec_from_dict(data, path)
    except SpecError:
        try:
            return _parse(data, path)
        except ConfigError as e:
            raise SpecError(f"{path} (stored): {e}") from None


_LINE_MAX = 1000  # characters of an error line


def _one_line(msg: str) -> str:
    """One printable line: whitespace runs become one space, other control characters are escaped
    (an escape sequence in a key must not reach the terminal), and the line is cut at _LINE_MAX."""
    out = " ".join(msg.split())
    if not out.isprintable():
        out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in out)
    return out if len(out) <= _LINE_MAX else out[:_LINE_MAX - 3] + "..."


def unknown_key(name: str, key: str, known: Iterable[str]) -> str:
    """`diloco.roundz: unknown key 'roundz' (did you mean 'rounds'?)`; the known keys when none is close."""
    import difflib

    known = sorted(known)
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    if close:
        return f"{name}: unknown key {str(key)!r} (did you mean {close[0]!r}?)"
    return f"{name}: unknown key (known: {', '.join(known)})"


def _parse(data: dict[str, Any], path: str) -> RunSpec:
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(unknown_key(key, key, _TOP_KEYS))
    if "run" not in data:
        raise ConfigError("run: required table [run] is missing")
    kwargs: dict[str, Any] = {}
    for key, cls in _PLANE_TABLES.items():
        if key in data:
            kwargs[key] = _plane_section(cls, data[key], key)
    for key, cls in _TRAINER_TABLES.items():
        if key in data:
            if isinstance(data[key], dict):  # the trainer says "unknown key" too, without a suggestion
                known = {f.name for f in dataclasses.fields(cls)}
                for k in data[key]:
                    if k not in known:
                        raise ConfigError(unknown_key(f"{key}.{k}", k, known))
            kwargs[key] = section_from_dict(cls, data[key], key)
    raw_sites = data.get("sites")
    if raw_sites is None:
        raise ConfigError("sites: at least one [[sites]] table is required")
    if not isinstance(raw_sites, list) or not all(isinstance(s, dict) for s in raw_sites):
        raise ConfigError("sites: expected an array of [[sites]] tables")
    kwargs["sites"] = [_plane_section(SiteSection, s, f"sites[{i}]") for i, s in enumerate(raw_sites)]
    for i, s in enumerate(raw_sites):
        if "hosts" not in s and kwargs["sites"][i].scheduler == "ssh":  # required in SSH sites
            raise ConfigError(f"sites[{i}].hosts: required key is missing")
    spec = RunSpec(path=path, **kwargs)
    for site in spec.sites:
        site.work_dir = site.work_dir or default_work_dir(site, spec.ssh)
    if "sites" not in data.get("diloco", {}):
        spec.diloco.sites = len(spec.sites)
    return spec


def _plane_section(cls: type, data: Any, where: str) -> Any:
    """Build a control-plane dataclass from a TOML table: unknown, missing and mistyped keys raise."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(unknown_key(f"{where}.{key}", key, fields))
        _check_type(value, hints[key], f"{where}.{key}")
    for name, f in fields.items():
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}.{name}: required key is missing")
    return cls(**{k: float(v) if hints[k] is float else (list(v) if isinstance(v, list) else v)
                  for k, v in data.items()})


def _check_type(value: Any, hint: Any, key: str) -> None:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {item.__name__}, got {value!r}")
        for i, v in enumerate(value):
            _check_type(v, item, f"{key}[{i}]")
        return
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")


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


def default_work_dir(site: SiteSection, ssh: SSHSection) -> str:
    """~/.dilococtl/work of the user that runs the site: the control plane's home for a local site,
    else the SSH user's home as Linux lays it out (/root, /home/USER); set work_dir where it differs."""
    if site.hosts and is_local(site.hosts[0]):
        from dilococtl.paths import default_work_dir as local_default

        return str(local_default())
    import getpass

    user = ssh.user or getpass.getuser()
    return f"{'/root' if user == 'root' else '/home/' + user}/.dilococtl/work"


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


def _check_values(sections: list[tuple[str, Any]]) -> None:
    """Every number finite, no control characters in any text (names, hosts, paths, users)."""
    for where, obj in sections:
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            for i, item in enumerate(v if isinstance(v, list) else [v]):
                key = f"{where}.{f.name}" + (f"[{i}]" if isinstance(v, list) else "")
                if isinstance(item, float) and not math.isfinite(item):
                    raise ConfigError(f"{key}: must be a finite number, got {item}")
                if isinstance(item, str) and not item.isprintable():
                    raise ConfigError(f"{key}: control characters are not allowed, got {item!r}")


def _check(spec: RunSpec) -> None:
    run, ssh, sites = spec.run, spec.ssh, spec.sites
    _check_values([("run", run), ("ssh", ssh), ("metrics", spec.metrics),
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
    if lighthouse_relayed(spec) and _lighthouse_hosting_site(spec) is None \
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
