"""A Slurm site's settings and Slurm's time syntax (no subprocesses, no I/O)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from dilococtl.errors import BadInput

UNLIMITED = -1  # minutes: Slurm's UNLIMITED / INFINITE
MAX_NODES = 100_000  # a sanity bound, far above any cluster
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@%+-]*")  # partition, account, QoS: nothing a shell reads
_CONSTRAINT_RE = re.compile(r"[A-Za-z0-9_.&|!*()\[\]:,-]+")  # Slurm's feature expressions
# sbatch arguments the script already sets from the site's keys: given again in sbatch_args they would
# silently win or conflict
_OWNED_ARGS = ("--partition", "-p", "--account", "-A", "--qos", "-q", "--nodes", "-N", "--gpus-per-node",
               "--time", "-t", "--constraint", "-C", "--requeue", "--no-requeue", "--signal", "--output", "-o",
               "--error", "-e", "--job-name", "-J", "--chdir", "-D", "--open-mode")


@dataclass(kw_only=True, slots=True)
class SlurmSite:
    """One site as a Slurm cluster: where to submit and what to ask for."""

    name: str  # the site's name (the job is named dilococtl-RUN-SITE)
    login: str  # the login node sbatch/squeue/scancel run on (reached over SSH as other hosts are)
    partition: str = ""  # -p ("" = the cluster's default partition)
    account: str = ""  # -A ("" = the user's default account)
    qos: str = ""  # -q ("" = the association's default QoS)
    nodes: int = 1  # -N: nodes of the site's one job
    gpus_per_node: int = 0  # --gpus-per-node (0: not asked, a CPU job)
    time_limit: str = ""  # -t in Slurm's syntax (MM, HH:MM:SS, D-HH:MM...; "" = the partition's default)
    constraint: str = ""  # -C feature expression ("" = none)
    sbatch_args: list[str] = field(default_factory=list)  # further #SBATCH arguments, one per item


def parse_time_limit(text: str) -> int:
    """Minutes (rounded up) of a Slurm time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or
    UNLIMITED/INFINITE (-1). BadInput for anything else."""
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE"):
        return UNLIMITED
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if not m:
        raise BadInput(f"bad Slurm time {text!r}: use MM, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    if days is not None:  # D-HH[:MM[:SS]]
        secs = int(days) * 86400 + a * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # HH:MM:SS
        secs = a * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # MM:SS
        secs = a * 60 + int(b)
    else:  # MM
        secs = a * 60
    return -(-secs // 60)


def format_minutes(minutes: int) -> str:
    """Minutes as Slurm prints a time limit (D-HH:MM:SS or HH:MM:SS; UNLIMITED)."""
    if minutes == UNLIMITED:
        return "UNLIMITED"
    d, rest = divmod(minutes, 1440)
    h, m = divmod(rest, 60)
    return f"{d}-{h:02d}:{m:02d}:00" if d else f"{h:02d}:{m:02d}:00"


def validate(site: SlurmSite, where: str) -> None:
    """BadInput naming `where.key` for the first bad setting."""
    if not site.login:
        raise BadInput(f"{where}.login: a Slurm site needs its login node")
    for key in ("partition", "account", "qos"):
        value = getattr(site, key)
        if value and not _NAME_RE.fullmatch(value):
            raise BadInput(f"{where}.{key}: not a Slurm name: {value!r}")
    if not 1 <= site.nodes <= MAX_NODES:
        raise BadInput(f"{where}.nodes: must be in [1, {MAX_NODES}], got {site.nodes}")
    if not 0 <= site.gpus_per_node <= 1024:
        raise BadInput(f"{where}.gpus_per_node: must be in [0, 1024], got {site.gpus_per_node}")
    if site.time_limit:
        try:
            minutes = parse_time_limit(site.time_limit)
        except BadInput as e:
            raise BadInput(f"{where}.time_limit: {e}") from None
        if minutes == 0:
            raise BadInput(f"{where}.time_limit: must be more than 0 minutes")
    if site.constraint and not _CONSTRAINT_RE.fullmatch(site.constraint):
        raise BadInput(f"{where}.constraint: not a Slurm feature expression: {site.constraint!r}")
    for i, arg in enumerate(site.sbatch_args):
        if not arg.startswith("-") or "\n" in arg or "\r" in arg:
            raise BadInput(f"{where}.sbatch_args[{i}]: one sbatch option per item, starting with '-': {arg!r}")
        opt = arg.split("=", 1)[0] if arg.startswith("--") else arg[:2]
        if opt in _OWNED_ARGS:
            raise BadInput(f"{where}.sbatch_args[{i}]: {opt} is set by the site's own keys or by dilococtl")
        try:
            shlex.split(arg)
        except ValueError as e:
            raise BadInput(f"{where}.sbatch_args[{i}]: {e}") from None


def slurm_site(site) -> SlurmSite:
    """The Slurm settings of a run spec's [[sites]] table (a dilococtl.spec_types.SiteSection)."""
    return SlurmSite(name=site.name, login=site.login, partition=site.partition, account=site.account, qos=site.qos,
                     nodes=site.nodes, gpus_per_node=site.gpus_per_node, time_limit=site.time_limit,
                     constraint=site.constraint, sbatch_args=list(site.sbatch_args))
