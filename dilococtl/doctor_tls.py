"""doctor's TLS transport check: a real mutual TLS 1.3 handshake from each site's leader to every other's.

For the TLS transport (diloco.transport "auto" or "tls"), `check_transport` runs
trainer.transport.check on the nodes: the listener takes a port the kernel picks, as the
transport's does, and each failure is named (refused, timeout, wrong CA, wrong site). The run's own
CA does not exist before `launch` (it is made per run, dilococtl.run_ca), so doctor makes a
throwaway CA of its own the same way, with one certificate per site, stages each site's identity
(CA certificate, its certificate, its key, 0600) in a fresh directory under its leader's work_dir,
and removes it all afterwards: nothing of it outlives the check, and no run's keys are made or touched.
"""

from __future__ import annotations

import json
import secrets
import shlex
import shutil
import tempfile
import threading
import time
from pathlib import Path

from dilococtl.doctor_check import FAIL, OK, WARN
from dilococtl.doctor_links import LinkCheck
from dilococtl.doctor_node import PROBE_TIMEOUT_S
from dilococtl.errors import DilocoError
from dilococtl.nodes import Node, NodePool, node_address
from dilococtl.spec_sites import is_local
from dilococtl.spec_types import RunSpec, SiteSection

TLS_DIAL_S = 5.0  # a TLS check's connect + handshake + answer must fit in this
TLS_START_S = 60.0  # the TLS listener must report its port within this (it imports the transport: torch)
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
