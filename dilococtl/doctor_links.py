"""doctor's port checks between sites: can each site's leader open TCP connections to the ports the run listens on.

`link_targets` lists the ports the run listens on that other nodes must reach (the Lighthouse, each
site's rendezvous/store port) and who must reach them; `check_links` opens a short-lived listener
on each target node and connects from each source node. A LinkCheck is one source -> target row,
the TLS handshakes (dilococtl.doctor_tls) and bandwidth failures included.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from dilococtl.doctor_check import FAIL, OK, WARN
from dilococtl.doctor_node import py_command
from dilococtl.nodes import NodePool, node_address
from dilococtl.spec_sites import lighthouse_host
from dilococtl.spec_types import RunSpec

CONNECT_WINDOW_S = 5.0  # a source keeps retrying a connect this long (the listener may start late)


@dataclass(kw_only=True, slots=True)
class LinkCheck:
    src_site: str
    src_host: str
    dst_site: str
    dst_host: str
    port: int
    purpose: str  # lighthouse | rendezvous/store | transport (TLS)
    status: str  # ok | warn | fail
    detail: str


# Run on the nodes with their interpreters (py_command): a listener that counts connections, and a
# connect that retries for a window (the listener may start late).
LISTEN_SCRIPT = r"""
import socket, sys, time
host, port, n, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind((host, port))
except OSError as e:
    print("BUSY", e.strerror)
    sys.exit(3)
s.listen(64)
got, end = 0, time.time() + t
while got < n and time.time() < end:
    s.settimeout(max(0.05, end - time.time()))
    try:
        c, _ = s.accept()
        c.close()
        got += 1
    except OSError:
        break
print("ACCEPTED", got)
"""

CONNECT_SCRIPT = r"""
import socket, sys, time
host, port, t = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end, err = time.time() + t, "timed out"
while time.time() < end:
    try:
        socket.create_connection((host, port), timeout=max(0.2, end - time.time())).close()
        print("OK")
        sys.exit(0)
    except OSError as e:
        err = e.strerror or str(e)
        time.sleep(0.2)
print("FAIL", err)
sys.exit(1)
"""


@dataclass(kw_only=True, slots=True)
class LinkTarget:
    site: str  # the site the listening host belongs to ("" for a lighthouse outside the sites)
    host: str
    port: int
    purpose: str
    sources: list[tuple[str, str]]  # (site, host) that must reach it


def link_targets(spec: RunSpec) -> list[LinkTarget]:
    """The ports the run listens on that other nodes must reach, and who must reach them.

    The Lighthouse (every site leader but its own host), and each site's rendezvous/store port
    base_port + i on its leader, which torchft's cross-site process group and the site's own
    other nodes connect to.
    """
    site_of = {h: s.name for s in spec.sites for h in s.hosts}
    leaders = [(s.name, s.hosts[0]) for s in spec.sites if s.hosts]  # Slurm sites: check_slurm_sites
    targets = []
    lh = lighthouse_host(spec)
    targets.append(LinkTarget(site=site_of.get(lh, ""), host=lh, port=spec.run.lighthouse_port, purpose="lighthouse",
                              sources=[(s, h) for s, h in leaders if h != lh]))
    for i, s in enumerate(spec.sites):
        if not s.hosts:
            continue
        others = [(n, h) for n, h in leaders if n != s.name and h != s.hosts[0]]
        own = [(s.name, h) for h in s.hosts[1:]]
        targets.append(LinkTarget(site=s.name, host=s.hosts[0], port=spec.run.base_port + i,
                                  purpose="rendezvous/store", sources=others + own))
    return [t for t in targets if t.sources]


def check_links(spec: RunSpec, pool: NodePool, pythons: dict[str, str]) -> list[LinkCheck]:
    """TCP reachability of every target port from its sources (`pythons`: host -> working interpreter)."""
    out: list[LinkCheck] = []
    for t in link_targets(spec):
        def row(src_site: str, src_host: str, status: str, detail: str, t: LinkTarget = t) -> LinkCheck:
            return LinkCheck(src_site=src_site, src_host=src_host, dst_site=t.site, dst_host=t.host, port=t.port,
                             purpose=t.purpose, status=status, detail=detail)

        if t.host not in pythons:
            out += [row(s, h, WARN, f"not checked: no working python on {t.host}") for s, h in t.sources]
            continue
        out += _check_target(t, pool, pythons, row)
    return out


def _check_target(t: LinkTarget, pool: NodePool, pythons: dict[str, str], row) -> list[LinkCheck]:
    addr = node_address(t.host)
    bind = addr if addr.startswith("127.") else ""  # loopback tests stay on loopback
    window = CONNECT_WINDOW_S * (len(t.sources) + 1) + 5
    dst = pool.get(t.host)
    listened: dict[str, str] = {}

    def listen() -> None:
        r = dst.run(py_command(pythons[t.host], LISTEN_SCRIPT, bind, t.port, len(t.sources), window),
                    timeout=window + 30)
        listened["out"] = (r.stdout.strip() or r.stderr.strip() or f"exit {r.rc}").splitlines()[-1]

    th = threading.Thread(target=listen, daemon=True)
    th.start()
    rows, failed = [], 0
    for src_site, src_host in t.sources:
        if src_host not in pythons:
            rows.append(row(src_site, src_host, WARN, f"not checked: no working python on {src_host}"))
            failed += 1
            continue
        src = pool.get(src_host)
        r = src.run(py_command(pythons[src_host], CONNECT_SCRIPT, addr, t.port, CONNECT_WINDOW_S),
                    timeout=CONNECT_WINDOW_S + 30)
        if r.rc == 0:
            rows.append(row(src_site, src_host, OK, f"connected to {addr}:{t.port}"))
        else:
            why = (r.stdout.strip() or r.stderr.strip() or f"exit {r.rc}").splitlines()[-1].removeprefix("FAIL ")
            rows.append(row(src_site, src_host, FAIL, f"cannot connect to {addr}:{t.port}: {why}"))
            failed += 1
    # Connections that never arrived would keep the listener waiting: knock from its own host.
    for _ in range(failed):
        dst.run(py_command(pythons[t.host], CONNECT_SCRIPT, bind or "127.0.0.1", t.port, 1), timeout=30)
    th.join(window + 60)
    result = listened.get("out", "listener did not finish")
    if result.startswith("BUSY"):
        detail = f"port {t.port} is already in use on {t.host} ({result.removeprefix('BUSY ').strip()})"
        return [row(r.src_site, r.src_host, FAIL, detail) for r in rows]
    return rows
