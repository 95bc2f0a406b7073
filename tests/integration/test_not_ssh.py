"""A node whose port does not speak SSH: one line naming the host and the port, exit 3, no traceback
(paramiko logs one from its transport thread, which Python printed on stderr)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.2"  # loopback, but not a name dilococtl treats as this machine: it dials SSH


class Server:
    """A TCP server on loopback that answers each connection as `mode` says."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "http":
                c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                c.close()
            elif self.mode == "garbage":
                c.sendall(b"\x00\xff" * 5000)
                c.close()
            elif self.mode == "banner-then-junk":
                c.sendall(b"SSH-2.0-OpenSSH_9.2\r\n" + b"\x00\x00\x00\x0c\x0a" + b"\xff" * 3000)
                self.held.append(c)
            else:  # silent: accepts and never says a word
                self.held.append(c)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.mark.parametrize(("mode", "reason"), [
    ("http", "port {port} does not speak SSH (Error reading SSH protocol banner)"),
    ("garbage", "port {port} does not speak SSH (Error reading SSH protocol banner)"),
    ("banner-then-junk", "port {port} does not speak SSH (Expecting packet from (20,), got 255)"),
    ("silent", "no SSH server answers on port {port} (no SSH banner within 2s)"),
])
def test_a_port_that_does_not_speak_ssh_is_one_line(tmp_path, mode, reason):
    server = Server(mode)
    try:
        spec = tmp_path / "spec.toml"
        spec.write_text(f'[run]\nname = "t"\n[ssh]\nport = {server.port}\nconnect_timeout_s = 2.0\n'
                        f'[[sites]]\nname = "a"\nhosts = ["{HOST}"]\nwork_dir = "{tmp_path}"\n')
        env = {**os.environ, "DILOCOCTL_HOME": str(tmp_path / "home")}
        env.pop("DILOCOCTL_DEBUG", None)
        r = subprocess.run([sys.executable, "-m", "dilococtl", "doctor", str(spec)], capture_output=True,
                           text=True, timeout=120, cwd=REPO, env=env)
    finally:
        server.close()
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr and "Exception (client)" not in r.stderr, r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert errors == [f"error: {HOST}: unreachable: {reason.format(port=server.port)}"], r.stderr


@pytest.mark.parametrize("text", ["Error reading SSH protocol banner",
                                  "Error reading SSH protocol banner[Errno 104] Connection reset by peer"])
def test_a_banner_error_reads_the_same_however_the_socket_ended(text):
    # a server that closes on unread client bytes resets the connection, and paramiko glues the errno on
    import paramiko

    from dilococtl.nodes import _not_ssh
    from dilococtl.spec_types import SSHSection

    got = _not_ssh(paramiko.SSHException(text), SSHSection(port=2222))
    assert got == "port 2222 does not speak SSH (Error reading SSH protocol banner)"
