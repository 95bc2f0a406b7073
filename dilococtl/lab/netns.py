"""Namespaces, veths, bridges, routes and processes: thin wrappers over `ip`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable

from dilococtl.errors import BadInput, DilocoError

SSHD = "/usr/sbin/sshd"
TOOLS = ("ip", "tc", "iptables", "unshare", "ssh-keygen")


def run(args: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a command; a failure becomes one DilocoError line naming the command and its error."""
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise DilocoError(f"{args[0]}: command not found") from None
    except subprocess.TimeoutExpired:
        raise DilocoError(f"`{' '.join(args)}` timed out after {timeout:g}s") from None
    if check and r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        raise DilocoError(f"`{' '.join(args)}` failed: {lines[-1] if lines else f'exit {r.returncode}'}")
    return r


def in_ns(ns: str, args: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *args]


def require_root() -> None:
    """BadInput (exit 2) unless root with the tools the lab drives."""
    if os.geteuid() != 0:
        raise BadInput("dilococtl lab needs root (network namespaces, tc, iptables): run it as root")
    missing = [t for t in TOOLS if shutil.which(t) is None] + ([SSHD] if not os.access(SSHD, os.X_OK) else [])
    if missing:
        raise BadInput(f"dilococtl lab needs {', '.join(missing)} (Debian: iproute2, iptables, openssh-server)")


def namespaces() -> list[str]:
    out = run(["ip", "-j", "netns", "list"], check=False).stdout.strip()
    try:
        return [n["name"] for n in json.loads(out)] if out else []
    except (ValueError, KeyError, TypeError):
        return [line.split()[0] for line in out.splitlines() if line.strip()]


def add_ns(name: str) -> None:
    r = run(["ip", "netns", "add", name], check=False)
    if r.returncode != 0:
        raise DilocoError(f"cannot create network namespace {name}: {r.stderr.strip() or 'unknown error'}")
    run(["ip", "-n", name, "link", "set", "lo", "up"])
    # IPv6 would only add router solicitations and DAD noise to the lab's links.
    run(in_ns(name, ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"]), check=False)
    run(in_ns(name, ["sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"]), check=False)
    # As WAN-tuned hosts do: a DiLoCo exchange follows minutes of idle link, and Linux would restart
    # it in slow start (about log2(BDP / 10 MSS) extra round trips per sync).
    run(in_ns(name, ["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"]), check=False)


def cap_tcp_buffers(name: str, nbytes: int) -> None:
    """Cap the namespace's TCP send and receive buffers (autotuning's maximum) at nbytes: a lab link
    whose bandwidth-delay product exceeds them is window-limited per connection, as a datacenter WAN
    link is for hosts with Linux's defaults (4-6 MB)."""
    for key, default in (("net.ipv4.tcp_rmem", 131072), ("net.ipv4.tcp_wmem", 16384)):
        run(in_ns(name, ["sysctl", "-qw", f"{key}=4096 {min(default, nbytes)} {nbytes}"]))


def ns_pids(ns: str) -> list[int]:
    out = run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _ns_id(pid: int, kind: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return ""


def uts_members(ids: set[str]) -> set[int]:
    """Every process in one of these UTS namespaces (ids as /proc/PID/ns/uts reads them)."""
    ids.discard("")
    if not ids:
        return set()
    return {int(d) for d in os.listdir("/proc") if d.isdigit() and _ns_id(int(d), "uts") in ids}


def exe_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """True if `pid` runs (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_ns_processes(nss: list[str], grace_s: float, spare: Callable[[int], bool] = lambda pid: False) -> list[int]:
    """SIGTERM every process in the namespaces `nss` not spared, SIGKILL what is left after
    `grace_s`; returns the pids signalled."""

    def victims() -> set[int]:
        pids = {p for ns in nss for p in ns_pids(ns)}
        # a node process that moved to a network namespace of its own (the Lighthouse does, so only
        # the run reaches its port) still has the node's hostname: its UTS namespace is the node's
        pids |= uts_members({_ns_id(p, "uts") for p in pids} - {_ns_id(os.getpid(), "uts")})
        return {p for p in pids if p != os.getpid() and not spare(p)}

    first = victims()
    _signal(sorted(first), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in first):
        time.sleep(0.05)
    # Children forked during the grace period (a torchrun restarting a worker) are caught here too.
    late = victims() | {p for p in first if alive(p)}
    _signal(sorted(late), signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(alive(p) for p in late):
        time.sleep(0.02)
    return sorted(first | late)


def delete_ns(name: str) -> None:
    run(["ip", "netns", "del", name], check=False)


def root_routes() -> list[dict]:
    out = run(["ip", "-j", "-4", "route", "show", "table", "all"], check=False).stdout.strip()
    return json.loads(out) if out else []


def root_addresses() -> list[str]:
    out = run(["ip", "-j", "-4", "addr"], check=False).stdout.strip()
    addrs = []
    for link in json.loads(out) if out else []:
        for a in link.get("addr_info", []):
            if a.get("family") == "inet":
                addrs.append(f"{a['local']}/{a['prefixlen']}")
    return addrs


def root_links() -> list[str]:
    out = run(["ip", "-j", "link"], check=False).stdout.strip()
    return [link["ifname"] for link in json.loads(out)] if out else []
