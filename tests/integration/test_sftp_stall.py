"""Every wait has a finite bound: an SFTP read from a node that stops answering ends as Unreachable
(paramiko's SFTP channel waits forever by default)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from dilococtl import nodes
from dilococtl.errors import Unreachable
from dilococtl.nodes import connect
from tests.sshd import sshd  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def test_an_sftp_read_from_a_frozen_node_ends_unreachable(sshd, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(nodes, "SFTP_STALL_S", 2.0)
    f = tmp_path / "metrics.jsonl"
    f.write_text("x" * 100)
    node = connect(sshd.host, sshd.ssh_section(str(sshd.write_known_hosts(tmp_path / "kh"))))
    frozen: list[int] = []
    try:
        assert node.read_from(str(f), 0) == b"x" * 100  # the SFTP session is open
        frozen = _descendants(sshd.proc.pid)  # the session's sshd processes, not the listener
        assert frozen
        for p in frozen:
            os.kill(p, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(Unreachable, match=rf"{sshd.host}: unreachable: connection lost"):
            node.read_from(str(f), 0)  # before: blocked for good
        assert time.monotonic() - t0 < 30
    finally:
        for p in frozen:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
        node.close()
