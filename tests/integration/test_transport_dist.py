"""The TLS transport across processes: bit-identical members, dead and frozen peers; and real trainer
sites over it (torchrun + torchft), equal to the simulator, healing over it after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dilococtl import run_ca
from tests.integration.dist_helpers import start_site, tiny_config
from tests.integration.test_trainer_dist import final_params, kill_after_two_rounds, records, wait_all
from tests.ports import free_port
from trainer.simulate import simulate

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

MEMBER = textwrap.dedent("""
    import hashlib, json, sys, time, torch
    from trainer.transport import Identity, Listener, TransportError, connect
    a = json.loads(sys.argv[1])
    r = a["rank"]
    lst = Listener(Identity(**a["ident"]), host="127.0.0.1", port=a["ports"][r])
    comm = connect(lst, rank=r, sites=a["sites"], addrs=[("127.0.0.1", p) for p in a["ports"]],
                   streams=3, session=b"p" * 16, timeout_s=a["timeout"], min_chunk_bytes=4096, chunk_bytes=16384)
    g = torch.Generator().manual_seed(r)
    t = torch.randn(a["n"], generator=g) * 1e3
    print("ready", flush=True)
    t0 = time.monotonic()
    try:
        for _ in range(a["repeat"]):
            x = t.clone()
            comm.allreduce_sum(x)
        out = {"ok": True, "sum": x.view(torch.int32).tolist()[:4096], "hash": hashlib.sha256(x.numpy().tobytes()).hexdigest()}
    except TransportError as e:
        out = {"ok": False, "error": type(e).__name__ + ": " + str(e)}
    out["took"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
""")


def members(tmp_path, k, n, repeat=1, timeout=30.0):
    sites = [f"m{i}" for i in range(k)]
    ids = run_ca.ensure(tmp_path / "ca", "p", sites)
    ports = [free_port() for _ in range(k)]
    procs = []
    for r, s in enumerate(sites):
        i = ids[s]
        arg = json.dumps({"rank": r, "sites": sites, "ports": ports, "n": n, "repeat": repeat, "timeout": timeout,
                          "ident": {"site": s, "cert": str(i.cert), "key": str(i.key), "ca": str(i.ca)}})
        procs.append(subprocess.Popen([sys.executable, "-c", MEMBER, arg], stdout=subprocess.PIPE, text=True,
                                      env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")))
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


def result(p, timeout=120):
    out, _ = p.communicate(timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def test_three_processes_end_bit_identical(tmp_path):
    procs = members(tmp_path, 3, 300_001)
    got = [result(p) for p in procs]
    assert all(g["ok"] for g in got), got
    assert got[0]["hash"] == got[1]["hash"] == got[2]["hash"]
    assert got[0]["sum"] == got[1]["sum"] == got[2]["sum"]
    exact = sum(torch.randn(300_001, generator=torch.Generator().manual_seed(r)).double() * 1e3 for r in range(3))
    mine = torch.tensor(got[0]["sum"], dtype=torch.int32).view(torch.float32).double()
    torch.testing.assert_close(mine, exact[:4096], rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_member_killed_or_frozen_mid_collective_fails_the_others_within_the_timeout(tmp_path, how):
    timeout = 4.0
    procs = members(tmp_path, 3, 2_000_000, repeat=50, timeout=timeout)  # far longer than the test waits
    time.sleep(1.0)  # mid-collective
    victim = procs[2]
    victim.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        got = [result(p, timeout=60) for p in procs[:2]]
    finally:
        victim.kill()
        victim.wait()
    for g in got:
        assert g["ok"] is False, g
        assert "PeerLost" in g["error"] or "TransportError" in g["error"]
    # a dead peer is seen at once; a frozen one within the collective's timeout (plus the thread join)
    assert all(g["took"] < 1.0 + 50 * timeout for g in got)


def tls_cfgs(tmp_path, **over):
    ids = run_ca.ensure(tmp_path / "ca", "t", ["site0", "site1"])
    return [tiny_config(tmp_path, i, **{"diloco.transport": "tls", "diloco.transport_streams": 2,
                                        "run.tls_ca": str(ids[f"site{i}"].ca), "run.tls_cert": str(ids[f"site{i}"].cert),
                                        "run.tls_key": str(ids[f"site{i}"].key), "run.transport_host": "127.0.0.1",
                                        **over})
            for i in range(2)]


def _lighthouse(n):
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="127.0.0.1:0", min_replicas=n, join_timeout_ms=1000)


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_two_trainer_sites_over_tls_equal_the_simulator(tmp_path, compression):
    lh = _lighthouse(2)
    try:
        cfgs = tls_cfgs(tmp_path, **{"diloco.min_sites": 2, "diloco.compression": compression})
        procs = [start_site(c, lh.address(), tmp_path / f"site{i}.log") for i, c in enumerate(cfgs)]
        codes = wait_all(procs, 240)
    finally:
        lh.shutdown()
    assert codes == [0, 0], [(tmp_path / f"site{i}.log").read_text()[-3000:] for i in range(2)]
    sim = simulate(cfgs[0])
    for site in ("site0", "site1"):
        for g, s in zip(final_params(tmp_path, site), sim.params, strict=True):
            torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-7)
        rounds = records(tmp_path, site, "round")
        assert [r.round for r in rounds] == [1, 2, 3] and all(r.k_active == 2 and r.committed for r in rounds)
    log = (tmp_path / "site0.log").read_text()
    assert "ProcessGroupGloo" not in log


def test_a_killed_tls_site_rejoins_by_healing_over_tls(tmp_path):
    lh = _lighthouse(1)
    rounds, h = 60, 5
    try:
        cfgs = tls_cfgs(tmp_path, **{"diloco.rounds": rounds, "diloco.h": h, "data.batch_size": 16,
                                     "data.seq_len": 64})
        a = start_site(cfgs[0], lh.address(), tmp_path / "a.log")
        b = start_site(cfgs[1], lh.address(), tmp_path / "b.log")
        kill_after_two_rounds(tmp_path, a, b)
        b2 = start_site(cfgs[1], lh.address(), tmp_path / "b2.log")
        codes = wait_all([a, b2], 300)
    finally:
        lh.shutdown()
    assert codes == [0, 0], (tmp_path / "b2.log").read_text()[-3000:]
    events = records(tmp_path, "site1", "event")
    assert any(e.event == "heal" for e in events), [e.event for e in events]
    for x, y in zip(final_params(tmp_path, "site0"), final_params(tmp_path, "site1"), strict=True):
        assert torch.equal(x, y)
