"""A real Slurm per Slurm site of the lab (Debian's slurm-wlm 22.05 and munge).

For a site made a Slurm cluster (`lab up --slurm SITE`):

- the site's first node is its login node: munged and slurmctld run there, beside its sshd;
- every node of the site (the first too) runs one slurmd, so the first node both submits and computes;
- each daemon runs in its node's network, UTS and mount namespaces (entered from the node's sshd with
  nsenter): it has the node's hostname (its NodeName) and hosts file;
- the cluster's configuration directory (slurm.conf, gres.conf, job_submit.lua) is bind-mounted on
  /etc/slurm inside each node's mount namespace only, so sbatch/squeue over SSH and srun/scancel in
  a job find it at Slurm's default path, and the host's /etc/slurm is untouched;
- one munged per cluster, its key made by mungekey; its socket path (AuthInfo=socket=) is a file, so
  every node's namespace reaches it (path sockets ignore network namespaces).

Measured needs (DESIGN.md): no cgroups (proctrack/linuxproc, task/none), SlurmUser=root, no
slurmdbd (accounting_storage/none). Without slurmdbd Slurm accepts any account and QoS, so a
job_submit.lua refuses those the site does not have, as a real site's associations would (and
`sbatch --test-only` answers the same). GPUs are fake: gres.conf Files are char devices made with
mknod (slurmd drops file-less GPUs). `cred_expire` is short so a requeued job waits ~11 s, not 121 s.
`lab down` needs nothing of this module: the daemons live in the nodes' namespaces, whose processes
it kills, and their files are under the lab's directory, which it removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dilococtl.errors import BadInput, DilocoError
from dilococtl.lab.model import LabNode, LabState, lab_dir
from dilococtl.lab.netns import alive, run

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/sbin/mungekey")
READY_S = 60.0  # slurmctld up and every slurmd registered idle within this
CRED_EXPIRE_S = 10  # AuthInfo cred_expire: also how long a requeued job is held before it may start again


@dataclass(kw_only=True, slots=True)
class LabCluster:
    """What one emulated cluster offers; doctor's checks are judged against it."""

    site: str  # the lab site it serves
    partition: str = "lab"  # the one partition (the default), all the site's nodes
    accounts: list[str] = field(default_factory=lambda: ["lab"])  # accounts job_submit.lua accepts
    qos: list[str] = field(default_factory=lambda: ["normal"])  # QoS names it accepts ("" too: the default)
    gpus_per_node: int = 2  # fake GPUs in every node's GRES
    max_time: str = "1:00:00"  # the partition's MaxTime
    cpus_per_node: int = 2  # declared CPUs (config_overrides: not checked against the real ones)
    login: str = ""  # the login node's address (its first node)
    nodes: list[str] = field(default_factory=list)  # node names
    pids: dict[str, int] = field(default_factory=dict)  # daemon name -> pid in the root pid namespace


def cluster_dir(site: str) -> Path:
    return lab_dir() / "slurm" / site


def _index_path() -> Path:
    return lab_dir() / "slurm" / "clusters.json"


def load() -> dict[str, LabCluster]:
    """The lab's Slurm clusters by site ({} when none)."""
    try:
        data = json.loads(_index_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: LabCluster(**v) for k, v in data.items()}


def _save(clusters: dict[str, LabCluster]) -> None:
    p = _index_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({k: asdict(v) for k, v in clusters.items()}, indent=1))
    tmp.replace(p)


def require_slurm() -> None:
    missing = [d for d in DAEMONS if not os.access(d, os.X_OK)]
    if missing:
        raise BadInput(f"lab --slurm needs {', '.join(missing)} (Debian: apt-get install slurmctld slurmd "
                       "slurm-client munge, or `make system-deps`)")


def slurm_conf_text(c: LabCluster, nodes: list[LabNode], d: Path) -> str:
    login = nodes[0]
    lines = [
        f"ClusterName=dlab{c.site.replace('-', '').replace('_', '').replace('.', '')[:30].lower() or 'x'}",
        f"SlurmctldHost={login.name}({login.address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={d}/munge/munge.socket.2,cred_expire={CRED_EXPIRE_S}",
        f"StateSaveLocation={d}/ctld",
        f"SlurmctldPidFile={d}/ctld/slurmctld.pid",
        f"SlurmctldLogFile={d}/ctld/slurmctld.log",
        f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmdPidFile={d}/spool/%n.pid",
        f"SlurmdLogFile={d}/spool/%n.log",
        "ProctrackType=proctrack/linuxproc",  # no cgroups here
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobSubmitPlugins=lua",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "GresTypes=gpu",
        "KillWait=30",  # TERM -> KILL of a cancelled or requeued job: the trainer's grace (run.grace_s default)
        "MinJobAge=3600",  # squeue keeps ended jobs this long (there is no sacct without slurmdbd)
        "SchedulerParameters=sched_interval=2",
    ]
    gres = f" Gres=gpu:{c.gpus_per_node}" if c.gpus_per_node else ""
    for n in nodes:
        lines.append(f"NodeName={n.name} NodeAddr={n.address} CPUs={c.cpus_per_node} RealMemory=1000{gres} State=UNKNOWN")
    lines.append(f"PartitionName={c.partition} Nodes={','.join(n.name for n in nodes)} Default=YES "
                 f"MaxTime={c.max_time} State=UP")
    return "\n".join(lines) + "\n"


def job_submit_lua(c: LabCluster) -> str:
    """The lab's stand-in for slurmdbd's associations: unknown accounts and QoS are refused at submit."""
    accounts = ", ".join(f'["{a}"] = true' for a in c.accounts)
    qos = ", ".join(f'["{q}"] = true' for q in c.qos)
    return f"""-- generated by dilococtl lab: accounts and QoS this cluster knows
local accounts = {{ {accounts} }}
local qos = {{ {qos} }}
function slurm_job_submit(job_desc, part_list, submit_uid)
  if job_desc.account == nil or not accounts[job_desc.account] then
    slurm.log_user("invalid account %s", tostring(job_desc.account))
    return slurm.ESLURM_INVALID_ACCOUNT
  end
  if job_desc.qos ~= nil and not qos[job_desc.qos] then
    slurm.log_user("invalid qos %s", tostring(job_desc.qos))
    return 2066 -- ESLURM_INVALID_QOS: the plugin's table has no name for it
  end
  return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end
return slurm.SUCCESS
"""


def _write_config(c: LabCluster, nodes: list[LabNode]) -> Path:
    d = cluster_dir(c.site)
    for sub in ("etc", "munge", "ctld", "spool", "dev"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(d / "munge", 0o711)  # munged checks its socket directory's permissions
    for n in nodes:
        (d / "spool" / n.name).mkdir(exist_ok=True)  # slurmd does not create its %n spool directory
    files = []
    for k in range(c.gpus_per_node):
        dev = d / "dev" / f"gpu{k}"
        if not dev.exists():
            run(["mknod", str(dev), "c", "1", "3"])  # /dev/null's numbers: slurmd wants a char device
        files.append(str(dev))
    (d / "etc" / "slurm.conf").write_text(slurm_conf_text(c, nodes, d))
    gres = "".join(f"NodeName={n.name} Name=gpu File={d}/dev/gpu[0-{c.gpus_per_node - 1}]\n" for n in nodes) \
        if c.gpus_per_node else ""
    (d / "etc" / "gres.conf").write_text(gres)
    (d / "etc" / "job_submit.lua").write_text(job_submit_lua(c))
    key = d / "munge" / "munge.key"
    if not key.exists():
        run(["mungekey", "--create", f"--keyfile={key}"])
    return d


def _enter(node: LabNode, args: list[str]) -> list[str]:
    """`args` in the node's namespaces (network, UTS, mount), entered through its sshd."""
    if not alive(node.sshd_pid):
        raise DilocoError(f"lab node {node.name}: its sshd (pid {node.sshd_pid}) is not running")
    return ["nsenter", "-t", str(node.sshd_pid), "-n", "-u", "-m", "--", *args]


def spawn_on_node(node: LabNode, args: list[str], log: Path) -> int:
    """Start `args` detached in the node's namespaces (output appended to `log`); returns its pid."""
    return _daemon(node, args, log)


def _daemon(node: LabNode, args: list[str], log: Path) -> int:
    with open(log, "ab") as out:
        proc = subprocess.Popen(_enter(node, args), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, close_fds=True)
    return proc.pid


def _log_tail(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if "error" in ln.lower()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def on_node(node: LabNode, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a Slurm client command on a lab node, as a user logged in there would."""
    return run(_enter(node, cmd), check=False, timeout=timeout)


def up(state: LabState, site: str, **knobs) -> LabCluster:
    """Start the Slurm cluster of lab site `site`; returns it once every node is idle."""
    require_slurm()
    name = state.site(site).name
    nodes = state.nodes_of(name)
    c = LabCluster(site=name, login=nodes[0].address, nodes=[n.name for n in nodes], **knobs)
    d = _write_config(c, nodes)
    clusters = load()
    clusters[name] = c
    _save(clusters)
    for n in nodes:
        run(_enter(n, ["mount", "--bind", str(d / "etc"), "/etc/slurm"]))
        # `ip netns exec` gave the node a fresh /sys without cgroups, and slurmd 22.05 will not start
        # without the v1 layout the host has (tmpfs + a name=systemd hierarchy), even with
        # proctrack/linuxproc: mount just that, inside the node's own mount namespace
        run(_enter(n, ["mount", "-t", "tmpfs", "cgroup", "/sys/fs/cgroup"]))
        run(_enter(n, ["mkdir", "-p", "/sys/fs/cgroup/systemd"]))
        run(_enter(n, ["mount", "-t", "cgroup", "-o", "none,name=systemd", "cgroup", "/sys/fs/cgroup/systemd"]))
    login = nodes[0]
    c.pids["munged"] = _daemon(login, ["/usr/sbin/munged", "-F", "--force", f"--key-file={d}/munge/munge.key",
                                       f"--socket={d}/munge/munge.socket.2", f"--pid-file={d}/munge/munged.pid",
                                       f"--log-file={d}/munge/munged.log", f"--seed-file={d}/munge/seed"],
                               d / "munge" / "out.log")
    _wait(lambda: (d / "munge" / "munge.socket.2").exists(), 10, f"munged of {name}", d / "munge" / "munged.log")
    c.pids["slurmctld"] = _daemon(login, ["/usr/sbin/slurmctld", "-D", "-f", str(d / "etc" / "slurm.conf")],
                                  d / "ctld" / "out.log")
    for n in nodes:
        c.pids[f"slurmd-{n.name}"] = _daemon(n, ["/usr/sbin/slurmd", "-D", "-f", str(d / "etc" / "slurm.conf")],
                                             d / "spool" / f"{n.name}.out.log")
    _save(clusters)

    def idle() -> bool:
        r = on_node(login, ["sinfo", "-h", "-N", "-o", "%N %T"])
        states = dict(line.split()[:2] for line in r.stdout.splitlines() if len(line.split()) >= 2)
        return r.returncode == 0 and all(states.get(n) == "idle" for n in c.nodes)

    _wait(idle, READY_S, f"Slurm of {name} (every node idle)", d / "ctld" / "slurmctld.log")
    return c


def _wait(ready, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise DilocoError(f"{what} not ready after {timeout_s:g}s {_log_tail(log)}".strip())


def status() -> dict[str, dict]:
    """The lab's Slurm clusters by site, each with whether its daemons are alive."""
    return {site: {**asdict(c), "alive": {name: alive(pid) for name, pid in c.pids.items()}}
            for site, c in load().items()}


def rewrite_spec(path: Path, clusters: dict[str, LabCluster]) -> None:
    """Make the Slurm sites of a `lab up --spec-out` spec Slurm sites: login, partition, account, QoS
    and node count instead of hosts. A CPU job (gpus_per_node 0): the lab's GPUs are fake, and every
    site must run as many trainer processes as the others."""
    import tomlkit

    doc = tomlkit.parse(Path(path).read_text())
    for table in doc["sites"]:
        c = clusters.get(str(table["name"]))
        if c is None:
            continue
        del table["hosts"]
        table["scheduler"] = "slurm"
        table["login"] = c.login
        table["partition"] = c.partition
        table["account"] = c.accounts[0]
        table["qos"] = c.qos[0]
        table["nodes"] = len(c.nodes)
        table["time_limit"] = c.max_time
    Path(path).write_text(tomlkit.dumps(doc))
