"""One sshd per lab node, in the node's own network, UTS and mount namespaces.

Each node gets its own hostname and a bind-mounted /etc/hosts listing every lab node: gloo and
torchft resolve a node's hostname to its lab address instead of the host's 127.0.0.1. Host keys
are generated per node and written to dilococtl's known_hosts (tagged, removed by `lab down`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from dilococtl import paths
from dilococtl.errors import DilocoError
from dilococtl.lab.model import LabNode, LabState, lab_dir
from dilococtl.lab.netns import SSHD, alive, run

CLIENT_KEY = "id_ed25519"  # the lab's one client key, under home()/lab/

# sshd runs with the node's hostname and hosts file; `exec` keeps its pid the one we started.
_START = 'hostname "$1" && mount --bind "$2" /etc/hosts && exec "$3" -D -e -f "$4"'


def node_dir(node: LabNode) -> Path:
    p = lab_dir() / "nodes" / node.name
    p.mkdir(parents=True, exist_ok=True)
    return p


def client_key() -> Path:
    """The lab's client key (created once), whose public half every node authorizes."""
    key = lab_dir() / CLIENT_KEY
    if not key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dilococtl-lab", "-f", str(key)])
    return key


def hosts_text(state: LabState) -> str:
    """/etc/hosts inside every node: localhost plus each lab node's name and address."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{n.address}\t{n.name}" for n in state.nodes]
    return "\n".join(lines) + "\n"


def sshd_config_text(listen: Sequence[str], host_key: Path, pid_file: Path, authorized_keys: Path, home: Path, *,
                     port: int | None = 22, max_startups: str = "200:30:400", max_sessions: int = 100,
                     log_level: str | None = None) -> str:
    """An sshd_config for a lab node (the defaults) or the tests' loopback sshd (tests/sshd.py):
    public-key root logins only, from `authorized_keys`, with `home` as the sessions' HOME.

    listen: the ListenAddress values (`host`, or `host:port`); port: the Port line (None: none,
    every listen value names its own port). log_level: a LogLevel line (None: sshd's default).
    """
    return "\n".join([
        # a home of its own, as a separate machine has: the host user's shell start-up files
        # (e.g. a pyenv init that rehashes under a lock on every login) stay out of the nodes
        f"SetEnv HOME={home}",
        *(f"ListenAddress {a}" for a in listen),
        *([f"Port {port}"] if port is not None else []),
        f"HostKey {host_key}",
        f"PidFile {pid_file}",
        f"AuthorizedKeysFile {authorized_keys}",
        "StrictModes no",  # keys live under DILOCOCTL_HOME, often in /tmp
        "UsePAM no",
        "PermitRootLogin yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UseDNS no",
        "PrintMotd no",
        f"MaxStartups {max_startups}",  # the control plane opens many sessions at once
        f"MaxSessions {max_sessions}",
        "Subsystem sftp internal-sftp",
        *([f"LogLevel {log_level}"] if log_level is not None else []),
        "",
    ])


def prepare(state: LabState) -> None:
    """Write every node's host key, sshd config and hosts file; authorize the client key."""
    pub = client_key().with_suffix(".pub").read_text()
    authorized = lab_dir() / "authorized_keys"
    authorized.write_text(pub)
    hosts = hosts_text(state)
    for node in state.nodes:
        d = node_dir(node)
        key = d / "ssh_host_ed25519_key"
        if not key.exists():
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", node.name, "-f", str(key)])
        (d / "hosts").write_text(hosts)
        (d / "home").mkdir(exist_ok=True)
        (d / "sshd_config").write_text(sshd_config_text([node.address], key, d / "sshd.pid", authorized, d / "home"))


def start(node: LabNode) -> int:
    """Start the node's sshd in its namespaces; returns its pid (in the root pid namespace)."""
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
    d = node_dir(node)
    log = open(d / "sshd.log", "ab")
    try:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", node.netns, "unshare", "--uts", "--mount", "--propagation", "private",
             "--", "/bin/sh", "-c", _START, "sh", node.name, str(d / "hosts"), SSHD, str(d / "sshd_config")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)
    finally:
        log.close()
    return proc.pid


def listening(address: str, timeout_s: float = 0.5) -> bool:
    """True if an SSH banner comes back from address:22 (from the root namespace)."""
    try:
        with socket.create_connection((address, 22), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def wait_listening(state: LabState, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(state.nodes)
    while pending and time.monotonic() < deadline:
        pending = [n for n in pending if not listening(n.address)]
        if pending:
            time.sleep(0.1)
    if pending:
        n = pending[0]
        why = "exited" if not alive(n.sshd_pid) else "not answering"
        tail = (node_dir(n) / "sshd.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise DilocoError(f"sshd of lab node {n.name} ({n.address}) {why} after {timeout_s:g}s {tail[0]}".strip())


# --- known_hosts ---------------------------------------------------------------------------------

def _without(lines: list[str], marker: str, addresses: set[str]) -> list[str]:
    out = []
    for line in lines:
        fields = line.split()
        if fields and not line.startswith("#") and (fields[-1] == marker or fields[0] in addresses):
            continue
        out.append(line)
    return out


def trust(state: LabState) -> None:
    """Replace any known_hosts line for the lab's addresses with its nodes' host keys."""
    path = paths.known_hosts_path()
    lines = path.read_text().splitlines() if path.exists() else []
    lines = _without(lines, state.known_hosts_marker, {n.address for n in state.nodes})
    for node in state.nodes:
        kind, blob = (node_dir(node) / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        lines.append(f"{node.address} {kind} {blob} {state.known_hosts_marker}")
    _write(path, lines)


def untrust(marker_prefix: str, markers: set[str] | None = None) -> int:
    """Remove known_hosts lines tagged `markers` (or any tag starting with `marker_prefix`)."""
    path = paths.known_hosts_path()
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    keep = [line for line in lines if not (line.split() and (
        line.split()[-1] in markers if markers is not None else line.split()[-1].startswith(marker_prefix)))]
    if len(keep) != len(lines):
        _write(path, keep)
    return len(lines) - len(keep)


def _write(path: Path, lines: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.chmod(tmp, 0o600)
    tmp.replace(path)
