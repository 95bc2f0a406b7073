"""SSH host-key policy: never trust an unknown key silently, never accept a changed one.

Known keys come from the user's ~/.ssh/known_hosts, dilococtl's own known_hosts (`paths.known_hosts_path()`,
where `lab` writes its nodes' keys and where first-use trust is recorded) and the spec's `ssh.known_hosts`.
They are all loaded into paramiko's host-key table so that paramiko itself raises `BadHostKeyException`
on a mismatch; `changed_key_error` turns that into a one-line `HostKeyError`.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko
from paramiko.hostkeys import HostKeys

from dilococtl import paths
from dilococtl.errors import BadInput, HostKeyError

if TYPE_CHECKING:
    from dilococtl.spec_types import SSHSection

# OpenSSH's short names for key types, as `ssh` prints them in its prompts
_KIND = {
    "ssh-ed25519": "ED25519",
    "ssh-rsa": "RSA",
    "ecdsa-sha2-nistp256": "ECDSA",
    "ecdsa-sha2-nistp384": "ECDSA",
    "ecdsa-sha2-nistp521": "ECDSA",
    "ssh-dss": "DSA",
}
_write_lock = threading.Lock()  # several NodePool threads may trust new hosts at once


def known_hosts_files(ssh: SSHSection) -> list[Path]:
    """Every known_hosts file consulted, in order (they may not exist)."""
    files = [Path.home() / ".ssh" / "known_hosts", paths.known_hosts_path()]
    if ssh.known_hosts:
        files.append(Path(ssh.known_hosts).expanduser())
    return files


def key_name(host: str, port: int) -> str:
    """The name a host has in known_hosts: `host`, or `[host]:port` off port 22."""
    return host if port == 22 else f"[{host}]:{port}"


def describe(key: paramiko.PKey) -> str:
    """`ED25519 SHA256:...`, as OpenSSH shows a key."""
    return f"{_KIND.get(key.get_name(), key.get_name())} {key.fingerprint}"


def load_known(client: paramiko.SSHClient, ssh: SSHSection) -> None:
    """Load every existing known_hosts file into the client, so paramiko checks keys it has seen."""
    for f in known_hosts_files(ssh):
        if f.is_file():
            try:
                client.load_system_host_keys(str(f))
            except Exception as e:  # unreadable file or a line paramiko cannot parse at all
                raise BadInput(f"{f}: cannot read known_hosts: {e}") from e


def remember(name: str, key: paramiko.PKey, path: Path | None = None) -> None:
    """Add `name key` to a known_hosts file (default: dilococtl's own), atomically."""
    path = path or paths.known_hosts_path()
    line = f"{name} {key.get_name()} {key.get_base64()}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    # A lock file serialises writers across threads and processes; the rename keeps readers from
    # ever seeing a half-written file.
    with _write_lock, open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = path.read_text() if path.exists() else ""
        if line in old.splitlines(keepends=True):
            return
        if old and not old.endswith("\n"):
            old += "\n"
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".known_hosts.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(old + line)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class TrustPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for hosts with no known key: refuse, or trust on first use."""

    def __init__(self, host: str, accept_new: bool = False) -> None:
        self.host = host  # as the spec names it, for messages
        self.accept_new = accept_new

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.accept_new:
            raise HostKeyError(
                f"{self.host}: unknown SSH host key {describe(key)}; verify it and re-run with "
                "--accept-new-host-keys to trust it on first use")
        remember(hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def changed_key_error(host: str, ssh: SSHSection, exc: paramiko.BadHostKeyException) -> HostKeyError:
    """The one-line refusal for a host whose key differs from the one on record."""
    name = key_name(host, ssh.port)
    where = "known_hosts"
    for f in known_hosts_files(ssh):
        if not f.is_file():
            continue
        table = HostKeys()
        try:
            table.load(str(f))
        except Exception:
            continue
        if table.lookup(name) is not None:
            where = str(f)
    return HostKeyError(
        f"{host}: SSH host key CHANGED (now {describe(exc.key)}, expected {describe(exc.expected_key)}): "
        f"possible man-in-the-middle; if the change is expected, remove the old key from {where} "
        f"(ssh-keygen -f {where} -R '{name}')")
