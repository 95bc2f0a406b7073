"""Host keys: unknown keys are refused unless trusted on first use; changed keys are always refused."""

from __future__ import annotations

import subprocess
import sys

import paramiko
import pytest

from dilococtl import paths
from dilococtl.errors import HostKeyError
from dilococtl.hostkeys import key_name, remember
from dilococtl.nodes import connect
from tests.sshd import sshd  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def _unknown_msg(server) -> str:
    return (f"{server.host}: unknown SSH host key ED25519 {server.fingerprint()}; verify it and re-run with "
            "--accept-new-host-keys to trust it on first use")


def test_unknown_key_is_refused_by_default(sshd):  # noqa: F811
    with pytest.raises(HostKeyError) as e:
        connect(sshd.host, sshd.ssh_section())
    assert str(e.value) == _unknown_msg(sshd)
    assert e.value.exit_code == 3
    assert not paths.known_hosts_path().exists()  # nothing was trusted


def test_accept_new_trusts_and_remembers(sshd):  # noqa: F811
    ssh = sshd.ssh_section()
    node = connect(sshd.host, ssh, accept_new=True)
    assert node.run("echo hi").stdout == "hi\n"
    node.close()
    lines = paths.known_hosts_path().read_text().splitlines()
    assert lines == [f"[{sshd.host}]:{sshd.port} {sshd.host_key_pub}"]
    # remembered: the next connection needs no flag, and trusting again adds no duplicate
    node = connect(sshd.host, ssh)
    assert node.run("echo again").stdout == "again\n"
    node.close()
    connect(sshd.host, ssh, accept_new=True).close()
    assert paths.known_hosts_path().read_text().splitlines() == lines
    # the other address of the same server is a different known_hosts name: still unknown
    with pytest.raises(HostKeyError, match="unknown SSH host key"):
        connect(sshd.hosts[1], ssh)


def test_changed_key_is_refused_even_with_accept_new(sshd):  # noqa: F811
    ssh = sshd.ssh_section()
    connect(sshd.host, ssh, accept_new=True).close()
    before = paths.known_hosts_path().read_text()
    old_fp = sshd.fingerprint()
    sshd.restart(new_host_key=True)
    new_fp = sshd.fingerprint()
    assert new_fp != old_fp
    with pytest.raises(HostKeyError) as e:
        connect(sshd.host, ssh, accept_new=True)
    msg = str(e.value)
    assert msg.startswith(f"{sshd.host}: SSH host key CHANGED (now ED25519 {new_fp}, expected ED25519 {old_fp})")
    assert "possible man-in-the-middle" in msg
    assert f"remove the old key from {paths.known_hosts_path()}" in msg
    assert "\n" not in msg
    assert paths.known_hosts_path().read_text() == before  # the new key was not recorded


def test_changed_key_names_the_spec_known_hosts_file(sshd, tmp_path):  # noqa: F811
    kh = sshd.write_known_hosts(tmp_path / "cluster_known_hosts")
    ssh = sshd.ssh_section(str(kh))
    connect(sshd.host, ssh).close()  # trusted through the spec's file
    sshd.restart(new_host_key=True)
    with pytest.raises(HostKeyError, match=f"remove the old key from {kh} "):
        connect(sshd.host, ssh, accept_new=True)


def test_doctor_cli_unknown_key_exits_3_naming_fingerprint_and_flag(sshd, tmp_path):  # noqa: F811
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[run]\nname = "t"\n\n[ssh]\nport = {sshd.port}\nuser = "root"\n'
                    f'identity_file = "{sshd.identity_file}"\n\n'
                    f'[[sites]]\nname = "a"\nhosts = ["{sshd.host}"]\npython = "{sys.executable}"\n'
                    f'work_dir = "{tmp_path / "work"}"\n')
    env = {"DILOCOCTL_HOME": str(paths.home()), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "dilococtl", "doctor", str(spec), "--json"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 3
    assert p.stderr.splitlines() == [f"error: {_unknown_msg(sshd)}"]


def test_remember_uses_plain_name_on_port_22(tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    pk = paramiko.Ed25519Key.from_private_key_file(str(tmp_path / "k"))
    kh = tmp_path / "kh"
    kh.write_text("other ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBa6fUWqtq9ytq2VJYaVv2ZV9vYTXU9TtnSVvT8cLnEa")  # no newline
    remember(key_name("node1", 22), pk, kh)
    remember(key_name("node1", 2222), pk, kh)
    lines = kh.read_text().splitlines()
    assert lines[1:] == [f"node1 ssh-ed25519 {pk.get_base64()}", f"[node1]:2222 ssh-ed25519 {pk.get_base64()}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k", "k.pub", "kh", "kh.lock"]
