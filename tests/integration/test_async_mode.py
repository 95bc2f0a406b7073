"""Async mode on loopback: the outer service and two sites of different speeds as real processes."""

from __future__ import annotations

import contextlib
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
from tests.integration.dist_helpers import start_site, tiny_config
from tests.ports import free_port
from trainer.records import RoundRecord, parse_line
from trainer.rules import config as config_mod
from trainer.rules.codec_spec import payload_bytes
from trainer.rules.model_config import param_count
from trainer.service.service_client import ServiceClient

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def rounds_of(run_dir: Path, site: str) -> list[RoundRecord]:
    lines = (run_dir / site / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(parse_line, lines) if isinstance(r, RoundRecord)]


@contextlib.contextmanager
def running_service(tmp_path: Path, sites: int = 2, **diloco):
    """The outer service as a process, started with the trainer config the sites get."""
    keys = service_keys.ensure(tmp_path / "keys", ["127.0.0.1"])
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    over = {"diloco.mode": "async", "diloco.async_checkpoint_every": 4, **{f"diloco.{k}": v for k, v in diloco.items()}}
    cfg_path = tmp_path / "outer_service.toml"
    cfg_path.write_text(config_mod.dump_toml(tiny_config(tmp_path / "svc-run", 0, sites=sites, **over)))
    log = open(tmp_path / "service.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.service.outer_service", "--bind", f"127.0.0.1:{port}", "--cert", str(keys.cert),
         "--key", str(keys.key), "--token-file", str(keys.token), "--state-dir", str(tmp_path / "svc"),
         "--config", str(cfg_path)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = ServiceClient(url, cert=str(keys.cert), token_file=str(keys.token), retry_s=60)
    try:
        client.health()  # retried until it listens
        yield url, keys, client
    finally:
        client.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


@pytest.fixture
def service(tmp_path):
    with running_service(tmp_path, sites=2, async_alpha=0.5) as svc:
        yield svc


def test_one_async_site_equals_the_simulator(tmp_path):
    """The async pipeline (push, the service's apply_push, pull) against the simulator's async mode,
    on the one arrival pattern real processes reproduce exactly: a single site."""
    import torch

    from trainer.simulate import simulate

    with running_service(tmp_path, sites=1) as (url, keys, client):
        over = {"diloco.mode": "async", "run.service_url": url, "run.service_cert": str(keys.cert),
                "run.service_token_file": str(keys.token), "diloco.h": 4, "diloco.rounds": 3}
        cfg = tiny_config(tmp_path / "run", 0, sites=1, **over)
        proc = start_site(cfg, "", tmp_path / "site0.log")
        assert proc.wait(timeout=300) == 0, (tmp_path / "site0.log").read_text()[-3000:]
    sim = simulate(cfg)
    got = torch.load(tmp_path / "run" / "site0" / "final_model.pt")
    for g, s in zip(got.values(), sim.params, strict=True):
        torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-7)
    recs = rounds_of(tmp_path / "run", "site0")
    assert recs[-1].val_ppl == pytest.approx(sim.rounds[-1].val_ppl, rel=1e-4)


def test_codec_options_reach_the_service(tmp_path):
    """The service decodes with the sites' own codec options (chunk, scale dtype, top-k block):
    with options other than the defaults, a push it decoded with the defaults would not parse."""
    codec = {"compression": "topk:0.1+int8", "codec_chunk": 64, "codec_scale_dtype": "bf16",
             "codec_topk_block": 256, "outer_momentum": 0.0, "outer_lr": 1.0}
    with running_service(tmp_path, sites=1, **codec) as (url, keys, client):
        over = {"diloco.mode": "async", "run.service_url": url, "run.service_cert": str(keys.cert),
                "run.service_token_file": str(keys.token), "diloco.h": 4, "diloco.rounds": 4,
                **{f"diloco.{k}": v for k, v in codec.items()}}
        cfg = tiny_config(tmp_path / "run", 0, sites=1, **over)
        proc = start_site(cfg, "", tmp_path / "site0.log")
        assert proc.wait(timeout=300) == 0, (tmp_path / "site0.log").read_text()[-3000:]
        recs = rounds_of(tmp_path / "run", "site0")
        # a round's push lands in the next round: round 1's record has no outcome yet
        assert [r.round for r in recs] == [1, 2, 3, 4] and all(r.committed for r in recs[1:])
        assert client.state()["version"] == 4
    from trainer.model import build_model

    shapes = [tuple(p.shape) for p in build_model(cfg.model, 0).parameters()]
    want = payload_bytes(codec["compression"], shapes, cfg.diloco.codec_options())
    assert want != payload_bytes(codec["compression"], shapes)  # the options change the wire format
    assert all(r.bytes_sent == want for r in recs)
    assert recs[-1].val_ppl < recs[0].val_ppl


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
    # a round's push goes out in the background and lands in the next round, whose record shows its
    # outcome (as overlap's): round 1's has none; the last push, waited for, adds only its bytes. So the
    # staleness recorded is what the service counted but the last push's, and the slow site's were stale
    for name, recs in (("site0", r0), ("site1", r1)):
        st = state["per_site"][name]
        assert 0 <= st["staleness_sum"] - sum(r.staleness for r in recs) <= st["staleness_max"]
        assert not recs[0].committed and recs[0].bytes_recv == 0
        assert all(r.committed and r.k_active == 1 and r.k_nominal == 2 and r.sync_s > 0 for r in recs[1:])
    assert max(r.staleness for r in r1) > 0
    # dampened lr recorded: η/K · ψ(γ); the service's run has 3 rounds, so η is the short-run rule's 1
    # (α is set: 0.5)
    for r in r0[1:] + r1[1:]:
        assert r.outer_lr == pytest.approx(1.0 / 2 / (1 + 0.5 * r.staleness))
    n = param_count(fast.model)
    assert all(r.bytes_sent == payload_bytes("none", [(n,)]) == 4 * n + 4 for r in r0 + r1)  # fp32 + weight
    # θ with each push's answer, and again whenever the other site pushed before the update landed
    assert all(r.bytes_recv % (4 * n) == 0 and r.bytes_recv >= 4 * n for r in r0[1:] + r1[1:])
    # perplexity falls, far below a uniform guess over 256 bytes (a round's record evaluates the site's
    # own parameters; the last, θ as its last push left it)
    assert r0[-1].val_ppl < 0.9 * r0[0].val_ppl
    assert r0[-1].val_ppl < 64 and r1[-1].val_ppl < 64
    ckpts = sorted(p.name for p in (tmp_path / "svc").glob("round-*"))  # signed round directories (issue 35)
    assert ckpts == ["round-000004", "round-000008", "round-000012"]

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
