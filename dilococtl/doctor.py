"""`dilococtl doctor`: can every node be reached, and does it have what the run needs.

Per node: reachable, interpreter, torch / torchft / trainer versions, CUDA and GPU count against the
spec, free disk under work_dir, clock skew against this machine; for a site of several nodes, whether
its work_dir is one filesystem on all of them; for token shards, that they are there with one
meta.json on every node and enough tokens for the planned steps (dilococtl.data_check). Between
sites: can each site's leader open TCP connections to the ports the run listens on at the other
sites (a short-lived listener on the target node, a connect from the source node); and, for the
TLS transport (diloco.transport "auto" or "tls"), a real mutual TLS 1.3 handshake from each site's
leader to every other's (`check_transport`, with trainer.transport.check on the nodes): the
listener takes a port the kernel picks, as the transport's does, and each failure is named
(refused, timeout, wrong CA, wrong site).

The run's own CA does not exist before `launch` (it is made per run, dilococtl.run_ca), so doctor
makes a throwaway CA of its own the same way, with one certificate per site, stages each site's
identity (CA certificate, its certificate, its key, 0600) in a fresh directory under its leader's
work_dir, and removes it all afterwards: nothing of it outlives the check, and no run's keys are
made or touched.

A Slurm site (scheduler = "slurm") is checked through its login node: the node checks there (its
interpreter on the cluster's shared filesystem, torch, trainer, disk under work_dir, clock), then the
Slurm checks of dilococtl.slurm.doctor (tools, partition, account, QoS, GPUs per node, time limit,
KillWait against run.grace_s) and, from every node of a short allocation like the site's, whether the
run's coordinator (Lighthouse, its relay, or the outer service) is reachable. Its GPUs are the
partition's, not the login node's. The port and TLS checks between site leaders leave it out: its
nodes are known only once its job runs.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import shlex
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dilococtl import __version__
from dilococtl.data_check import check_data
from dilococtl.doctor_check import FAIL, OK, WARN, Check
from dilococtl.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, DilocoError, Unreachable
from dilococtl.nodes import Node, NodePool, node_address, node_python
from dilococtl.spec import RunSpec, SiteSection, is_local, lighthouse_host

MIN_FREE_GIB = 1.0  # below this under work_dir: fail (checkpoints and logs will not fit)
LOW_FREE_GIB = 10.0  # below this: warn
SKEW_WARN_S = 1.0  # clock skew that makes cross-site timelines misleading
SKEW_FAIL_S = 30.0  # clock skew that breaks timeouts and certificate checks
PROBE_TIMEOUT_S = 120.0  # importing torch on a cold node can be slow
CONNECT_WINDOW_S = 5.0  # a source keeps retrying a connect this long (the listener may start late)
TLS_DIAL_S = 5.0  # a TLS check's connect + handshake + answer must fit in this
TLS_START_S = 60.0  # the TLS listener must report its port within this (it imports the transport: torch)



@dataclass(kw_only=True, slots=True)
class NodeReport:
    site: str
    host: str
    reachable: bool
    python: str = ""  # the interpreter's resolved path ("" when it could not be run)
    checks: list[Check] = field(default_factory=list)
    facts: dict = field(default_factory=dict)  # raw probe output (versions, bytes free, skew)

    @property
    def status(self) -> str:
        return _worst(c.status for c in self.checks)


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


@dataclass(kw_only=True, slots=True)
class DoctorReport:
    nodes: list[NodeReport]
    links: list[LinkCheck]
    stores: list = field(default_factory=list)  # dilococtl.doctor_store.StoreCheck: one per site and store
    bandwidth: list = field(default_factory=list)  # --links: dilococtl.tune.Link per direction between leaders

    @property
    def exit_code(self) -> int:
        if any(not n.reachable for n in self.nodes):
            return EXIT_UNREACHABLE
        if any(n.status == FAIL for n in self.nodes) or any(link.status == FAIL for link in self.links):
            return EXIT_FAILED
        if any(s.status == FAIL for s in self.stores):
            return EXIT_FAILED
        return EXIT_OK

    def to_json(self) -> dict:
        nodes = []
        for n in self.nodes:
            d = asdict(n)
            d["status"] = n.status
            nodes.append(d)
        return {"ok": self.exit_code == EXIT_OK, "exit_code": self.exit_code, "nodes": nodes,
                "links": [asdict(link) for link in self.links], "stores": [asdict(s) for s in self.stores],
                "bandwidth": [asdict(x) for x in self.bandwidth]}


def _worst(statuses) -> str:
    order = {OK: 0, WARN: 1, FAIL: 2}
    return max(statuses, key=lambda s: order[s], default=OK)


# Runs on the node with its interpreter: everything doctor needs in one process start.
_PROBE = r"""
import json, os, shutil, sys
out = {"executable": sys.executable, "python_version": "%d.%d.%d" % tuple(sys.version_info[:3])}
for mod in ("trainer", "torch", "torchft"):
    try:
        m = __import__(mod)
        out[mod] = getattr(m, "__version__", None)
        if out[mod] is None:
            from importlib.metadata import version
            out[mod] = version(mod)
        out[mod] = str(out[mod])
    except Exception as e:
        out[mod] = None
        out[mod + "_error"] = (type(e).__name__ + ": " + str(e)).splitlines()[0][:200]
if out.get("torch"):
    try:
        import torch
        out["cuda"] = bool(torch.cuda.is_available())
        out["gpus"] = torch.cuda.device_count() if out["cuda"] else 0
    except Exception as e:
        out["cuda"], out["gpus"] = False, 0
        out["cuda_error"] = str(e)[:200]
d = sys.argv[1]
while not os.path.exists(d) and d != os.path.dirname(d):
    d = os.path.dirname(d)
out["disk_path"] = d
out["disk_free"] = shutil.disk_usage(d).free
print("DOCTOR " + json.dumps(out))
"""

_LISTEN = r"""
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

_CONNECT = r"""
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


def _py(python: str, script: str, *args: object) -> str:
    return " ".join([shlex.quote(python), "-c", shlex.quote(script), *(shlex.quote(str(a)) for a in args)])


def check_node(node: Node, site: SiteSection) -> NodeReport:
    """All per-node checks on a connected node."""
    rep = NodeReport(site=site.name, host=node.host, reachable=True)
    rep.checks.append(Check(name="reachable", status=OK, detail="local" if is_local(node.host) else "ssh"))
    rep.checks.append(_clock(node, rep))
    py = node_python(site, node.host)
    r = node.run(_py(py, _PROBE, site.work_dir), timeout=PROBE_TIMEOUT_S)
    line = next((x for x in r.stdout.splitlines() if x.startswith("DOCTOR ")), None)
    if line is None:
        why = (r.stderr.strip().splitlines() or [f"exit {r.rc}"])[-1][:200]
        rep.checks.append(Check(name="python", status=FAIL, detail=f"{py}: {why}"))
        return rep
    f = json.loads(line.removeprefix("DOCTOR "))
    rep.facts.update(f)
    rep.python = f["executable"]
    rep.checks.append(Check(name="python", status=OK, detail=f"{f['executable']} {f['python_version']}",
                            short=f["python_version"]))
    for mod in ("torch", "torchft"):
        if f.get(mod):
            rep.checks.append(Check(name=mod, status=OK, detail=f[mod], short=f[mod]))
        else:
            rep.checks.append(Check(name=mod, status=FAIL, detail=f"missing ({f.get(mod + '_error')})"))
    if site.scheduler != "slurm":  # a Slurm site's GPUs are its partition's nodes': check_slurm_sites
        rep.checks.append(_gpus(f, site))
    rep.checks.append(_disk(f))
    rep.checks.append(_trainer(f))
    return rep


def _clock(node: Node, rep: NodeReport) -> Check:
    # The midpoint of the round trip estimates when the node read its clock.
    t0 = time.time()
    r = node.run("date +%s.%N", timeout=30)
    t1 = time.time()
    try:
        remote = float(r.stdout.strip())
    except ValueError:
        return Check(name="clock", status=WARN, detail=f"could not read the clock ({r.stderr.strip()[:100]})")
    skew = remote - (t0 + t1) / 2
    rep.facts["clock_skew_s"] = round(skew, 3)
    rep.facts["clock_rtt_s"] = round(t1 - t0, 3)
    status = OK if abs(skew) <= SKEW_WARN_S else WARN if abs(skew) <= SKEW_FAIL_S else FAIL
    return Check(name="clock", status=status, detail=f"skew {skew:+.3f}s (±{(t1 - t0) / 2:.3f}s)",
                 short=f"{skew:+.2f}s")


def _gpus(f: dict, site: SiteSection) -> Check:
    have, want = int(f.get("gpus") or 0), site.gpus_per_node
    if want == 0:
        return Check(name="gpus", status=OK, detail=f"CPU run ({have} GPU(s) present)", short="CPU")
    if not f.get("cuda"):
        return Check(name="gpus", status=FAIL, detail=f"CUDA not available, spec wants {want} GPU(s)")
    status = OK if have >= want else FAIL
    return Check(name="gpus", status=status, detail=f"{have} GPU(s), spec wants {want}", short=f"{have}/{want}")


def _disk(f: dict) -> Check:
    gib = f["disk_free"] / 2**30
    status = FAIL if gib < MIN_FREE_GIB else WARN if gib < LOW_FREE_GIB else OK
    return Check(name="disk", status=status, detail=f"{gib:.1f} GiB free at {f['disk_path']}", short=f"{gib:.1f} GiB")


def _trainer(f: dict) -> Check:
    v = f.get("trainer")
    if not v:
        return Check(name="trainer", status=FAIL, detail="not installed (run `dilococtl provision`)")
    if v != __version__:
        return Check(name="trainer", status=FAIL,
                     detail=f"{v}, this dilococtl is {__version__} (run `dilococtl provision`)")
    return Check(name="trainer", status=OK, detail=v, short=v)


def check_shared_dirs(spec: RunSpec, pool: NodePool, reports: dict[tuple[str, str], NodeReport]) -> None:
    """Add a `shared` check to each follower node of every multi-node site: does it see the file its
    leader writes under work_dir? Every node of a site writes its shards of the site's checkpoints
    into one directory there and a restart reads them back whole, so it must be one filesystem."""
    for s in spec.sites:
        if len(s.hosts) < 2 or not all(reports[(s.name, h)].reachable for h in s.hosts):
            continue
        leader = s.hosts[0]
        path = f"{s.work_dir.rstrip('/')}/.dilococtl/shared-check-{secrets.token_hex(8)}"
        token = secrets.token_hex(16)
        try:
            pool.get(leader).write_text(path, token + "\n")
        except DilocoError as e:  # a node that cannot write reports it; doctor goes on
            for h in s.hosts[1:]:
                reports[(s.name, h)].checks.append(Check(name="shared", status=FAIL, detail=f"not checked: {e}"))
            continue
        # without checkpoints nothing is read back across nodes: a warning only
        missing = FAIL if spec.checkpoint.every_rounds > 0 else WARN
        try:
            for h in s.hosts[1:]:
                check = Check(name="shared", status=OK, detail=f"{s.work_dir} shared with {leader}", short="yes")
                try:
                    if pool.get(h).read_from(path, 0, max_bytes=64).decode("ascii", "replace").strip() != token:
                        check = Check(name="shared", status=missing,
                                      detail=f"{s.work_dir} is not shared with {leader}: a site of several nodes "
                                             f"needs it on one filesystem (its checkpoints are written by every "
                                             f"node and read back whole)")
                except DilocoError as e:
                    check = Check(name="shared", status=missing, detail=str(e))
                reports[(s.name, h)].checks.append(check)
        finally:
            try:
                pool.get(leader).run(f"rm -f {shlex.quote(path)}", timeout=30)
            except DilocoError:  # a leftover marker is harmless
                pass


def check_run_ports(spec: RunSpec, pool: NodePool, reports: dict[tuple[str, str], NodeReport]) -> None:
    """Add a `ports` check to each node that will bind one of the run's fixed ports (dilococtl.ports): free,
    or taken by a listener that would make that process exit at start (launch refuses it the same way)."""
    from dilococtl import ports

    for host, wanted in ports.run_ports(spec).items():
        reps = [r for (_, h), r in reports.items() if h == host and r.reachable]
        if not reps:  # unreachable (already failed), or a Lighthouse host outside every site
            continue
        try:
            busy = ports.listening_on(pool.get(host))
        except DilocoError as e:
            reps[0].checks.append(Check(name="ports", status=FAIL, detail=f"not checked: {e}"))
            continue
        taken = [f"{port} ({what})" for port, what in sorted(wanted.items()) if port in busy]
        reps[0].checks.append(
            Check(name="ports", status=FAIL, detail=f"already in use: {', '.join(taken)}") if taken else
            Check(name="ports", status=OK, detail=f"{', '.join(str(p) for p in sorted(wanted))} free",
                  short="free"))


# --- between sites ------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class _Target:
    site: str  # the site the listening host belongs to ("" for a lighthouse outside the sites)
    host: str
    port: int
    purpose: str
    sources: list[tuple[str, str]]  # (site, host) that must reach it


def link_targets(spec: RunSpec) -> list[_Target]:
    """The ports the run listens on that other nodes must reach, and who must reach them.

    The Lighthouse (every site leader but its own host), and each site's rendezvous/store port
    base_port + i on its leader, which torchft's cross-site process group and the site's own
    other nodes connect to.
    """
    site_of = {h: s.name for s in spec.sites for h in s.hosts}
    leaders = [(s.name, s.hosts[0]) for s in spec.sites if s.hosts]  # Slurm sites: check_slurm_sites
    targets = []
    lh = lighthouse_host(spec)
    targets.append(_Target(site=site_of.get(lh, ""), host=lh, port=spec.run.lighthouse_port, purpose="lighthouse",
                           sources=[(s, h) for s, h in leaders if h != lh]))
    for i, s in enumerate(spec.sites):
        if not s.hosts:
            continue
        others = [(n, h) for n, h in leaders if n != s.name and h != s.hosts[0]]
        own = [(s.name, h) for h in s.hosts[1:]]
        targets.append(_Target(site=s.name, host=s.hosts[0], port=spec.run.base_port + i,
                               purpose="rendezvous/store", sources=others + own))
    return [t for t in targets if t.sources]


def check_links(spec: RunSpec, pool: NodePool, pythons: dict[str, str]) -> list[LinkCheck]:
    """TCP reachability of every target port from its sources (`pythons`: host -> working interpreter)."""
    out: list[LinkCheck] = []
    for t in link_targets(spec):
        def row(src_site: str, src_host: str, status: str, detail: str, t: _Target = t) -> LinkCheck:
            return LinkCheck(src_site=src_site, src_host=src_host, dst_site=t.site, dst_host=t.host, port=t.port,
                             purpose=t.purpose, status=status, detail=detail)

        if t.host not in pythons:
            out += [row(s, h, WARN, f"not checked: no working python on {t.host}") for s, h in t.sources]
            continue
        out += _check_target(t, pool, pythons, row)
    return out


def _check_target(t: _Target, pool: NodePool, pythons: dict[str, str], row) -> list[LinkCheck]:
    addr = node_address(t.host)
    bind = addr if addr.startswith("127.") else ""  # loopback tests stay on loopback
    window = CONNECT_WINDOW_S * (len(t.sources) + 1) + 5
    dst = pool.get(t.host)
    listened: dict[str, str] = {}

    def listen() -> None:
        r = dst.run(_py(pythons[t.host], _LISTEN, bind, t.port, len(t.sources), window), timeout=window + 30)
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
        r = src.run(_py(pythons[src_host], _CONNECT, addr, t.port, CONNECT_WINDOW_S), timeout=CONNECT_WINDOW_S + 30)
        if r.rc == 0:
            rows.append(row(src_site, src_host, OK, f"connected to {addr}:{t.port}"))
        else:
            why = (r.stdout.strip() or r.stderr.strip() or f"exit {r.rc}").splitlines()[-1].removeprefix("FAIL ")
            rows.append(row(src_site, src_host, FAIL, f"cannot connect to {addr}:{t.port}: {why}"))
            failed += 1
    # Connections that never arrived would keep the listener waiting: knock from its own host.
    for _ in range(failed):
        dst.run(_py(pythons[t.host], _CONNECT, bind or "127.0.0.1", t.port, 1), timeout=30)
    th.join(window + 60)
    result = listened.get("out", "listener did not finish")
    if result.startswith("BUSY"):
        detail = f"port {t.port} is already in use on {t.host} ({result.removeprefix('BUSY ').strip()})"
        return [row(r.src_site, r.src_host, FAIL, detail) for r in rows]
    return rows


# --- the TLS transport: a real handshake between site leaders ------------------------------------

TLS_PURPOSE = "transport (TLS)"


def uses_tls_transport(spec: RunSpec) -> bool:
    """Whether a launched run of `spec` exchanges over the TLS transport (launch gives every site an
    identity, so "auto" is TLS); async mode's exchange is the outer service's HTTPS instead."""
    return spec.diloco.transport != "gloo" and spec.diloco.mode != "async"


def _stage_identity(node: Node, site: SiteSection, ident, token: str) -> dict[str, str]:
    """The site's check identity where its leader reads it: the local files on this machine, else
    copies in a fresh directory under work_dir (key 0600, directory 0700)."""
    if is_local(node.host):
        return {"ca": str(ident.ca), "cert": str(ident.cert), "key": str(ident.key)}
    d = f"{site.work_dir.rstrip('/')}/.dilococtl/doctor-tls-{token}"
    paths = {"ca": f"{d}/ca.crt", "cert": f"{d}/{site.name}.crt", "key": f"{d}/{site.name}.key"}
    node.run(f"umask 077 && mkdir -p {shlex.quote(d)} && chmod 700 {shlex.quote(d)}", timeout=30)
    for k in ("ca", "cert", "key"):
        node.write_text(paths[k], Path(getattr(ident, k)).read_text())
    node.run(f"chmod 600 {shlex.quote(paths['key'])}", timeout=30)
    return paths


def _check_cmd(python: str, mode: str, site: str, files: dict[str, str], *args: object) -> str:
    return " ".join([shlex.quote(python), "-m", "trainer.transport.check", mode, "--site", shlex.quote(site),
                     *(f"--{k} {shlex.quote(files[k])}" for k in ("ca", "cert", "key")),
                     *(shlex.quote(str(a)) for a in args)])


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {}


def dial_tls(node: Node, python: str, site: str, files: dict[str, str], addr: str, port: int, expect: str) -> tuple[str, str]:
    """One handshake from `node` (site `site`) to the listener at addr:port, which must be site
    `expect`: (status, one-line detail naming the host, port and, on failure, the reason)."""
    r = node.run(_check_cmd(python, "dial", site, files, "--addr", f"{addr}:{port}", "--expect", expect,
                            "--timeout-s", TLS_DIAL_S), timeout=TLS_DIAL_S + PROBE_TIMEOUT_S)
    out = _last_json(r.stdout)
    if r.rc == 0 and out.get("ok"):
        return OK, f"TLS 1.3 handshake with {expect} at {addr}:{port} in {out['handshake_s'] * 1000:.0f} ms"
    why = out.get("error") or (r.stderr.strip().splitlines() or [f"exit {r.rc}"])[-1][:200]
    reason = out.get("reason", "failed")
    return FAIL, f"TLS handshake with {expect} at {addr}:{port}: {reason} ({why})"


def check_transport(spec: RunSpec, pool: NodePool, pythons: dict[str, str], *,
                    identities: dict | None = None) -> list[LinkCheck]:
    """A TLS handshake from every site's leader to every other's, under a throwaway CA (module
    docstring). `identities` (site -> run_ca.SiteIdentity) replaces that CA's, e.g. in tests."""
    from dilococtl import run_ca

    leaders = [(s, s.hosts[0]) for s in spec.sites if s.hosts]  # Slurm sites: check_slurm_sites
    if len(leaders) < 2:
        return []
    tmp = Path(tempfile.mkdtemp(prefix="dilococtl-doctor-tls-"))
    token = secrets.token_hex(8)
    staged: list[tuple[Node, str]] = []
    out: list[LinkCheck] = []
    try:
        ids = identities or run_ca.ensure(tmp / "ca", "doctor", [s.name for s, _ in leaders])
        files: dict[str, dict[str, str]] = {}
        for s, h in leaders:
            if h in pythons:
                files[s.name] = _stage_identity(pool.get(h), s, ids[s.name], token)
                if not is_local(h):
                    staged.append((pool.get(h), f"{s.work_dir.rstrip('/')}/.dilococtl/doctor-tls-{token}"))
        for dst, dh in leaders:
            srcs = [(s, h) for s, h in leaders if s.name != dst.name]

            def row(src: SiteSection, status: str, detail: str, port: int = 0, dst=dst, dh=dh) -> LinkCheck:
                return LinkCheck(src_site=src.name, src_host=src.hosts[0], dst_site=dst.name, dst_host=dh, port=port,
                                 purpose=TLS_PURPOSE, status=status, detail=detail)

            if dh not in pythons:
                out += [row(s, WARN, f"not checked: no working python on {dh}") for s, _ in srcs]
                continue
            out += _check_tls_target(pool, pythons, dst, dh, srcs, files, token, row)
    finally:
        for node, d in staged:
            try:
                node.run(f"rm -rf {shlex.quote(d)}", timeout=30)
            except DilocoError:  # a leftover throwaway identity signs nothing of a run
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_tls_target(pool: NodePool, pythons: dict[str, str], dst: SiteSection, dh: str, srcs, files, token: str,
                      row) -> list[LinkCheck]:
    """Listen on dst's leader (a kernel-picked port, as the transport) and dial it from each source."""
    node = pool.get(dh)
    addr = node_address(dh)
    bind = addr if addr.startswith("127.") else "0.0.0.0"  # loopback tests stay on loopback
    dialers = [(s, h) for s, h in srcs if h in pythons]
    wait = TLS_START_S + (TLS_DIAL_S + PROBE_TIMEOUT_S / 4) * max(1, len(dialers))
    port_file = f"{dst.work_dir.rstrip('/')}/.dilococtl/doctor-tls-{token}.port"
    stop_file = f"{dst.work_dir.rstrip('/')}/.dilococtl/doctor-tls-{token}.stop"
    node.run(f"mkdir -p {shlex.quote(port_file.rsplit('/', 1)[0])}", timeout=30)
    got: dict = {}

    def listen() -> None:
        try:
            got["r"] = node.run(_check_cmd(pythons[dh], "listen", dst.name, files[dst.name], "--port", 0, "--bind",
                                           bind, "--port-file", port_file, "--stop-file", stop_file, "--expect",
                                           ",".join(s.name for s, _ in dialers), "--wait-s", wait), timeout=wait + 30)
        except DilocoError as e:
            got["error"] = e

    th = threading.Thread(target=listen, daemon=True)
    th.start()
    port, deadline = 0, time.monotonic() + TLS_START_S
    while not port and time.monotonic() < deadline and th.is_alive():
        try:
            text = node.read_from(port_file, 0, max_bytes=32).decode("ascii", "replace").strip()
            port = int(text) if text.isdigit() else 0
        except DilocoError:
            pass
        if not port:
            time.sleep(0.2)
    try:
        node.run(f"rm -f {shlex.quote(port_file)}", timeout=30)
    except DilocoError:
        pass
    if not port:
        th.join(5)
        r = got.get("r")
        why = str(got.get("error") or (_last_json(r.stdout).get("error") if r is not None else "")
                  or (r.stderr.strip().splitlines()[-1][:200] if r is not None and r.stderr.strip() else
                      f"no port within {TLS_START_S:g} s"))
        return [row(s, FAIL, f"TLS listener on {dh} did not start: {why}") for s, _ in srcs]
    rows = []
    for s, h in srcs:
        if h not in pythons:
            rows.append(row(s, WARN, f"not checked: no working python on {h}", port))
            continue
        status, detail = dial_tls(pool.get(h), pythons[h], s.name, files[s.name], addr, port, dst.name)
        rows.append(row(s, status, detail, port))
    if any(r.status != OK for r in rows):  # someone it waits for will not come: end it now
        try:
            node.write_text(stop_file, "stop\n")
        except DilocoError:
            pass
    th.join(30)
    try:
        node.run(f"rm -f {shlex.quote(stop_file)}", timeout=30)
    except DilocoError:
        pass
    return rows


def _hosts(site: SiteSection) -> list[str]:
    """The hosts doctor checks a site on: its nodes, or a Slurm site's login node."""
    return [site.login] if site.scheduler == "slurm" else site.hosts


def _login_spec(spec: RunSpec) -> RunSpec:
    """`spec` with each Slurm site's login node as its one host (the checkpoint stores are probed there)."""
    import dataclasses

    return dataclasses.replace(spec, sites=[dataclasses.replace(s, hosts=[s.login]) if s.scheduler == "slurm" else s
                                            for s in spec.sites])


def coordinator_targets(spec: RunSpec) -> list[tuple[str, int, str]]:
    """(host, port, what) the trainers of every site dial: the Lighthouse, its relay or the outer service."""
    from dilococtl.spec import lighthouse_relayed

    what = "outer service" if spec.diloco.mode == "async" else \
        "Lighthouse relay" if lighthouse_relayed(spec) else "Lighthouse"
    return [(node_address(lighthouse_host(spec)), spec.run.lighthouse_port, what)]


def check_slurm_sites(spec: RunSpec, pool: NodePool, reports: dict[tuple[str, str], NodeReport],
                      pythons: dict[str, str]) -> None:
    """Each Slurm site's checks (dilococtl.slurm.doctor), added to its login node's report: one line per
    failing check. A login node that is unreachable is reported already. The coordinator's port gets a
    short-lived listener on its host while the compute nodes dial it (before launch nothing listens
    there; where the run's coordinator already does, the listener finds the port busy and steps aside)."""
    from dilococtl.slurm import doctor as slurm_doctor
    from dilococtl.slurm.config import slurm_site

    for s in spec.sites:
        rep = reports.get((s.name, s.login))
        if s.scheduler != "slurm" or rep is None or not rep.reachable:
            continue
        login = pool.get(s.login)
        site = slurm_site(s)
        try:
            checks = slurm_doctor.check_site(login, site, grace_s=spec.run.grace_s)
            if all(c.status != FAIL for c in checks):  # an allocation only for a site Slurm would run
                checks += _reach(spec, pool, pythons, login, site)
        except DilocoError as e:
            checks = [Check(name="slurm", status=FAIL, detail=str(e))]
        rep.checks += checks


def _reach(spec: RunSpec, pool: NodePool, pythons: dict[str, str], login: Node, site) -> list[Check]:
    """slurm.doctor.check_reach of the coordinator, with a listener on its port while the nodes dial."""
    from dilococtl.slurm import doctor as slurm_doctor

    targets = coordinator_targets(spec)
    host, port = lighthouse_host(spec), spec.run.lighthouse_port
    if host not in pythons:  # no interpreter there to listen with: only a running coordinator answers
        return slurm_doctor.check_reach(login, site, targets)
    window = slurm_doctor.REACH_ALLOC_S + slurm_doctor.REACH_CONNECT_S * site.nodes + 60
    addr = node_address(host)
    dst = pool.get(host)
    th = threading.Thread(target=lambda: dst.run(_py(pythons[host], _LISTEN, addr if addr.startswith("127.") else "",
                                                     port, site.nodes, window), timeout=window + 30), daemon=True)
    th.start()
    time.sleep(1.0)  # the listener binds before the first node dials
    try:
        return slurm_doctor.check_reach(login, site, targets)
    finally:
        for _ in range(site.nodes):  # knocks from its own host end the listener whatever came through
            th.join(0.5)
            if not th.is_alive():
                break
            try:
                dst.run(_py(pythons[host], _CONNECT, "127.0.0.1" if addr.startswith("127.") else addr, port, 1),
                        timeout=30)
            except DilocoError:
                break
        th.join(window + 60)


def _failed_node(site: SiteSection, host: str, e: Exception) -> NodeReport:
    reachable = not isinstance(e, Unreachable)
    rep = NodeReport(site=site.name, host=host, reachable=reachable)
    name = "check" if reachable else "reachable"
    rep.checks.append(Check(name=name, status=FAIL, detail=str(e) or type(e).__name__))
    rep.facts["error_type"] = type(e).__name__
    return rep


# --- entry --------------------------------------------------------------------------------------

def checking_line(spec: RunSpec) -> str:
    """doctor's first progress line: the spec's nodes, and the machines they are when fewer (two
    local nodes are two nodes on one machine, not "1 node(s)")."""
    nodes = sum(len(_hosts(s)) for s in spec.sites)
    hosts = len({h for s in spec.sites for h in _hosts(s)})
    return f"checking {nodes} node(s)" + (f" on {hosts} machine(s)" if hosts != nodes else "")


def run_doctor(spec: RunSpec, accept_new: bool = False, progress=None, bandwidth: bool = False) -> DoctorReport:
    """Check every node of `spec`, then the links between sites; `bandwidth`: also measure each
    direction between site leaders (measure_bandwidth) once every other link check passed."""
    say = progress or (lambda msg: None)
    # A local host may serve several sites: check it once per site it is in.
    sites_of: dict[str, list[SiteSection]] = {}
    for s in spec.sites:
        for h in _hosts(s):
            sites_of.setdefault(h, []).append(s)
    reports: dict[tuple[str, str], NodeReport] = {}
    with NodePool(spec.ssh, accept_new=accept_new) as pool:
        say(checking_line(spec))
        results = pool.map(lambda node: [check_node(node, s) for s in sites_of[node.host]], list(sites_of))
        for h, res in results.items():
            for i, s in enumerate(sites_of[h]):
                reports[(s.name, h)] = res[i] if isinstance(res, list) else _failed_node(s, h, res)
        check_shared_dirs(spec, pool, reports)
        check_run_ports(spec, pool, reports)
        check_data(spec, pool, reports, Check)  # shards present, one meta.json everywhere, enough tokens
        # Hosts without a working interpreter (unreachable ones included) are left out of the links.
        pythons = {h: r.python for (_, h), r in reports.items() if r.reachable and r.python}
        if any(s.scheduler == "slurm" for s in spec.sites):
            say("checking Slurm sites through their login nodes (partition, account, QoS, GPUs, time limit, "
                "the coordinator from the compute nodes)")
            check_slurm_sites(spec, pool, reports, pythons)
        links: list[LinkCheck] = []
        if link_targets(spec):
            say("checking ports between sites")
            links = check_links(spec, pool, pythons)
        if uses_tls_transport(spec) and len(spec.sites) > 1:
            say("checking the TLS transport between sites")
            links += check_transport(spec, pool, pythons)
        measured: list = []
        if bandwidth and len(spec.sites) > 1:
            if any(x.status == FAIL for x in links) or any(r.status == FAIL for r in reports.values()):
                say("bandwidth: not measured: fix the failed checks first")
            else:
                measured, failed = measure_bandwidth(spec, pool, say)
                links += failed
        from dilococtl.doctor_store import check_stores, site_probes

        stores = []
        if site_probes(spec):
            say("checking checkpoint stores from each site's first node (write, read, delete a probe object)")
            stores = check_stores(_login_spec(spec), pool, pythons)
    return DoctorReport(nodes=[reports[(s.name, h)] for s in spec.sites for h in _hosts(s)], links=links,
                        stores=stores, bandwidth=measured)


BANDWIDTH_PROBE_S = 1.0  # measured seconds per direction and stream count: enough for a 50 Mbit/s link


def measure_bandwidth(spec: RunSpec, pool: NodePool, say) -> tuple[list, list[LinkCheck]]:
    """doctor --links: every direction between the site leaders with tune-h's probe and stream sweep
    (dilococtl.tune.measure_links), for launch to derive the TLS transport from (derive_transport).
    Returns (links, a failed LinkCheck per site pair that could not be measured)."""
    from dilococtl.tune import ProbeSettings, measure_links

    if any(s.scheduler == "slurm" for s in spec.sites):
        say("bandwidth: left out: a Slurm site's nodes are known only once its job runs")
        return [], []
    say("measuring bandwidth and round trip between site leaders (a stream sweep per direction)")
    links, failed = [], []
    for i, a in enumerate(spec.sites):
        for b in spec.sites[i + 1:]:
            try:  # one pair at a time, so a failure names its pair and the others are still measured
                links += measure_links(dataclasses.replace(spec, sites=[a, b]), pool,
                                       ProbeSettings(duration_s=BANDWIDTH_PROBE_S), say)
            except DilocoError as e:
                failed.append(LinkCheck(src_site=a.name, src_host=a.hosts[0], dst_site=b.name, dst_host=b.hosts[0],
                                        port=0, purpose="bandwidth", status=FAIL, detail=str(e)))
    return links, failed
