"""`dilococtl doctor` probes each site's checkpoint stores from the site's own node: two SSH sites (a real
loopback sshd) against a real S3 service (SeaweedFS) (issue 35); local sites: tests/unit/test_doctor_store.py."""

from __future__ import annotations

import glob
import json
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dilococtl.doctor_store import check_stores
from dilococtl.nodes import NodePool
from dilococtl.spec import load_spec
from tests.ports import PORT_BLOCK, free_port
from tests.seaweed import argv_with
from tests.sshd import sshd  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
STAGED = "/tmp/dilococtl-doctor-store-*"  # the node's private directory for the credentials file (and ours)


def _spec(server, tmp_path: Path, stores: list[str]) -> Path:
    """Sites s0 and s1 over SSH (a spec mixes no local host with remote ones); each its own store, the
    other's as its replica."""
    base = free_port(PORT_BLOCK + 1)
    lh = base + PORT_BLOCK  # past the ports the run takes from base_port
    kh = server.write_known_hosts(tmp_path / "kh")
    hosts = list(server.hosts)
    sites = "".join(f'[[sites]]\nname = "s{i}"\nhosts = ["{h}"]\npython = "{sys.executable}"\n'
                    f'work_dir = "{tmp_path / f"w{i}"}"\ncheckpoint_store = "{stores[i]}"\n\n'
                    for i, h in enumerate(hosts))
    path = tmp_path / "spec.toml"
    path.write_text(f'[run]\nname = "t"\nlighthouse_port = {lh}\nbase_port = {base}\n\n'
                    f'[checkpoint]\nreplicas = 2\nstore_region = "us-east-1"\n\n'
                    f'[ssh]\nport = {server.port}\nuser = "root"\nidentity_file = "{server.identity_file}"\n'
                    f'known_hosts = "{kh}"\n\n{sites}')
    return path


def test_each_site_probes_its_stores_from_its_node(sshd, seaweed, tmp_path, monkeypatch):  # noqa: F811
    buckets = [seaweed.make_bucket(f"doctor-{i}-{secrets.token_hex(3)}") for i in range(2)]
    urls = [f"s3://{b}/ckpt?endpoint_url={seaweed.endpoint}" for b in buckets]
    spec = _spec(sshd, tmp_path, urls)
    # the operator's shell: the keys, no endpoint (each store names its service in its URL)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
           **{k: v for k, v in seaweed.env().items() if k != "AWS_ENDPOINT_URL_S3"}}
    before = set(glob.glob(STAGED))
    seen: list[str] = []
    done = threading.Event()

    def watch() -> None:  # every process's argv while doctor runs: the key must be in none
        while not done.is_set():
            seen.extend(argv_with(seaweed.secret_key))
            done.wait(0.05)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        p = subprocess.run([sys.executable, "-m", "dilococtl", "doctor", str(spec), "--json"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    finally:
        done.set()
        th.join(10)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert seen == []
    assert seaweed.secret_key not in p.stdout + p.stderr and seaweed.access_key not in p.stdout + p.stderr
    probes = {(x["site"], x["url"]): x for x in json.loads(p.stdout)["stores"]}
    assert list(probes) == [("s0", urls[0]), ("s0", urls[1]), ("s1", urls[1]), ("s1", urls[0])]
    for (site, _), x in probes.items():
        assert x["status"] == "ok" and x["upload_mbit"] > 0 and x["download_mbit"] > 0, x
        assert x["host"] == {"s0": sshd.hosts[0], "s1": sshd.hosts[1]}[site] and x["sites"] == [site]
        assert x["detail"].endswith(f" Mbit/s (4 MiB written, read and deleted from {x['host']})"), x
    assert all(seaweed.client().list_objects_v2(Bucket=b).get("KeyCount", 0) == 0 for b in buckets)
    assert set(glob.glob(STAGED)) == before  # the node's credentials file went with its directory

    # the human lines: one per site and store
    p = subprocess.run([sys.executable, "-m", "dilococtl", "doctor", str(spec)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env={**env, "COLUMNS": "400"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [x for x in p.stdout.splitlines() if x.startswith("ok: checkpoint store ")]
    assert [x.split(": up ")[0] for x in lines] == [f"ok: checkpoint store {s} -> {u}" for s, u in probes], lines
    assert seaweed.secret_key not in p.stdout + p.stderr

    # a shell without keys ships none: the SSH node has no chain of its own, so its probes fail, one line each
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    rs = load_spec(spec)
    with NodePool(rs.ssh) as pool:
        checks = check_stores(rs, pool, {sshd.hosts[1]: sys.executable})  # s0's node: not checked
    assert [(c.site, c.status) for c in checks] == [("s0", "warn"), ("s0", "warn"), ("s1", "fail"), ("s1", "fail")]
    assert all("Unable to locate credentials" in c.detail and "\n" not in c.detail for c in checks[2:]), checks
    assert set(glob.glob(STAGED)) == before
