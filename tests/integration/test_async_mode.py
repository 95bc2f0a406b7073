"""Async mode on loopback: the outer service and two sites of different speeds as real processes."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dilococtl import service_keys
from tests.integration.dist_helpers import free_port, start_site, tiny_config
from trainer import config as config_mod
from trainer.async_mode import ServiceClient
from trainer.codec_spec import payload_bytes
from trainer.config import param_count
from trainer.records import RoundRecord, parse_line

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def rounds_of(run_dir: Path, site: str) -> list[RoundRecord]:
    lines = (run_dir / site / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(parse_line, lines) if isinstance(r, RoundRecord)]


@pytest.fixture
def service(tmp_path):
    keys = service_keys.ensure(tmp_path / "keys", ["127.0.0.1"])
    port = free_port()
    log = open(tmp_path / "service.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.outer_service", "--bind", f"127.0.0.1:{port}", "--cert", str(keys.cert),
         "--key", str(keys.key), "--token-file", str(keys.token), "--state-dir", str(tmp_path / "svc"),
         "--checkpoint-every", "4", "--sites", "2", "--alpha", "0.5"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"https://127.0.0.1:{port}"
    client = ServiceClient(url, cert=str(keys.cert), token_file=str(keys.token), retry_s=60)
    try:
        client.health()  # retried until it listens
        yield url, keys, client
    finally:
        client.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def test_two_sites_of_different_speeds_against_the_service(tmp_path, service):
    url, keys, client = service
    run_dir = tmp_path / "run"
    common = {"diloco.mode": "async", "run.service_url": url, "run.service_cert": str(keys.cert),
              "run.service_token_file": str(keys.token), "run.service_retry_s": 60.0}
    # site0: short rounds, one process; site1: long rounds, two processes sharing the CPUs (slower)
    fast = tiny_config(run_dir, 0, **common, **{"diloco.h": 2, "diloco.rounds": 10})
    slow = tiny_config(run_dir, 1, **common, **{"diloco.h": 10, "diloco.rounds": 3})
    procs = [start_site(fast, "", tmp_path / "site0.log"), start_site(slow, "", tmp_path / "site1.log", nproc=2)]
    for p, name in zip(procs, ("site0", "site1"), strict=True):
        assert p.wait(timeout=400) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    r0, r1 = rounds_of(run_dir, "site0"), rounds_of(run_dir, "site1")
    assert [r.round for r in r0] == list(range(1, 11)) and [r.round for r in r1] == [1, 2, 3]
    state = client.state()
    assert state["version"] == state["pushes"] == len(r0) + len(r1) == 13
    assert {k: v["pushes"] for k, v in state["per_site"].items()} == {"site0": 10, "site1": 3}
    assert state["joined"] == ["site0", "site1"]
    # a fresh run starts together: each site waited for the other; the first to pull got θ_0, the other
    # may pull a version the first already pushed (a loaded machine delays its pull)
    joined = [re.search(r"joined the outer service at version (\d+) \(2 of 2 sites there\)",
                        (run_dir / name / "metrics.jsonl").read_text()) for name in ("site0", "site1")]
    assert all(joined) and min(int(m[1]) for m in joined) == 0, joined
    # the staleness each site recorded is what the service counted, and the slow site's pushes were stale
    for name, recs in (("site0", r0), ("site1", r1)):
        assert sum(r.staleness for r in recs) == state["per_site"][name]["staleness_sum"]
        assert all(r.committed and r.k_active == 1 and r.k_nominal == 2 for r in recs)
    assert max(r.staleness for r in r1) > 0
    # dampened lr recorded: η/K · ψ(γ)
    for r in r0 + r1:
        assert r.outer_lr == pytest.approx(0.7 / 2 / (1 + 0.5 * r.staleness))
    n = param_count(fast.model)
    assert all(r.bytes_sent == payload_bytes("none", [(n,)]) == 4 * n + 4 for r in r0 + r1)  # fp32 + weight
    assert all(r.bytes_recv == 4 * n and r.sync_s > 0 for r in r0 + r1)
    for recs in (r0, r1):  # perplexity falls, far below a uniform guess over 256 bytes
        assert recs[-1].val_ppl < 0.9 * recs[0].val_ppl
        assert recs[-1].val_ppl < 64
    ckpts = sorted(p.name for p in (tmp_path / "svc").glob("*.pt"))
    assert ckpts == ["service-v000000004.pt", "service-v000000008.pt", "service-v000000012.pt"]

    # a site with a wrong token is refused, in one line, and the token never shows
    bad = tmp_path / "bad-token"
    bad.write_text("wrong\n")
    cfg = tiny_config(tmp_path / "run2", 0, **{**common, "run.service_token_file": str(bad), "diloco.rounds": 1})
    path = tmp_path / "bad.toml"
    path.write_text(config_mod.dump_toml(cfg))
    r = subprocess.run([sys.executable, "-m", "trainer", "--config", str(path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == \
        "error: ServiceRefused: outer service POST /init: HTTP 401: missing or wrong bearer token"
    pinned = httpx.Client(verify=ssl.create_default_context(cafile=str(keys.cert)))
    resp = pinned.get(f"{url}/state", headers={"Authorization": "Bearer wrong"})
    assert resp.status_code == 401
    pinned.close()
    assert client.state()["version"] == 13  # nothing applied
    token = keys.token.read_text().strip()
    for log in [*tmp_path.glob("*.log"), *run_dir.glob("*/metrics.jsonl")]:
        assert token not in log.read_text()


def test_sigterm_saves_and_the_site_resumes_against_the_service(tmp_path, service):
    url, keys, client = service
    run_dir = tmp_path / "run"
    over = {"diloco.mode": "async", "run.service_url": url, "run.service_cert": str(keys.cert),
            "run.service_token_file": str(keys.token), "diloco.h": 2, "diloco.rounds": 500}
    cfg = tiny_config(run_dir, 0, sites=1, **over)
    proc = start_site(cfg, "", tmp_path / "a.log")
    deadline = time.monotonic() + 120
    metrics = run_dir / "site0" / "metrics.jsonl"
    while not metrics.exists() or len(rounds_of(run_dir, "site0")) < 3:
        assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "a.log").read_text()[-2000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    text = metrics.read_text()
    assert '"event":"preempted"' in text and (run_dir / "site0" / "node0.preempted").exists()
    done = len(rounds_of(run_dir, "site0"))
    assert client.state()["version"] == done  # every recorded round was one applied push

    cfg2 = tiny_config(run_dir, 0, sites=1, **{**over, "diloco.rounds": done + 2})
    proc = start_site(cfg2, "", tmp_path / "b.log")
    assert proc.wait(timeout=120) == 0, (tmp_path / "b.log").read_text()[-2000:]
    recs = rounds_of(run_dir, "site0")
    assert [r.round for r in recs] == list(range(1, done + 3))  # went on from its checkpoint
    assert client.state()["version"] == done + 2
    assert all(r.staleness == 0 for r in recs)  # alone: every push was based on the newest θ
