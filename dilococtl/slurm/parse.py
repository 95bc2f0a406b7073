"""What Slurm's commands print, as typed records.

Measured on Slurm 22.05.8 (Debian bookworm): `squeue --json` and `sinfo --json` work (openapi
v0.0.38); `squeue --json -j ID` ignores `-j` (callers filter); `sinfo --json` has nodes only, so
partitions come from `scontrol show partition -o` (22.05's scontrol has no --json); `squeue` has no
--parsable2, hence SQUEUE_FORMAT; `sacct` answers only where slurmdbd keeps accounting. A JSON
`exit_code` is a wait status (exit code << 8 | signal); sacct's ExitCode is "code:signal".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from dilococtl.errors import DilocoError
from dilococtl.slurm.config import UNLIMITED, parse_time_limit

SQUEUE_FORMAT = "%i|%T|%r|%N|%j|%P"  # squeue -h -t all -o: id, state, reason, nodes, name, partition
SACCT_FORMAT = "JobIDRaw,State,Reason,NodeList,ExitCode,JobName,Partition"  # sacct -X -n --parsable2 -o
SINFO_NODE_FORMAT = "%N|%P|%G|%T"  # sinfo -h -N -o: node, partition, gres, state
# states whose exit code is the batch script's (a cancelled or never started job's code means nothing)
_EXITED = ("COMPLETED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY")


@dataclass(kw_only=True, slots=True)
class JobInfo:
    job_id: str  # Slurm's job id
    state: str  # base state, upper case (RUNNING, PENDING, COMPLETED, ...; "CANCELLED by 0" -> CANCELLED)
    reason: str = ""  # pending or end reason ("" when Slurm says None)
    nodes: str = ""  # node list in Slurm's compressed form ("" while pending)
    name: str = ""  # job name
    partition: str = ""
    restarts: int = 0  # times the job was requeued (0 where the source does not say)
    exit_code: int | None = None  # the batch script's exit code, once ended (None: unknown / running)
    signal: int = 0  # signal that ended it (0: none)


@dataclass(kw_only=True, slots=True)
class Partition:
    name: str
    state: str  # UP, DOWN, DRAIN, INACTIVE
    max_time_min: int  # MaxTime in minutes (UNLIMITED = -1)
    nodes: str = ""  # node list
    total_nodes: int = 0
    default: bool = False
    allow_accounts: list[str] = field(default_factory=lambda: ["ALL"])
    deny_accounts: list[str] = field(default_factory=list)
    allow_qos: list[str] = field(default_factory=lambda: ["ALL"])
    deny_qos: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class NodeInfo:
    name: str
    state: str  # lower case, as sinfo prints it (idle, mixed, allocated, down, drained, ...)
    partitions: list[str]
    gpus: int  # GPUs in its GRES (all types summed)


def _base_state(value: object) -> str:
    text = " ".join(value) if isinstance(value, list) else str(value or "")
    return text.strip().split(" ")[0].split("+")[0].upper()


def _reason(value: object) -> str:
    text = str(value or "").strip()
    return "" if text in ("None", "(null)") else text


def _load(text: str, what: str) -> dict:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise DilocoError(f"{what}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise DilocoError(f"{what}: expected a JSON object")
    errors = [e for e in data.get("errors") or [] if e]
    if errors:
        first = errors[0]
        msg = first.get("description") or first.get("error") if isinstance(first, dict) else str(first)
        raise DilocoError(f"{what}: {msg}")
    return data


def parse_squeue_json(text: str, job_ids: set[str] | None = None) -> list[JobInfo]:
    """Jobs of `squeue --json` (only `job_ids` when given: 22.05 ignores -j under --json)."""
    out = []
    for j in _load(text, "squeue --json").get("jobs", []):
        jid = str(j.get("job_id", ""))
        if job_ids is not None and jid not in job_ids:
            continue
        state = _base_state(j.get("job_state"))
        status = j.get("exit_code")
        code, sig = (None, 0)
        if state in _EXITED and isinstance(status, int):
            code, sig = (status >> 8) & 0xFF, status & 0x7F
        out.append(JobInfo(job_id=jid, state=state, reason=_reason(j.get("state_reason")), nodes=str(j.get("nodes") or ""),
                           name=str(j.get("name") or ""), partition=str(j.get("partition") or ""),
                           restarts=int(j.get("restart_cnt") or 0), exit_code=code, signal=sig))
    return out


def parse_squeue_text(text: str) -> list[JobInfo]:
    """Jobs of `squeue -h -t all -o SQUEUE_FORMAT`."""
    out = []
    for line in text.splitlines():
        f = line.split("|")
        if len(f) < 4 or not f[0].strip():
            continue
        f += [""] * (6 - len(f))
        out.append(JobInfo(job_id=f[0].strip(), state=_base_state(f[1]), reason=_reason(f[2]), nodes=f[3].strip(),
                           name=f[4].strip(), partition=f[5].strip()))
    return out


def parse_sacct_parsable(text: str) -> list[JobInfo]:
    """Jobs (not steps) of `sacct -X -n --parsable2 -o SACCT_FORMAT`."""
    out = []
    for line in text.splitlines():
        f = line.split("|")
        if len(f) < 5 or not f[0].strip() or "." in f[0]:
            continue
        f += [""] * (7 - len(f))
        code, _, sig = f[4].partition(":")
        state = _base_state(f[1])
        out.append(JobInfo(job_id=f[0].strip(), state=state, reason=_reason(f[2]),
                           nodes="" if f[3].strip() in ("None assigned", "") else f[3].strip(), name=f[5].strip(),
                           partition=f[6].strip(), exit_code=int(code) if state in _EXITED and code.isdigit() else None,
                           signal=int(sig) if sig.isdigit() else 0))
    return out


def _list(value: str, default: list[str]) -> list[str]:
    return [v for v in value.split(",") if v] if value and value != "(null)" else default


def parse_partitions(text: str) -> dict[str, Partition]:
    """`scontrol show partition -o` (one KEY=VALUE line per partition) by name."""
    out = {}
    for line in text.splitlines():
        kv = dict(re.findall(r"(\w+)=(\S*)", line))
        if "PartitionName" not in kv:
            continue
        max_time = kv.get("MaxTime", "UNLIMITED")
        out[kv["PartitionName"]] = Partition(
            name=kv["PartitionName"], state=kv.get("State", "").upper(),
            max_time_min=parse_time_limit(max_time) if max_time else UNLIMITED,
            nodes=kv.get("Nodes", ""), total_nodes=int(kv.get("TotalNodes", "0") or 0),
            default=kv.get("Default") == "YES",
            allow_accounts=_list(kv.get("AllowAccounts", ""), ["ALL"]), deny_accounts=_list(kv.get("DenyAccounts", ""), []),
            allow_qos=_list(kv.get("AllowQos", ""), ["ALL"]), deny_qos=_list(kv.get("DenyQos", ""), []))
    return out


def gres_gpus(gres: str) -> int:
    """GPUs in a GRES string: 'gpu:2', 'gpu:h100:8(S:0-1)', 'gpu:a100:4,gpu:h100:4', '(null)'."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres or ""):
        item = re.sub(r"\(.*?\)", "", item).strip()
        parts = item.split(":")
        if parts[0] != "gpu":
            continue
        count = parts[-1] if len(parts) > 1 else "1"
        total += int(count) if count.isdigit() else 0
    return total


def parse_sinfo_nodes_json(text: str) -> list[NodeInfo]:
    """Nodes of `sinfo --json`."""
    out = []
    for n in _load(text, "sinfo --json").get("nodes", []):
        state = n.get("state", "")
        out.append(NodeInfo(name=str(n.get("name", "")), state=str(" ".join(state) if isinstance(state, list) else state).lower(),
                            partitions=[str(p) for p in n.get("partitions") or []], gpus=gres_gpus(str(n.get("gres") or ""))))
    return out


def parse_sinfo_nodes_text(text: str) -> list[NodeInfo]:
    """Nodes of `sinfo -h -N -o SINFO_NODE_FORMAT` (one line per node and partition)."""
    nodes: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        f = line.split("|")
        if len(f) < 4 or not f[0].strip():
            continue
        name, part = f[0].strip(), f[1].strip().rstrip("*")
        node = nodes.setdefault(name, NodeInfo(name=name, state=f[3].strip().lower(), partitions=[], gpus=gres_gpus(f[2])))
        if part and part not in node.partitions:
            node.partitions.append(part)
    return list(nodes.values())
