"""Lab layout and state: pure data, parsing and address planning (no root, no subprocesses)."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dilococtl import paths
from dilococtl.errors import BadInput
from dilococtl.lab import MARKER

ROUTE_PROTO = 242  # rtnetlink protocol number tagging the lab's root-namespace routes
UNREACHABLE_METRIC = 4242  # the fallback route loses to the live route through the core
MAX_SITES = 200  # site i uses 10.B.(i+1).0/24; 255 is the management link
MAX_NODES_PER_SITE = 200  # node j of a site is .(10 + j)
MIN_TCP_BUFFER = 16 * 1024  # smaller socket buffers would stall TCP, not emulate a WAN host

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_TIME_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


@dataclass(kw_only=True, slots=True)
class LinkShape:
    rate_bit: int  # tbf rate of this direction, bits per second
    delay_ms: float  # one-way delay the delayer holds packets of this direction (RTT/2)


@dataclass(kw_only=True, slots=True)
class LinkSpec:
    """One `--link` / `lab shape` argument: A-B (both directions) or A>B (one direction)."""

    src: str  # site name or index as typed
    dst: str  # site name or index as typed
    both: bool  # A-B: also B->A
    rate_bit: int  # bits per second
    rtt_ms: float | None  # None: keep the delay the link has


@dataclass(kw_only=True, slots=True)
class LabSite:
    name: str  # site name, as in the run spec's [[sites]]
    index: int  # position; selects the /24
    subnet: str  # the site's LAN, 10.B.(index+1).0/24
    gateway: str  # the core's address on that LAN
    bridge: str  # the LAN's bridge in the core namespace


@dataclass(kw_only=True, slots=True)
class LabNode:
    name: str  # hostname inside the node, and the name `lab kill` takes
    site: str  # its site's name
    site_index: int  # its site's index
    index: int  # position inside the site
    address: str  # eth0 address; sshd listens here
    netns: str  # network namespace name
    sshd_pid: int = 0  # sshd's pid in the root pid namespace (0: not started)


@dataclass(kw_only=True, slots=True)
class LabState:
    id: str  # short hex id; every name of this lab contains dlab + id
    block: str  # the lab's /16 (unreachable from the root namespace except through the core)
    core_ns: str  # namespace holding the site bridges, routing, shaping and the delayer
    host_if: str  # root-namespace end of the management veth
    host_addr: str  # root namespace's address on it
    core_addr: str  # the core's address on it
    sites: list[LabSite]
    nodes: list[LabNode]
    links: dict[str, LinkShape]  # "src>dst" for every ordered pair of distinct sites
    cut: list[str] = field(default_factory=list)  # sites currently cut off from the others
    python: str = ""  # interpreter the nodes run (the host's: nodes share its filesystem)
    delayer_pid: int = 0  # the delayer daemon's pid (0: not started)
    tcp_buffer: int = 0  # largest TCP socket buffer on the nodes, bytes (tcp_rmem/tcp_wmem max); 0: kernel's
    status: str = "starting"  # starting | up
    cpus_per_node: float = 0.0  # each node's processes share at most this many cores (dilococtl.lab.cpu; 0: uncapped)
    created: float = 0.0  # unix time of `lab up`

    def site(self, name_or_index: str) -> LabSite:
        """The site called `name_or_index`, or with that index; BadInput otherwise."""
        for s in self.sites:
            if s.name == name_or_index or str(s.index) == name_or_index:
                return s
        raise BadInput(f"no lab site {name_or_index!r} (sites: {', '.join(s.name for s in self.sites)})")

    def nodes_of(self, site: str) -> list[LabNode]:
        return [n for n in self.nodes if n.site == site]

    def targets(self, name: str) -> list[LabNode]:
        """A node by name, or every node of a site."""
        for n in self.nodes:
            if n.name == name:
                return [n]
        try:
            return self.nodes_of(self.site(name).name)
        except BadInput:
            raise BadInput(f"no lab node or site {name!r} (nodes: {', '.join(n.name for n in self.nodes)})") from None

    @property
    def known_hosts_marker(self) -> str:
        return f"dilococtl-lab-{self.id}"


def link_key(src: str, dst: str) -> str:
    return f"{src}>{dst}"


def parse_rate(text: str) -> int:
    """'50mbit' -> 50_000_000 bit/s (tc's decimal units; 'mbps' would be bytes, so refused)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise BadInput(f"bad rate {text!r}: use a number and bit, kbit, mbit or gbit (e.g. 50mbit)")
    bits = int(round(float(m.group(1)) * _RATE_UNITS[m.group(2)]))
    if bits < 8000:
        raise BadInput(f"bad rate {text!r}: must be at least 8kbit")
    return bits


def parse_duration_ms(text: str) -> float:
    """'80ms' -> 80.0, '0.1s' -> 100.0, '500us' -> 0.5."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _TIME_UNITS:
        raise BadInput(f"bad duration {text!r}: use a number and us, ms or s (e.g. 80ms)")
    ms = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if ms > 10_000:
        raise BadInput(f"bad duration {text!r}: at most 10s")
    return ms


def parse_size(text: str) -> int:
    """'128k' -> 131072, '4m' -> 4194304, '65536' -> 65536 (binary units, as sysctl buffers are)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)i?b?\s*", text.lower())
    if not m:
        raise BadInput(f"bad size {text!r}: use a number of bytes, optionally with k, m or g (e.g. 128k)")
    n = int(m.group(1)) * 1024 ** " kmg".index(m.group(2) or " ")
    if n < MIN_TCP_BUFFER:
        raise BadInput(f"bad size {text!r}: at least {MIN_TCP_BUFFER // 1024}k")
    return n


def format_rate(bits: int) -> str:
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= mult:
            return f"{bits / mult:g}{unit}"
    return f"{bits}bit"


def parse_link(text: str) -> LinkSpec:
    """'A-B=RATE[/RTT]' (both directions) or 'A>B=RATE[/RTT]' (A to B only)."""
    m = re.fullmatch(r"\s*([A-Za-z0-9_.]+)\s*([->])\s*([A-Za-z0-9_.]+)\s*=\s*([^/\s]+)\s*(?:/\s*(\S+))?\s*", text)
    if not m:
        raise BadInput(f"bad link {text!r}: use A-B=RATE[/RTT] or A>B=RATE[/RTT] (e.g. site0-site1=50mbit/80ms)")
    src, sep, dst, rate, rtt = m.groups()
    if src == dst:
        raise BadInput(f"bad link {text!r}: a link joins two different sites")
    return LinkSpec(src=src, dst=dst, both=sep == "-", rate_bit=parse_rate(rate),
                    rtt_ms=None if rtt is None else parse_duration_ms(rtt))


def apply_link(state: LabState, spec: LinkSpec) -> list[str]:
    """Set `spec` on `state.links`; returns the keys ("src>dst") it changed."""
    a, b = state.site(spec.src).name, state.site(spec.dst).name
    keys = [link_key(a, b)] + ([link_key(b, a)] if spec.both else [])
    for key in keys:
        old = state.links[key]
        delay = old.delay_ms if spec.rtt_ms is None else spec.rtt_ms / 2
        state.links[key] = LinkShape(rate_bit=spec.rate_bit, delay_ms=delay)
    return keys


def _route_networks(routes: list[dict[str, Any]]) -> list[ipaddress.IPv4Network]:
    nets = []
    for r in routes:
        dst = r.get("dst", "")
        if dst in ("", "default") or ":" in dst:
            continue
        try:
            nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
        except ValueError:
            continue
    return nets


def choose_block(routes: list[dict[str, Any]], addresses: list[str]) -> str:
    """The first candidate /16 that overlaps no route (of any table) and no local address.

    `routes` is `ip -j route show table all` output, `addresses` are "a.b.c.d/len" strings. A live
    lab's unreachable /16 is a route too, so two labs never share a block.
    """
    taken = _route_networks(routes)
    for a in addresses:
        try:
            taken.append(ipaddress.ip_interface(a).network)
        except ValueError:
            continue
    candidates = [f"10.{n}.0.0/16" for n in range(210, 255)] + [f"10.{n}.0.0/16" for n in range(100, 210)] \
        + [f"172.{n}.0.0/16" for n in range(16, 32)]
    for c in candidates:
        net = ipaddress.ip_network(c)
        if not any(net.overlaps(t) for t in taken):
            return c
    raise BadInput("no free private /16 for the lab: every candidate overlaps an existing route")


def plan(*, lab_id: str, block: str, sites: int, nodes_per_site: int, rate_bit: int, rtt_ms: float,
         links: list[LinkSpec], python: str, created: float = 0.0) -> LabState:
    """Names, addresses and link shapes of a new lab (nothing is created)."""
    if not 1 <= sites <= MAX_SITES:
        raise BadInput(f"--sites: must be in [1, {MAX_SITES}], got {sites}")
    if not 1 <= nodes_per_site <= MAX_NODES_PER_SITE:
        raise BadInput(f"--nodes-per-site: must be in [1, {MAX_NODES_PER_SITE}], got {nodes_per_site}")
    if not re.fullmatch(r"[0-9a-f]{4}", lab_id):
        raise BadInput(f"lab id must be 4 hex digits, got {lab_id!r}")
    net = ipaddress.ip_network(block)
    if net.prefixlen != 16:
        raise BadInput(f"lab block must be a /16, got {block}")
    base = int(net.network_address)

    def addr(third: int, fourth: int) -> str:
        return str(ipaddress.IPv4Address(base + third * 256 + fourth))

    site_list = [LabSite(name=f"site{i}", index=i, subnet=f"{addr(i + 1, 0)}/24", gateway=addr(i + 1, 1),
                         bridge=f"br{i}") for i in range(sites)]
    nodes = []
    for s in site_list:
        for j in range(nodes_per_site):
            name = f"{s.name}-n{j}"
            nodes.append(LabNode(name=name, site=s.name, site_index=s.index, index=j,
                                 address=addr(s.index + 1, 10 + j), netns=f"{MARKER}-{lab_id}-{name}"))
    shapes = {link_key(a.name, b.name): LinkShape(rate_bit=rate_bit, delay_ms=rtt_ms / 2)
              for a in site_list for b in site_list if a is not b}
    state = LabState(id=lab_id, block=block, core_ns=f"{MARKER}-{lab_id}-core", host_if=f"{MARKER}{lab_id}",
                     host_addr=addr(255, 1), core_addr=addr(255, 2), sites=site_list, nodes=nodes,
                     links=shapes, python=python, created=created)
    for spec in links:
        if spec.rtt_ms is None:
            spec = dataclasses.replace(spec, rtt_ms=rtt_ms)
        apply_link(state, spec)
    return state


def queue_num(src_index: int, dst_index: int) -> int:
    """NFQUEUE number of the ordered site pair (u16: fits for MAX_SITES)."""
    return src_index * 256 + dst_index


def delayer_config(state: LabState) -> dict[str, float]:
    """Queue number (as text) -> one-way delay in ms, as the delayer daemon reads it."""
    idx = {s.name: s.index for s in state.sites}
    out = {}
    for key, shape in state.links.items():
        src, dst = key.split(">")
        out[str(queue_num(idx[src], idx[dst]))] = shape.delay_ms
    return out


# --- persistence ---------------------------------------------------------------------------------

def lab_dir() -> Path:
    """home()/lab: state, keys, per-node sshd files, delayer files."""
    p = paths.home() / "lab"
    p.mkdir(parents=True, exist_ok=True)
    return p


def state_path() -> Path:
    return lab_dir() / "state.json"


def to_json(state: LabState) -> str:
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True)


def from_json(text: str) -> LabState:
    d = json.loads(text)
    d["sites"] = [LabSite(**s) for s in d["sites"]]
    d["nodes"] = [LabNode(**n) for n in d["nodes"]]
    d["links"] = {k: LinkShape(**v) for k, v in d["links"].items()}
    return LabState(**d)


def save(state: LabState) -> None:
    p = state_path()
    tmp = p.with_suffix(".tmp")
    tmp.write_text(to_json(state) + "\n")
    tmp.replace(p)


def load() -> LabState | None:
    """This home's lab, or None when there is no state file."""
    p = paths.home() / "lab" / "state.json"
    if not p.exists():
        return None
    try:
        return from_json(p.read_text())
    except (ValueError, KeyError, TypeError) as e:
        raise BadInput(f"{p}: unreadable lab state ({e}); `dilococtl lab down` removes leftovers") from None


def require() -> LabState:
    state = load()
    if state is None:
        raise BadInput("no lab is up in this DILOCOCTL_HOME (run `dilococtl lab up` first)")
    return state
