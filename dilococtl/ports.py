"""Which TCP ports a run will listen on, per host, and which of them are already taken there.

A run binds fixed ports: the Lighthouse's (or, in async mode, the outer service's) `lighthouse_port`
on the Lighthouse host, and site i's torchrun rendezvous `base_port + i` on the site's leader host.
A port someone else holds makes that process exit at start, often seconds after launch returned
(issue 41: an outer service died with "Address already in use" while the sites waited forever), so
launch asks each host first and refuses in one line naming host:port, before starting anything.

The node's own kernel answers: /proc/net/tcp and tcp6 as seen by the node's shell (inside its network
namespace), so no interpreter is needed there. Only listening sockets count: a connection that merely
uses the port number (TIME_WAIT, an outgoing one) does not keep a listener from binding it.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection, Sequence
from pathlib import Path

from dilococtl import spec_sites as spec_mod
from dilococtl.nodes import Node
from dilococtl.spec_types import RunSpec

_LISTEN = "0A"  # st column of /proc/net/tcp: TCP_LISTEN
LOWEST_PICK = 10000  # free_base picks at or above this


def free_base(offsets: Sequence[int], host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port `p` of this machine, not in `avoid`, with p + o bindable on `host` for every o in `offsets`,
    all below the kernel's ephemeral range: there, any outgoing connection may take a port between
    this pick and the bind of what it is picked for. Random, so that parallel picks keep apart."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    top = low - max(offsets)
    pick = random.SystemRandom()
    for _ in range(1000):
        p = pick.randrange(LOWEST_PICK, max(top, LOWEST_PICK + 1))
        if p not in avoid and all(_bindable(p + o, host) for o in offsets):
            return p
    raise RuntimeError(f"no free ports at offsets {list(offsets)} on {host} below {low}")


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def run_ports(spec: RunSpec) -> dict[str, dict[int, str]]:
    """{host: {port: what listens there}} for every fixed port the run of `spec` binds."""
    out: dict[str, dict[int, str]] = {}
    lh = spec_mod.lighthouse_host(spec)
    what = "the outer parameter service" if spec.diloco.mode == "async" else (
        "the Lighthouse's TLS relay" if spec_mod.lighthouse_relayed(spec) else "the torchft Lighthouse")
    out.setdefault(lh, {})[spec.run.lighthouse_port] = what
    for i, site in enumerate(spec.sites):
        if not site.hosts:  # a Slurm site: its first node is known only once its job runs
            continue
        out.setdefault(site.hosts[0], {})[spec.run.base_port + i] = f"{site.name}'s torchrun rendezvous"
    return out


def listening(proc_net_tcp: str) -> set[int]:
    """The local ports in LISTEN state in the text of /proc/net/tcp and /proc/net/tcp6."""
    ports = set()
    for line in proc_net_tcp.splitlines():
        cols = line.split()
        if len(cols) > 3 and ":" in cols[1] and cols[3] == _LISTEN:
            try:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
            except ValueError:
                continue
    return ports


def listening_on(node: Node) -> set[int]:
    """The ports something listens on at `node` (its network namespace)."""
    return listening(node.run("cat /proc/net/tcp /proc/net/tcp6 2>/dev/null", timeout=30).stdout)


def taken(spec: RunSpec, get_node, hosts: list[str] | None = None) -> list[tuple[str, int, str]]:
    """(host, port, what the run wanted it for) for each of the run's ports already listened on;
    `get_node(host)` gives a host's Node (NodePool.get); `hosts` limits the check to those hosts."""
    out = []
    for host, ports in run_ports(spec).items():
        if hosts is not None and host not in hosts:
            continue
        busy = listening_on(get_node(host))
        out += [(host, port, what) for port, what in sorted(ports.items()) if port in busy]
    return out


def refusal(found: list[tuple[str, int, str]]) -> str:
    """The one line launch refuses with."""
    host, port, what = found[0]
    more = f" (and {len(found) - 1} more: " + ", ".join(f"{h}:{p}" for h, p, _ in found[1:]) + ")" if found[1:] else ""
    return (f"port {host}:{port} is already in use (the run needs it for {what}){more}; "
            f"free it or choose other ports (run.lighthouse_port, run.base_port)")
