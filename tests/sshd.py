"""A real OpenSSH server on loopback, for tests of the SSH node layer.

Use it by importing the fixture into a test module: `from tests.sshd import sshd  # noqa: F401`.
It listens on 127.0.0.2 and 127.0.0.3 (two "remote" hosts: `dilococtl.spec_sites.is_local` treats
127.0.0.1 as this machine) on one free port, with a fresh ed25519 host key and client key.
Tests that use it need root (sshd logs in as root) and Debian's openssh-server.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.ports import free_port

SSHD_BIN = "/usr/sbin/sshd"
HOSTS = ("127.0.0.2", "127.0.0.3")  # loopback, but not a name is_local() maps to this machine


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dilococtl-test", "-f", str(path)],
                   check=True, capture_output=True)


@dataclass
class SSHD:
    dir: Path  # config, keys and logs live here
    port: int
    hosts: tuple[str, ...] = HOSTS
    user: str = "root"
    proc: subprocess.Popen | None = None
    _generation: int = field(default=0)

    @property
    def host(self) -> str:
        return self.hosts[0]

    @property
    def identity_file(self) -> str:
        return str(self.dir / "client_ed25519")

    @property
    def host_key(self) -> Path:
        return self.dir / f"host_ed25519.{self._generation}"

    @property
    def host_key_pub(self) -> str:
        """`ssh-ed25519 AAAA...` of the key the server presents now."""
        kind, b64 = Path(f"{self.host_key}.pub").read_text().split()[:2]
        return f"{kind} {b64}"

    @property
    def log(self) -> str:
        p = self.dir / "sshd.log"
        return p.read_text() if p.exists() else ""

    def fingerprint(self) -> str:
        """`SHA256:...` of the current host key (as ssh-keygen prints it)."""
        out = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", f"{self.host_key}.pub"],
                             check=True, capture_output=True, text=True).stdout
        return out.split()[1]

    def known_hosts_lines(self) -> str:
        """known_hosts lines trusting the current host key for every listening address."""
        return "".join(f"[{h}]:{self.port} {self.host_key_pub}\n" for h in self.hosts)

    def write_known_hosts(self, path: Path) -> Path:
        path.write_text(self.known_hosts_lines())
        return path

    def ssh_section(self, known_hosts: str = "", **kw):
        """An SSHSection for this server (no known_hosts unless given)."""
        from dilococtl.spec_types import SSHSection

        return SSHSection(user=self.user, port=self.port, identity_file=self.identity_file,
                          known_hosts=known_hosts, connect_timeout_s=5.0, keepalive_s=5.0, **kw)

    def _config(self) -> Path:
        from dilococtl.lab.sshd import sshd_config_text  # the lab nodes' config, on this server's port

        cfg = self.dir / "sshd_config"
        cfg.write_text(sshd_config_text(
            [f"{h}:{self.port}" for h in self.hosts], self.host_key, self.dir / "sshd.pid",
            self.dir / "authorized_keys", self.dir / "home", port=None, max_startups="64", max_sessions=64,
            log_level="VERBOSE"))
        (self.dir / "home").mkdir(exist_ok=True)
        return cfg

    def start(self) -> None:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "sshd.log", "ab")
        self.proc = subprocess.Popen([SSHD_BIN, "-D", "-e", "-f", str(self._config())],
                                     stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}: {self.log[-2000:]}")
            try:
                for h in self.hosts:
                    socket.create_connection((h, self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd did not listen on port {self.port}: {self.log[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def restart(self, new_host_key: bool = False) -> None:
        """Restart on the same port; with `new_host_key`, present a freshly generated host key."""
        self.stop()
        if new_host_key:
            self._generation += 1
            _keygen(self.host_key)
        self.start()


def sshd_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the test sshd logs in as root"
    if not os.path.exists(SSHD_BIN):
        return f"{SSHD_BIN} is missing (Debian: apt-get install openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen is missing (Debian: apt-get install openssh-client)"
    return None


@pytest.fixture
def sshd(tmp_path):
    """A running sshd on 127.0.0.2/127.0.0.3 (see module docstring); stopped after the test."""
    reason = sshd_skip_reason()
    if reason:
        pytest.skip(reason)
    d = tmp_path / "sshd"
    d.mkdir()
    server = SSHD(dir=d, port=free_port(1, HOSTS[0]))
    _keygen(server.host_key)
    _keygen(d / "client_ed25519")
    shutil.copyfile(d / "client_ed25519.pub", d / "authorized_keys")
    try:
        server.start()
        yield server
    finally:
        server.stop()
