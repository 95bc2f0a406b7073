"""`doctor` and `provision` against a local site and a real loopback sshd."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

import dilococtl
from dilococtl.doctor import run_doctor
from dilococtl.doctor_tls import TLS_PURPOSE
from dilococtl.nodes import SSHNode, node_python
from dilococtl.provision import build_wheel, run_provision, source_hash
from dilococtl.spec_types import RunSection, RunSpec, SiteSection
from tests.ports import PORT_BLOCK, free_port
from tests.sshd import sshd  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
REPO = Path(dilococtl.__file__).resolve().parent.parent


def _spec(server, tmp_path: Path, sites: list[SiteSection]) -> RunSpec:
    base = free_port(PORT_BLOCK + 1)
    lh = base + PORT_BLOCK  # past the ports the run takes from base_port
    ssh = server.ssh_section(str(server.write_known_hosts(tmp_path / "kh")))
    return RunSpec(path=str(tmp_path / "spec.toml"), run=RunSection(name="t", lighthouse_port=lh, base_port=base),
                   ssh=ssh, sites=sites)


def _spec_toml(server, tmp_path: Path, run: str, sites: str) -> Path:
    """A spec file: [run] with the `run` lines, [ssh] for `server` (its host key trusted), `sites`."""
    kh = server.write_known_hosts(tmp_path / "kh")
    path = tmp_path / "spec.toml"
    path.write_text(f'[run]\nname = "t"\n{run}\n[ssh]\nport = {server.port}\nuser = "root"\n'
                    f'identity_file = "{server.identity_file}"\nknown_hosts = "{kh}"\n\n{sites}')
    return path


def _snapshot_source(dest: Path) -> Path:
    """A frozen copy of the package sources (the shared checkout changes under our feet)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in ("dilococtl", "trainer"):
        shutil.copytree(REPO / pkg, dest / pkg, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        if (REPO / f).exists():
            shutil.copy2(REPO / f, dest / f)
    return dest


def test_node_python_resolution():
    site = SiteSection(name="a", hosts=["n1"])
    assert node_python(site, "n1") == "python3"
    assert node_python(site, "local") == sys.executable
    site.python = "/opt/py/bin/python3"
    assert node_python(site, "n1") == "/opt/py/bin/python3"
    site.venv = "/opt/venv/"
    assert node_python(site, "n1") == "/opt/venv/bin/python"


def test_doctor_local_and_ssh_site(sshd, tmp_path):  # noqa: F811
    spec = _spec(sshd, tmp_path, [
        SiteSection(name="a", hosts=["local"], work_dir=str(tmp_path / "wa")),
        SiteSection(name="b", hosts=[sshd.host], python=sys.executable, work_dir=str(tmp_path / "wb" / "deep")),
    ])
    rep = run_doctor(spec)
    doc = rep.to_json()
    assert rep.exit_code == 0, json.dumps(doc, indent=1)
    assert [(n["site"], n["host"], n["status"]) for n in doc["nodes"]] == [("a", "local", "ok"), ("b", sshd.host, "ok")]
    free = shutil.disk_usage(tmp_path).free
    for n in rep.nodes:
        checks = {c.name: c for c in n.checks}
        # and each site's leader holds one of the run's fixed ports (its rendezvous; a's the Lighthouse's too)
        assert set(checks) == {"reachable", "clock", "python", "torch", "torchft", "gpus", "disk", "trainer", "ports"}
        assert checks["ports"].status == "ok" and checks["ports"].detail.endswith(" free")
        assert Path(n.python).resolve() == Path(sys.executable).resolve()
        assert n.facts["torch"] == version("torch")
        assert n.facts["torchft"] == version("torchft")
        assert n.facts["trainer"] == dilococtl.__version__
        assert n.facts["gpus"] == 0 and checks["gpus"].detail.startswith("CPU run")
        assert n.facts["disk_path"] == str(tmp_path)  # work_dir does not exist yet: its nearest parent
        assert abs(n.facts["disk_free"] - free) < 0.05 * free
        assert abs(n.facts["clock_skew_s"]) < 1.0
    assert checks["reachable"].detail == "ssh"
    links = {(x.purpose, x.src_host, x.dst_host, x.port): x.status for x in rep.links if x.purpose != TLS_PURPOSE}
    assert links == {
        ("lighthouse", sshd.host, "local", spec.run.lighthouse_port): "ok",
        ("rendezvous/store", sshd.host, "local", spec.run.base_port): "ok",
        ("rendezvous/store", "local", sshd.host, spec.run.base_port + 1): "ok",
    }
    # the TLS transport (the default): a real handshake each way, on a port the kernel picked
    tls = {(x.src_site, x.dst_site): x for x in rep.links if x.purpose == TLS_PURPOSE}
    assert set(tls) == {("a", "b"), ("b", "a")} and all(x.status == "ok" and x.port > 0 for x in tls.values())
    assert not list((tmp_path / "wb").rglob("doctor-tls-*"))  # the staged identity is removed


def test_doctor_fails_on_missing_gpus_and_a_busy_port(sshd, tmp_path):  # noqa: F811
    spec = _spec(sshd, tmp_path, [
        SiteSection(name="a", hosts=["local"], work_dir=str(tmp_path)),
        SiteSection(name="b", hosts=[sshd.host], python=sys.executable, gpus_per_node=2, work_dir=str(tmp_path)),
    ])
    busy = socket.socket()
    busy.bind((sshd.host, spec.run.base_port + 1))  # something else holds site b's port
    busy.listen(8)
    try:
        rep = run_doctor(spec)
    finally:
        busy.close()
    assert rep.exit_code == 1
    b = {c.name: c for c in rep.nodes[1].checks}
    assert b["gpus"].status == "fail" and b["gpus"].detail == "CUDA not available, spec wants 2 GPU(s)"
    bad = [x for x in rep.links if x.status != "ok"]
    assert [(x.dst_host, x.port, x.status) for x in bad] == [(sshd.host, spec.run.base_port + 1, "fail")]
    assert bad[0].detail.startswith(f"port {spec.run.base_port + 1} is already in use on {sshd.host}")


def test_doctor_checks_that_a_site_of_two_nodes_shares_its_work_dir(sshd, tmp_path, monkeypatch):  # noqa: F811
    h0, h1 = sshd.hosts
    wd = tmp_path / "w"
    spec = _spec(sshd, tmp_path, [SiteSection(name="a", hosts=[h0, h1], python=sys.executable, work_dir=str(wd))])
    rep = run_doctor(spec)
    assert rep.exit_code == 0, json.dumps(rep.to_json(), indent=1)
    leader, follower = ({c.name: c for c in n.checks} for n in rep.nodes)
    assert "shared" not in leader
    assert (follower["shared"].status, follower["shared"].detail) == ("ok", f"{wd} shared with {h0}")
    assert list((wd / ".dilococtl").iterdir()) == []  # the marker is gone again

    # the follower with a disk of its own: what it reads comes from another root
    read_from = SSHNode.read_from
    monkeypatch.setattr(SSHNode, "read_from", lambda self, path, *a, **kw: read_from(
        self, str(tmp_path / "own-disk") + path if self.host == h1 else path, *a, **kw))
    rep = run_doctor(spec)
    assert rep.exit_code == 1
    shared = {c.name: c for c in rep.nodes[1].checks}["shared"]
    assert shared.status == "fail"
    assert shared.detail == (f"{wd} is not shared with {h0}: a site of several nodes needs it on one filesystem "
                             f"(its checkpoints are written by every node and read back whole)")
    spec.checkpoint.every_rounds = 0  # no checkpoints: nothing is read back across nodes
    rep = run_doctor(spec)
    assert rep.exit_code == 0 and {c.name: c for c in rep.nodes[1].checks}["shared"].status == "warn"


def test_doctor_cli_table_gives_the_gist_and_a_line_per_problem(sshd, tmp_path):  # noqa: F811
    h0, h1 = sshd.hosts
    spec = _spec_toml(sshd, tmp_path, "", f'[[sites]]\nname = "s0"\nhosts = ["{h0}", "{h1}"]\n'
                      f'python = "{sys.executable}"\nwork_dir = "{tmp_path / "w"}"\ngpus_per_node = 1\n')
    p = subprocess.run([sys.executable, "-m", "dilococtl", "doctor", str(spec)], capture_output=True, text=True,
                       timeout=180, cwd=tmp_path, env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 1, p.stdout + p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("│ s0 ")]  # the nodes table
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in rows]
    py = ".".join(map(str, sys.version_info[:3]))
    same = ["s0", "fail", py, version("torch"), version("torchft"), "fail"]  # ... gpus; then disk, clock
    # trainer, shared, and the run's fixed ports on the leader (its rendezvous; the Lighthouse's too)
    assert [c[:1] + c[2:7] + c[9:] for c in cells] == [same + [dilococtl.__version__, "", "free"],
                                                       same + [dilococtl.__version__, "yes", ""]]
    assert [c[1] for c in cells] == [h0, h1]
    assert all(c[7].endswith(" GiB") and c[8].endswith("s") for c in cells)
    assert [line for line in p.stdout.splitlines() if line.startswith("fail:")] == [
        f"fail: s0/{h} gpus: CUDA not available, spec wants 1 GPU(s)" for h in (h0, h1)]


def test_doctor_cli_json_two_ssh_sites(sshd, tmp_path):  # noqa: F811
    base = free_port(PORT_BLOCK + 1)
    lh = base + PORT_BLOCK  # past the ports the run takes from base_port
    spec = _spec_toml(sshd, tmp_path, f"lighthouse_port = {lh}\nbase_port = {base}\n", "".join(
        f'[[sites]]\nname = "s{i}"\nhosts = ["{h}"]\npython = "{sys.executable}"\n'
        f'work_dir = "{tmp_path / f"w{i}"}"\n\n' for i, h in enumerate(sshd.hosts)))
    p = subprocess.run([sys.executable, "-m", "dilococtl", "doctor", str(spec), "--json"],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is True
    assert [(n["host"], n["status"]) for n in doc["nodes"]] == [(h, "ok") for h in sshd.hosts]
    got = sorted((x["purpose"], x["src_host"], x["dst_host"], x["port"], x["status"]) for x in doc["links"]
                 if x["purpose"] != TLS_PURPOSE)
    h0, h1 = sshd.hosts
    assert got == sorted([("lighthouse", h1, h0, lh, "ok"), ("rendezvous/store", h1, h0, base, "ok"),
                          ("rendezvous/store", h0, h1, base + 1, "ok")])
    # both sites over SSH: each one's identity staged on its node, a handshake each way
    tls = sorted((x["src_host"], x["dst_host"], x["status"]) for x in doc["links"] if x["purpose"] == TLS_PURPOSE)
    assert tls == sorted([(h0, h1, "ok"), (h1, h0, "ok")])


def test_build_wheel_is_cached_by_source_hash(tmp_path):
    src = _snapshot_source(tmp_path / "src")
    cache = tmp_path / "cache"
    wheel, digest = build_wheel(cache, root=src)
    assert digest == source_hash(src) and wheel.parent == cache / digest
    mtime = wheel.stat().st_mtime_ns
    assert build_wheel(cache, root=src) == (wheel, digest)
    assert wheel.stat().st_mtime_ns == mtime  # reused, not rebuilt
    with zipfile.ZipFile(wheel) as z:
        assert "trainer/__init__.py" in z.namelist() and "dilococtl/nodes.py" in z.namelist()
    (src / "trainer" / "__init__.py").write_text((src / "trainer" / "__init__.py").read_text() + "\nMARK = 1\n")
    wheel2, digest2 = build_wheel(cache, root=src)
    assert digest2 != digest
    with zipfile.ZipFile(wheel2) as z:
        assert "MARK = 1" in z.read("trainer/__init__.py").decode()


def test_provision_twice_second_is_up_to_date(sshd, tmp_path):  # noqa: F811
    src = _snapshot_source(tmp_path / "src")
    venv = tmp_path / "venv"
    # site b's two nodes share one filesystem (as on NFS): its first node installs, the second finds
    # that install and only verifies it (two pip runs into one venv at once would break it)
    spec = _spec(sshd, tmp_path, [
        SiteSection(name="b", hosts=list(sshd.hosts), python=sys.executable, venv=str(venv),
                    work_dir=str(tmp_path / "wb")),
        SiteSection(name="c", hosts=[sshd.hosts[1]], python="/nonexistent/bin/python3",
                    work_dir=str(tmp_path / "wc")),
    ])
    first = run_provision(spec, source=src)
    b, b2, c = first.nodes
    assert (b.status, b2.status, c.status) == ("installed", "up to date", "failed"), first.to_json()
    assert first.exit_code == 1
    assert c.detail == "interpreter /nonexistent/bin/python3 not found"
    assert "$ command -v /nonexistent/bin/python3" in c.log_tail  # the tail of that node's log
    # installed into the venv (run outside the checkout so the venv's copy is the one imported)
    vpy = venv / "bin" / "python"
    out = subprocess.run([str(vpy), "-c", "import trainer, dilococtl; print(trainer.__file__)"],
                         capture_output=True, text=True, cwd=tmp_path, check=True).stdout.strip()
    assert out.startswith(str(venv)), out
    marker = json.loads((tmp_path / "wb" / ".dilococtl" / "provisioned.json").read_text())
    assert marker["hash"] == first.wheel_hash == source_hash(src) and marker["python"] == str(vpy)
    assert (tmp_path / "wb" / "wheels" / Path(first.wheel).name).is_file()
    # the log of the node that installed, under its own name (the follower, up to date, left none)
    assert "pip install" in (tmp_path / "wb" / ".dilococtl" / f"provision-{sshd.hosts[0]}.log").read_text()
    installed = Path(out).stat().st_mtime_ns

    second = run_provision(spec, source=src)
    assert [n.status for n in second.nodes] == ["up to date", "up to date", "failed"]
    assert second.nodes[0].detail == f"wheel {first.wheel_hash} already installed for {vpy}"
    assert second.wheel == first.wheel
    assert Path(out).stat().st_mtime_ns == installed  # nothing was reinstalled


def test_provision_cli_local_site_only_verifies(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[run]\nname = "t"\n\n[[sites]]\nname = "a"\nhosts = ["local"]\nwork_dir = "{tmp_path}"\n')
    p = subprocess.run([sys.executable, "-m", "dilococtl", "provision", str(spec), "--json"],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert [(n["host"], n["status"], n["python"]) for n in doc["nodes"]] == [("local", "verified", sys.executable)]
    assert doc["wheel"] == ""  # nothing to copy: no wheel was built


def test_provision_refuses_to_replace_an_editable_install(sshd, tmp_path):  # noqa: F811
    # A throwaway environment with its own editable install stands in for a developer's interpreter.
    src = _snapshot_source(tmp_path / "src")
    dev = tmp_path / "dev"
    # Its pip and setuptools are the project venv's (they build offline), reached through a .pth
    # line: never the host's system site-packages, whose setuptools may be older than pyproject.toml
    # needs (65.5 on a stock Debian image). A .pth line adds the directory without running its own
    # .pth files, so the project's editable install of this checkout stays out of it.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dev)], check=True)
    dev_site = subprocess.run([str(dev / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    Path(dev_site, "project_build_tools.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([str(dev / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-e", str(src)], check=True, capture_output=True)
    spec = _spec(sshd, tmp_path, [SiteSection(name="b", hosts=[sshd.host], python=str(dev / "bin" / "python"),
                                              work_dir=str(tmp_path / "wb"))])
    rep = run_provision(spec, source=src)
    assert rep.exit_code == 1
    assert rep.nodes[0].status == "failed"
    assert rep.nodes[0].detail == (f"{dev}/bin/python has an editable install of dilococtl (file://{src}); "
                                   "not replacing it: set a venv for site b")
    probe = "import dilococtl; print(dilococtl.__file__)"
    out = subprocess.run([str(dev / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                         cwd=tmp_path, check=True).stdout.strip()
    assert out == str(src / "dilococtl" / "__init__.py")  # still the checkout
