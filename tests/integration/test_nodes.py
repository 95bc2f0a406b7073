"""The node layer: the same operations locally and over a real loopback sshd."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dilococtl.errors import Unreachable
from dilococtl.nodes import LocalNode, NodePool, SSHNode, connect
from dilococtl.spec_types import SSHSection
from tests.sshd import sshd  # noqa: F401  (the fixture)


def _wait(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.slow)])
def node(request, tmp_path):
    if request.param == "local":
        n = LocalNode("local")
    else:
        server = request.getfixturevalue("sshd")
        n = connect(server.host, server.ssh_section(str(server.write_known_hosts(tmp_path / "kh"))))
        assert isinstance(n, SSHNode)
    yield n
    n.close()


def test_run_returns_rc_output_and_env(node):
    r = node.run("echo out; echo err >&2; exit 7")
    assert (r.rc, r.stdout, r.stderr) == (7, "out\n", "err\n")
    r = node.run('printf "%s|%s" "$A" "$B"', env={"A": "it's a b", "B": "$HOME"})
    assert (r.rc, r.stdout) == (0, "it's a b|$HOME")


def test_run_returns_all_of_a_large_output(node):
    """CI: `squeue --json` over SSH came back cut at 32768 characters (the exit status was taken for the
    end while output still waited for window space). A command that exits right after a burst; and over
    SSH one that leaves a child holding stdout open returns anyway, within nodes.EOF_WAIT_S."""
    for n in (40_000, 3_000_000):
        r = node.run(f"head -c {n} /dev/zero | tr '\\0' x; exit 3")
        assert (r.rc, len(r.stdout), set(r.stdout)) == (3, n, {"x"})
    if isinstance(node, LocalNode):  # a local pipe ends when its last writer does (subprocess waits for it)
        return
    t = time.monotonic()
    r = node.run("(sleep 30 &) ; echo done")
    assert r.stdout == "done\n" and time.monotonic() - t < 15


def test_run_timeout_gives_124_quickly(node):
    t = time.monotonic()
    r = node.run("sleep 20", timeout=1)
    assert r.rc == 124 and "timed out after 1s" in r.stderr
    assert time.monotonic() - t < 5


def test_detached_process_group_signal_and_log(node, tmp_path):
    log = tmp_path / "logs" / "job.log"
    work = tmp_path / "cwd"
    work.mkdir()
    pid = node.start_detached('echo "start $X $(pwd)"; sleep 300 & echo "child $!"; wait', str(log),
                              env={"X": "hello"}, cwd=str(work))
    assert _wait(lambda: "child" in (log.read_text() if log.exists() else ""))
    lines = log.read_text().splitlines()
    assert lines[0] == f"start hello {work}"
    child = int(lines[1].split()[1])
    # the returned pid leads its own session and process group, and the child is in that group
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert int(stat[2]) == pid and int(stat[3]) == pid  # pgrp, session
    assert os.getpgid(child) == pid
    assert node.alive(pid) and node.alive(child)
    node.signal(pid, "TERM")
    assert _wait(lambda: not node.alive(pid) and not node.alive(child))
    node.signal(pid, "TERM")  # a group that is gone: no error


def test_put_write_text_and_read_from(node, tmp_path):
    src = tmp_path / "src.bin"
    payload = os.urandom(300_000)
    src.write_bytes(payload)
    dest = tmp_path / "remote" / "a" / "b" / "copy.bin"
    node.put(src, str(dest))
    assert dest.read_bytes() == payload
    assert sorted(p.name for p in dest.parent.iterdir()) == ["copy.bin"]  # no temporary left beside it

    text_path = tmp_path / "remote" / "c" / "metrics.jsonl"
    node.write_text(str(text_path), '{"step": 1}\n{"step": 2}\n{"st')
    assert node.read_from(str(text_path), 0) == b'{"step": 1}\n{"step": 2}\n{"st'
    assert node.read_from(str(text_path), 12) == b'{"step": 2}\n{"st'
    assert node.read_from(str(text_path), 12, max_bytes=5) == b'{"ste'
    assert node.read_from(str(text_path), 10_000) == b""
    assert node.read_from(str(tmp_path / "missing.jsonl"), 0) == b""
    assert node.read_from(str(dest), 100_000, max_bytes=1 << 20) == payload[100_000:]


def test_two_nodes_writing_one_shared_file_at_once_both_succeed(node, request, tmp_path):
    # the nodes of a site may share a filesystem (NFS, or the lab's one disk), and launch writes the
    # site's config to each node in parallel: the two writes must not take each other's temporary file
    if isinstance(node, LocalNode):
        other = LocalNode("local")
    else:
        server = request.getfixturevalue("sshd")
        other = connect(server.host, server.ssh_section(str(server.write_known_hosts(tmp_path / "kh2"))))
    dest = tmp_path / "shared" / "config.toml"
    errors: list[BaseException] = []

    def write(n, text: str) -> None:
        try:
            for _ in range(40):
                n.write_text(str(dest), text)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread)
            errors.append(e)

    try:
        threads = [threading.Thread(target=write, args=(n, f"x = {i}\n" * 2000)) for i, n in enumerate((node, other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        other.close()
    assert errors == []
    assert dest.read_text() in ("x = 0\n" * 2000, "x = 1\n" * 2000)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["config.toml"]


@pytest.mark.slow
def test_detached_process_survives_closing_the_connection(sshd, tmp_path):  # noqa: F811
    ssh = sshd.ssh_section(str(sshd.write_known_hosts(tmp_path / "kh")))
    first = connect(sshd.host, ssh)
    pid = first.start_detached("sleep 300", str(tmp_path / "sleep.log"))
    first.close()
    time.sleep(0.5)  # sshd has torn the session down by now
    second = connect(sshd.host, ssh)
    try:
        assert second.alive(pid)
        second.signal(pid, "KILL")
        assert _wait(lambda: not second.alive(pid))
    finally:
        second.close()


@pytest.mark.slow
def test_pool_reuses_one_connection_per_host_and_reports_unreachable(sshd, tmp_path):  # noqa: F811
    ssh = sshd.ssh_section(str(sshd.write_known_hosts(tmp_path / "kh")))
    hosts = [*sshd.hosts, "127.0.0.4", "local"]  # .4: nothing listens there
    with NodePool(ssh) as pool:
        first = pool.map(lambda n: n.run("echo $$").stdout.strip(), hosts)
        second = pool.map(lambda n: n.run("echo ok").stdout.strip(), hosts)
        assert pool.get(sshd.hosts[0]) is pool.get(sshd.hosts[0])
    for h in (*sshd.hosts, "local"):
        assert first[h].isdigit() and second[h] == "ok"
    for res in (first["127.0.0.4"], second["127.0.0.4"]):
        assert isinstance(res, Unreachable)
        assert str(res) == f"127.0.0.4: unreachable: connection refused on port {sshd.port}"
    # one login per SSH host for both maps
    assert sshd.log.count("Accepted publickey") == len(sshd.hosts)


def test_unreachable_is_one_line():
    port = _closed_port()
    with pytest.raises(Unreachable) as e:
        connect("127.0.0.9", SSHSection(port=port, connect_timeout_s=2))
    assert str(e.value) == f"127.0.0.9: unreachable: connection refused on port {port}"
    assert e.value.exit_code == 3


def test_local_names_get_a_local_node():
    assert isinstance(connect("local", SSHSection()), LocalNode)
    assert isinstance(connect("localhost", SSHSection()), LocalNode)


def test_doctor_cli_on_an_unreachable_node_exits_3_with_one_line(tmp_path):
    port = _closed_port()
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[run]\nname = "t"\n\n[ssh]\nport = {port}\nconnect_timeout_s = 2\n\n'
                    '[[sites]]\nname = "a"\nhosts = ["127.0.0.9"]\n')
    p = subprocess.run([sys.executable, "-m", "dilococtl", "doctor", str(spec), "--json"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 3, p.stderr
    assert p.stderr.splitlines() == [f"error: 127.0.0.9: unreachable: connection refused on port {port}"]
    doc = json.loads(p.stdout)
    assert doc["exit_code"] == 3 and doc["nodes"][0]["reachable"] is False
