"""Per-node CPU caps (`lab up --cpus-per-node C`): each node's sshd, and so everything started on the
node, runs in its own cgroup with a CPU quota of C cores.

On one host the emulated sites share its cores: when a site dies the others speed up, when it comes
back they slow down, so a goodput ledger measured against each site's own compute would count the
host's sharing as the run's loss. A site capped below its fair share runs at the same speed alone as
beside the others, as a datacenter on its own hardware does. cgroup v1's cpu controller
(/sys/fs/cgroup/cpu, as on these machines) or cgroup v2's cpu.max.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from dilococtl.errors import BadInput
from dilococtl.lab.model import LabNode, LabState

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000  # the quota's period: short enough that a capped node's steps are throttled evenly
PREFIX = "dilococtl-lab-"


def _root() -> Path | None:
    """Where cpu cgroups are made here, or None without a writable cpu controller."""
    if (V1 / "cpu.cfs_quota_us").exists() and os.access(V1, os.W_OK):
        return V1
    if "cpu" in (V2 / "cgroup.subtree_control").read_text().split() if (V2 / "cgroup.subtree_control").exists() \
            else False:
        return V2
    return None


def check(cpus: float) -> None:
    """BadInput unless `cpus` is a usable cap (0: none) and this host can enforce it."""
    if cpus == 0:
        return
    if not (math.isfinite(cpus) and 0.05 <= cpus <= (os.cpu_count() or 1)):
        raise BadInput(f"--cpus-per-node: must be 0 (no cap) or between 0.05 and this host's {os.cpu_count()} "
                       f"cores, got {cpus}")
    if _root() is None:
        raise BadInput("--cpus-per-node needs a writable cgroup cpu controller (/sys/fs/cgroup/cpu, or cgroup v2 "
                       "with cpu in /sys/fs/cgroup/cgroup.subtree_control)")


def lab_group(state: LabState) -> Path | None:
    root = _root()
    return root / f"{PREFIX}{state.id}" if root is not None else None


def cap(state: LabState, node: LabNode, pid: int) -> None:
    """Put `pid` (the node's sshd) in the node's cgroup, capped at state.cpus_per_node cores."""
    group = lab_group(state)
    assert group is not None  # check() ran before the lab was built
    d = group / node.name
    d.mkdir(parents=True, exist_ok=True)
    quota = max(1000, round(state.cpus_per_node * PERIOD_US))
    if (d / "cpu.cfs_quota_us").exists():
        (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (d / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    (d / "cgroup.procs").write_text(str(pid))


def remove(lab_id: str | None = None) -> list[str]:
    """Remove the lab's cgroups (every lab's with None) once their processes are gone; returns what went."""
    root = _root()
    if root is None:
        return []
    gone = []
    for group in root.glob(f"{PREFIX}{lab_id or '*'}"):
        for d in [*group.iterdir(), group]:
            if d.is_dir():
                with contextlib.suppress(OSError):  # still holds a process: the next `lab down` retries
                    d.rmdir()
                    gone.append(d.name)
    return gone
