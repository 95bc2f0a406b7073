"""doctor for a Slurm site: can its login node submit the job the site asks for. One line per check.

Checks, in order (a later one is skipped when it cannot be decided, so a failure is said once):

- tools: sinfo, sbatch, squeue, scancel and scontrol are on the login node's PATH.
- partition: the site's partition (or the cluster's default) exists and is UP.
- account / qos: where Slurm keeps accounting (slurmdbd), the user's associations list them;
  everywhere, the partition's Allow/Deny lists admit them and `sbatch --test-only` accepts them
  (which is also where a site's job_submit plugin refuses them: the lab's does).
- gpus: enough of the partition's nodes have `gpus_per_node` GPUs in their GRES.
- time: the time limit is within the partition's MaxTime (`--test-only` does not refuse that: the job
  would pend forever with reason PartitionTimeLimit).
- reach (check_reach, a separate call: it takes an allocation): every compute node of a short job
  like the site's opens a TCP connection to each coordinator (Lighthouse, relay, outer service) the run
  will have them dial; one line per unreachable target, naming the nodes.
- killwait (when the run's grace is given): Slurm's KillWait, the time between the SIGTERM of a
  cancel or requeue and its SIGKILL, leaves the trainer its checkpoint grace (a warning: the site
  still runs, but a preempted site may lose the round it was in).
"""

from __future__ import annotations

import math
import re
import shlex

from dilococtl.doctor_check import FAIL, OK, WARN, Check
from dilococtl.slurm.commands import QUERY_TIMEOUT_S, Login
from dilococtl.slurm.config import UNLIMITED, SlurmSite, format_minutes, parse_time_limit
from dilococtl.slurm.parse import (
    NodeInfo,
    Partition,
    parse_partitions,
    parse_sinfo_nodes_json,
    parse_sinfo_nodes_text,
)
from dilococtl.slurm.script import signal_lead_s

TOOLS = ("sinfo", "sbatch", "squeue", "scancel", "scontrol")
REACH_ALLOC_S = 30  # srun --immediate: a busy cluster that gives no allocation within this is a warning
REACH_CONNECT_S = 5  # one TCP connect from a compute node


def _first_error(text: str) -> str:
    """The most telling line of sbatch's stderr ('allocation failure: ...' over 'sbatch: error: ...')."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "failure" in ln or "error" in ln:
            return ln.removeprefix("sbatch: error: ").removeprefix("allocation failure: ")
    return lines[-1] if lines else "refused"


def test_only(login: Login, site: SlurmSite, partition: str, *, qos: bool = False, resources: bool = False) -> str:
    """'' if `sbatch --test-only` accepts the site's account (and QoS, and nodes/GPUs), else why not."""
    args = ["sbatch", "--test-only", f"--partition={partition}"]
    if site.account:
        args.append(f"--account={site.account}")
    if qos and site.qos:
        args.append(f"--qos={site.qos}")
    if resources:
        args.append(f"--nodes={site.nodes}")
        if site.gpus_per_node:
            args.append(f"--gpus-per-node={site.gpus_per_node}")
    r = login.run(" ".join(shlex.quote(a) for a in args) + " --wrap true", timeout=QUERY_TIMEOUT_S)
    return "" if r.ok else _first_error(r.stderr or r.stdout)


def check_partition(site: SlurmSite, parts: dict[str, Partition]) -> tuple[Check, Partition | None]:
    if site.partition:
        part = parts.get(site.partition)
        if part is None:
            known = ", ".join(sorted(parts)) or "none"
            return Check(name="partition", status=FAIL,
                         detail=f"partition {site.partition!r} does not exist (partitions: {known})"), None
    else:
        part = next((p for p in parts.values() if p.default), None)
        if part is None:
            return Check(name="partition", status=FAIL, detail="no partition given and the cluster has no default"), None
    if part.state != "UP":
        return Check(name="partition", status=FAIL, detail=f"partition {part.name} is {part.state}, not UP"), part
    return Check(name="partition", status=OK, detail=f"partition {part.name} is UP ({part.total_nodes} nodes, "
                                                     f"MaxTime {format_minutes(part.max_time_min)})"), part


def _listed(value: str, allow: list[str], deny: list[str]) -> bool:
    return ("ALL" in allow or value in allow) and value not in deny


def check_lists(site: SlurmSite, part: Partition) -> list[Check]:
    """The partition's Allow/Deny Accounts and Qos lists against the site's account and QoS."""
    out = []
    if site.account and not _listed(site.account, part.allow_accounts, part.deny_accounts):
        out.append(Check(name="account", status=FAIL,
                         detail=f"account {site.account!r} may not use partition {part.name} "
                                f"(AllowAccounts={','.join(part.allow_accounts)})"))
    if site.qos and not _listed(site.qos, part.allow_qos, part.deny_qos):
        out.append(Check(name="qos", status=FAIL, detail=f"QoS {site.qos!r} may not use partition {part.name} "
                                                        f"(AllowQos={','.join(part.allow_qos)})"))
    return out


def check_gpus(site: SlurmSite, part: Partition, nodes: list[NodeInfo]) -> Check:
    """Enough nodes of the partition with gpus_per_node GPUs (and the node count at all)."""
    members = [n for n in nodes if part.name in n.partitions]
    fit = [n for n in members if n.gpus >= site.gpus_per_node]
    most = max((n.gpus for n in members), default=0)
    if len(fit) < site.nodes:
        what = f"{site.gpus_per_node} GPUs per node" if site.gpus_per_node else "nodes"
        return Check(name="gpus", status=FAIL,
                     detail=f"partition {part.name} has {len(fit)} nodes with {what}, the site asks for {site.nodes} "
                            f"(at most {most} GPUs per node there)")
    return Check(name="gpus", status=OK, detail=f"{len(fit)} nodes of {part.name} have >= {site.gpus_per_node} GPUs "
                                               f"(the site uses {site.nodes})")


FIRST_ROUND_S = 60  # start-up and a first round before a job can checkpoint anything (~15 s of start-up in the lab)
EARLY_SIGNAL_S = 60  # Slurm may send --signal up to this much before the lead it was asked for (sbatch(1))


def check_time(site: SlurmSite, part: Partition, grace_s: float = 30.0) -> Check:
    if site.time_limit and (want := parse_time_limit(site.time_limit)) != UNLIMITED:
        lead = signal_lead_s(grace_s)
        # signalled before its first checkpoint, a job fails instead of chaining (1 minute in the lab did)
        status = FAIL if want * 60 < lead + EARLY_SIGNAL_S else \
            WARN if want * 60 < lead + EARLY_SIGNAL_S + FIRST_ROUND_S else OK
        if status != OK:
            return Check(name="time", status=status,
                         detail=f"time_limit {site.time_limit} may end a job before its first round is saved: "
                                f"the checkpoint signal comes {lead} s before the limit, Slurm may send it up to "
                                f"{EARLY_SIGNAL_S} s earlier, and start-up takes time (at least "
                                f"{math.ceil((lead + EARLY_SIGNAL_S + FIRST_ROUND_S) / 60)} min is safe)")
    if not site.time_limit:
        return Check(name="time", status=OK, detail=f"the partition's default time limit (MaxTime "
                                                   f"{format_minutes(part.max_time_min)})")
    want = parse_time_limit(site.time_limit)
    if part.max_time_min != UNLIMITED and (want == UNLIMITED or want > part.max_time_min):
        return Check(name="time", status=FAIL,
                     detail=f"time_limit {site.time_limit} is over partition {part.name}'s MaxTime "
                            f"{format_minutes(part.max_time_min)} (the job would pend forever: PartitionTimeLimit)")
    return Check(name="time", status=OK, detail=f"time_limit {format_minutes(want)} within MaxTime "
                                               f"{format_minutes(part.max_time_min)}")


def check_kill_wait(config_text: str, grace_s: float) -> Check:
    """`scontrol show config`'s KillWait against the trainer's checkpoint grace."""
    m = re.search(r"^KillWait\s*=\s*(\d+)", config_text, re.M)
    if m is None:
        return Check(name="killwait", status=WARN, detail="KillWait not found in scontrol show config")
    kill_wait = int(m.group(1))
    if kill_wait < grace_s:
        return Check(name="killwait", status=WARN,
                     detail=f"KillWait {kill_wait}s < run.grace_s {grace_s:g}s: a cancelled or requeued site is "
                            "killed before its checkpoint is written")
    return Check(name="killwait", status=OK, detail=f"KillWait {kill_wait}s >= run.grace_s {grace_s:g}s")


def _associations(login: Login) -> list[tuple[str, list[str]]] | None:
    """(account, QoS names) of the user's associations; None where Slurm keeps no accounting."""
    r = login.run("scontrol show config", timeout=QUERY_TIMEOUT_S)
    if not r.ok or "accounting_storage/none" in r.stdout:
        return None
    r = login.run('sacctmgr -n -P show assoc where user="$(id -un)" format=account,qos', timeout=QUERY_TIMEOUT_S)
    if not r.ok:
        return None
    out = []
    for line in r.stdout.splitlines():
        acct, _, qos = line.partition("|")
        if acct.strip():
            out.append((acct.strip(), [q for q in qos.strip().split(",") if q]))
    return out


def check_site(login: Login, site: SlurmSite, grace_s: float | None = None) -> list[Check]:
    """Every check of one Slurm site, through its login node (KillWait too when `grace_s` is given)."""
    r = login.run("for t in " + " ".join(TOOLS) + '; do command -v "$t" >/dev/null || echo "$t"; done',
                  timeout=QUERY_TIMEOUT_S)
    missing = r.stdout.split() if r.ok else list(TOOLS)
    if missing:
        return [Check(name="slurm", status=FAIL, detail=f"{', '.join(missing)} not found on login node {login.host}")]
    checks = [Check(name="slurm", status=OK, detail=f"Slurm tools on {login.host}")]
    r = login.run("scontrol show partition -o", timeout=QUERY_TIMEOUT_S)
    if not r.ok:
        return checks + [Check(name="partition", status=FAIL, detail=f"scontrol show partition: {r.stderr.strip()[:200]}")]
    check, part = check_partition(site, parse_partitions(r.stdout))
    checks.append(check)
    if part is None:
        return checks
    listed = check_lists(site, part)
    checks += listed
    failed = {c.name for c in listed}
    assoc = _associations(login) if site.account or site.qos else None
    if assoc is not None and "account" not in failed and site.account and site.account not in {a for a, _ in assoc}:
        checks.append(Check(name="account", status=FAIL, detail=f"account {site.account!r} is not one of yours "
                                                               f"({', '.join(sorted({a for a, _ in assoc})) or 'none'})"))
        failed.add("account")
    if site.account and "account" not in failed:
        why = test_only(login, site, part.name)
        checks.append(Check(name="account", status=FAIL if why else OK,
                            detail=f"account {site.account!r}: {why}" if why else f"account {site.account} accepted"))
        failed |= {"account"} if why else set()
    if site.qos and "qos" not in failed and "account" not in failed:
        why = test_only(login, site, part.name, qos=True)
        checks.append(Check(name="qos", status=FAIL if why else OK,
                            detail=f"QoS {site.qos!r}: {why}" if why else f"QoS {site.qos} accepted"))
    r = login.run("sinfo --json", timeout=QUERY_TIMEOUT_S)
    if r.ok:
        nodes = parse_sinfo_nodes_json(r.stdout)
    else:
        r = login.run("sinfo -h -N -o '%N|%P|%G|%T'", timeout=QUERY_TIMEOUT_S)
        nodes = parse_sinfo_nodes_text(r.stdout) if r.ok else []
    checks.append(check_gpus(site, part, nodes))
    checks.append(check_time(site, part, grace_s if grace_s is not None else 30.0))
    if grace_s is not None:
        r = login.run("scontrol show config", timeout=QUERY_TIMEOUT_S)
        checks.append(check_kill_wait(r.stdout, grace_s) if r.ok else
                      Check(name="killwait", status=WARN, detail="scontrol show config failed"))
    return checks


def reach_command(site: SlurmSite, targets: list[tuple[str, int]]) -> str:
    """An srun over the site's nodes (one task each) that prints `NODE HOST PORT ok|fail` per target."""
    probes = "; ".join(
        f"if timeout {REACH_CONNECT_S} bash -c 'exec 3<>/dev/tcp/{shlex.quote(h)}/{int(p)}' 2>/dev/null; "
        f'then echo "$(hostname) {shlex.quote(h)} {int(p)} ok"; else echo "$(hostname) {shlex.quote(h)} {int(p)} fail"; fi'
        for h, p in targets)
    args = ["srun", f"--immediate={REACH_ALLOC_S}", f"--nodes={site.nodes}", "--ntasks-per-node=1", "--time=2",
            "--job-name=dilococtl-doctor"]
    for opt, value in (("--partition", site.partition), ("--account", site.account), ("--qos", site.qos),
                       ("--constraint", site.constraint)):
        if value:
            args.append(f"{opt}={value}")
    return " ".join(shlex.quote(a) for a in args) + " bash -c " + shlex.quote(probes)


def judge_reach(output: str, targets: list[tuple[str, int, str]]) -> list[Check]:
    """One check per target (host, port, what): ok, or fail naming the nodes that could not connect."""
    results: dict[tuple[str, int], dict[str, bool]] = {}
    for line in output.splitlines():
        f = line.split()
        if len(f) == 4 and f[2].isdigit() and f[3] in ("ok", "fail"):
            results.setdefault((f[1], int(f[2])), {})[f[0]] = f[3] == "ok"
    out = []
    for host, port, what in targets:
        seen = results.get((host, port), {})
        bad = sorted(n for n, ok in seen.items() if not ok)
        if not seen:
            out.append(Check(name="reach", status=FAIL, detail=f"no compute node reported on {what} {host}:{port}"))
        elif bad:
            out.append(Check(name="reach", status=FAIL,
                             detail=f"compute nodes {', '.join(bad)} cannot reach {what} {host}:{port}"))
        else:
            out.append(Check(name="reach", status=OK,
                             detail=f"{len(seen)} compute nodes reach {what} {host}:{port}"))
    return out


def check_reach(login: Login, site: SlurmSite, targets: list[tuple[str, int, str]]) -> list[Check]:
    """From every node of a short allocation like the site's: can it connect to each (host, port, what)."""
    r = login.run(reach_command(site, [(h, p) for h, p, _ in targets]),
                  timeout=REACH_ALLOC_S + REACH_CONNECT_S * len(targets) + 60)
    if not r.stdout.strip():
        why = _first_error(r.stderr) if r.stderr.strip() else f"exit {r.rc}"
        return [Check(name="reach", status=WARN,
                      detail=f"no allocation to test reachability from compute nodes within {REACH_ALLOC_S}s: {why}")]
    return judge_reach(r.stdout, targets)
