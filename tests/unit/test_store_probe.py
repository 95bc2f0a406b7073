"""The node-side checkpoint-store probe (trainer.checkpoints.store_probe) and how doctor runs and reports it (issue 35)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dilococtl import store_creds
from dilococtl.doctor import DoctorReport
from dilococtl.doctor_store import check_stores, line, parse_output, site_probes
from dilococtl.errors import EXIT_FAILED, EXIT_OK, Unreachable
from dilococtl.nodes import CmdResult, LocalNode
from dilococtl.spec import spec_from_dict
from trainer.checkpoints import store_probe


def _spec(stores: list[str], hosts: list[str], replicas: int = 1):
    return spec_from_dict({"run": {"name": "p"}, "checkpoint": {"replicas": replicas},
                           "sites": [{"name": f"s{i}", "hosts": [h], "work_dir": "/tmp/p35", "checkpoint_store": u}
                                     for i, (u, h) in enumerate(zip(stores, hosts, strict=True))]}, "p.toml")


def test_the_probe_writes_reads_and_deletes_in_a_file_store(tmp_path, capsys):
    store = tmp_path / "store"
    (store / "run1").mkdir(parents=True)  # a run's rounds beside it are left alone
    (store / "run1" / "keep").write_bytes(b"x")
    good, bad = f"file://{store}", "file:///proc/no-store-here"
    assert store_probe.main(["--bytes", "65536", good, bad]) == 1
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["url"], x["status"], x["bytes"]) for x in out] == [(good, "ok", 65536), (bad, "fail", 65536)]
    assert out[0]["upload_mbit"] > 0 and out[0]["download_mbit"] > 0 and "error" not in out[0]
    assert out[1]["error"] == "[Errno 2] No such file or directory: '/proc/no-store-here'", out[1]
    assert "\n" not in out[1]["error"] and "upload_mbit" not in out[1]
    # the probe is gone, and so is its _doctor/ directory; the run's file is untouched
    assert sorted(p.relative_to(store).as_posix() for p in store.rglob("*")) == ["run1", "run1/keep"]


def test_the_module_runs_as_a_command(tmp_path):
    store = tmp_path / "s"
    r = subprocess.run([sys.executable, "-m", "trainer.checkpoints.store_probe", "--bytes", "1024", f"file://{store}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (res,) = [json.loads(x) for x in r.stdout.splitlines()]
    assert res["status"] == "ok" and res["bytes"] == 1024
    assert not list(store.rglob("probe-*"))
    r = subprocess.run([sys.executable, "-m", "trainer.checkpoints.store_probe", "--bytes", "0", f"file://{store}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--bytes must be at least 1, not 0" in r.stderr


def test_output_parsing_and_lines():
    urls = ["s3://a/x?endpoint_url=http://10.0.0.1:8333", "s3://b/y", "s3://c/z"]
    ok = json.dumps({"url": urls[0], "status": "ok", "bytes": 4 << 20, "upload_mbit": 48.25, "download_mbit": 96.5})
    bad = json.dumps({"url": urls[1], "status": "fail", "bytes": 4 << 20, "error": "cannot upload _doctor/p: denied"})
    checks = parse_output("site0", "n1", urls, 1, f"noise\n{ok}\n{{not json\n{bad}\n",
                          "Traceback\nModuleNotFoundError: No module named 'boto3'\n")
    assert [(c.url, c.site, c.host, c.sites, c.status) for c in checks] == [
        (urls[0], "site0", "n1", ["site0"], "ok"), (urls[1], "site0", "n1", ["site0"], "fail"),
        (urls[2], "site0", "n1", ["site0"], "fail")]
    assert (checks[0].upload_mbit, checks[0].download_mbit) == (48.25, 96.5)
    assert line(checks[0]) == (f"ok: checkpoint store site0 -> {urls[0]}: up 48.2 Mbit/s, down 96.5 Mbit/s "
                               f"(4 MiB written, read and deleted from n1)")
    assert line(checks[1]) == f"fail: checkpoint store site0 -> {urls[1]}: cannot upload _doctor/p: denied"
    assert line(checks[2]) == (f"fail: checkpoint store site0 -> {urls[2]}: no probe result from n1: "
                               f"ModuleNotFoundError: No module named 'boto3' (run `dilococtl provision`)")
    # a timed-out command without stderr names its exit code
    (late,) = parse_output("s", "n", ["s3://d"], 124, "", "")
    assert late.detail == "no probe result from n: exit 124"


def test_each_site_probes_its_own_stores_from_its_first_node(tmp_path):
    a, b = f"file://{tmp_path / 'a'}", f"file://{tmp_path / 'b'}"
    spec = _spec([a, b], ["local", "local"], replicas=2)
    assert [(s.name, urls) for s, urls in site_probes(spec)] == [("s0", [a, b]), ("s1", [b, a])]

    class Pool:
        def get(self, host):
            return LocalNode(host)

    checks = check_stores(spec, Pool(), {"local": sys.executable})
    assert [(c.site, c.url, c.status) for c in checks] == [("s0", a, "ok"), ("s0", b, "ok"), ("s1", b, "ok"),
                                                          ("s1", a, "ok")], checks
    assert all(c.upload_mbit > 0 and c.download_mbit > 0 and c.host == "local" for c in checks)
    assert not list(tmp_path.rglob("probe-*"))
    doc = DoctorReport(nodes=[], links=[], stores=checks).to_json()
    assert doc["exit_code"] == EXIT_OK
    assert [(x["site"], x["sites"], x["url"], x["status"]) for x in doc["stores"]][:2] == [
        ("s0", ["s0"], a, "ok"), ("s0", ["s0"], b, "ok")]
    assert all(x["upload_mbit"] > 0 for x in doc["stores"])

    # a first node without a working interpreter is not checked: one warning per store, no probe
    skipped = check_stores(spec, Pool(), {})
    assert [(c.site, c.status, c.detail) for c in skipped][:1] == [("s0", "warn", "not checked: no working python on local")]


class FakeSSHNode:
    """A remote node that records what doctor runs and copies there (the probe's answer is canned)."""

    def __init__(self, host: str, probe: CmdResult | Exception):
        self.host, self.probe = host, probe
        self.runs: list[tuple[str, dict]] = []
        self.files: dict[str, bytes] = {}
        self.modes: dict[str, int] = {}

    def run(self, cmd: str, timeout: float = 60, env: dict | None = None) -> CmdResult:
        self.runs.append((cmd, dict(env or {})))
        if cmd.startswith("umask 077 && mktemp -d"):
            return CmdResult(0, "/tmp/dilococtl-doctor-store-Ab12Cd34\n", "")
        if "trainer.checkpoints.store_probe" in cmd:
            if isinstance(self.probe, Exception):
                raise self.probe
            return self.probe
        return CmdResult(0, "", "")

    def put(self, local, remote: str) -> None:
        self.files[remote] = open(local, "rb").read()
        self.modes[remote] = os.stat(local).st_mode & 0o777


@pytest.mark.parametrize("fails", [False, True])
def test_an_ssh_site_gets_the_shells_keys_in_a_private_file_removed_afterwards(monkeypatch, fails):
    secret, token = "SECRET" + "x" * 34, "TOKEN" + "y" * 20
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDPROBE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://10.0.0.5:8333")
    for k in ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(k, raising=False)
    url = "s3://bucket/ckpt"
    spec = _spec([url], ["10.0.0.9"])
    ok = json.dumps({"url": url, "status": "ok", "bytes": 4 << 20, "upload_mbit": 20.0, "download_mbit": 40.0})
    node = FakeSSHNode("10.0.0.9", Unreachable("10.0.0.9: unreachable: connection lost") if fails
                       else CmdResult(0, ok + "\n", ""))

    class Pool:
        def get(self, host):
            return node

    (check,) = check_stores(spec, Pool(), {"10.0.0.9": "/opt/venv/bin/python"})
    there = "/tmp/dilococtl-doctor-store-Ab12Cd34/_keys/aws-credentials"
    assert list(node.files) == [there] and node.modes[there] == 0o600
    assert secret in node.files[there].decode() and token in node.files[there].decode()
    cmds = [c for c, _ in node.runs]
    assert cmds[0].startswith("umask 077 && mktemp -d") and f"chmod 600 {there}" in cmds
    assert cmds[-1] == "rm -rf /tmp/dilococtl-doctor-store-Ab12Cd34"  # whatever happened before
    (probe_cmd, env), = [(c, e) for c, e in node.runs if "trainer.checkpoints.store_probe" in c]
    assert probe_cmd == f"/opt/venv/bin/python -m trainer.checkpoints.store_probe {url}"
    assert env == {"AWS_SHARED_CREDENTIALS_FILE": there, "AWS_PROFILE": "default",
                   "AWS_ENDPOINT_URL_S3": "http://10.0.0.5:8333"}
    for c, e in node.runs:  # no key on any command line or in any environment value
        assert secret not in c + json.dumps(e) and token not in c + json.dumps(e) and "AKIDPROBE" not in c
    assert secret not in json.dumps(DoctorReport(nodes=[], links=[], stores=[check]).to_json())
    if fails:
        assert (check.status, check.detail) == ("fail", "10.0.0.9: unreachable: connection lost")
        assert DoctorReport(nodes=[], links=[], stores=[check]).exit_code == EXIT_FAILED
    else:
        assert (check.status, check.upload_mbit, check.host) == ("ok", 20.0, "10.0.0.9")


def test_an_ssh_site_without_keys_in_the_shell_gets_no_file(monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", *store_creds.PASSED_AS_IS):
        monkeypatch.delenv(k, raising=False)
    url = "s3://bucket/ckpt"
    node = FakeSSHNode("10.0.0.9", CmdResult(1, "", "botocore.exceptions.NoCredentialsError\n"))

    class Pool:
        def get(self, host):
            return node

    (check,) = check_stores(_spec([url], ["10.0.0.9"]), Pool(), {"10.0.0.9": "python3"})
    assert node.files == {} and [(c, e) for c, e in node.runs] == [(f"python3 -m trainer.checkpoints.store_probe {url}", {})]
    assert check.status == "fail" and check.detail.endswith("botocore.exceptions.NoCredentialsError")
