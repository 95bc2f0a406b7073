"""Issue 41, on local sites: a run's ports are checked before anything starts, a coordinator that exits
at start fails the launch in one line, an ended run (after a resume too) leaves no process carrying its
id, and a coordinator killed mid-run is restarted by the collector while the run goes on by itself."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from dilococtl import runs
from dilococtl.nodes import NodePool
from dilococtl.store import Store
from tests.integration.test_cli_runs import cli
from tests.integration.test_resume import launch, site_records, wait_for, write_spec
from tests.run_procs import marked

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def port_of(spec: Path, key: str) -> int:
    import tomllib

    return int(tomllib.loads(spec.read_text())["run"][key])


def newest_run(name: str) -> str:
    with Store.open() as store:
        return max((r for r in store.list_runs() if r.name == name), key=lambda r: r.created).id


def test_ports_and_no_leftovers(tmp_path):
    spec = write_spec(tmp_path, name="leak", rounds=60, h=6)
    lh_port = port_of(spec, "lighthouse_port")

    # a port another process listens on: refused before anything starts, in one line naming host:port;
    # doctor says so too, before anyone launches
    with socket.create_server(("127.0.0.1", lh_port)):
        d = cli("doctor", str(spec))
        r = cli("launch", str(spec))
    assert d.returncode == 1 and f"ports: already in use: {lh_port} (the Lighthouse's TLS relay)" in d.stdout, \
        d.stdout[-2000:] + d.stderr[-2000:]
    assert r.returncode == 1, r.stderr
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]  # after the plan launch shows
    assert len(err) == 1 and f"port local:{lh_port} is already in use" in err[0], r.stderr
    assert "TLS relay" in err[0] and "starting" not in r.stderr
    failed = newest_run("leak")
    assert not marked(failed)

    # held without listening (invisible to the check): the relay exits at start; the launch fails naming
    # it with its log's last line, and the Lighthouse it had started is gone too
    with socket.socket() as s:
        s.bind(("127.0.0.1", lh_port))
        r = cli("launch", str(spec))
    assert r.returncode == 1, r.stderr
    assert "the Lighthouse's relay on local exited at start" in r.stderr and "Address already in use" in r.stderr
    assert not marked(newest_run("leak"))

    # a run stopped, resumed as a whole and finished: no process of it is left, even when the collector
    # that ends it holds the record from before the resume (a new Lighthouse and relay since)
    run_id = launch(spec)
    try:
        wait_for(lambda: len(marked(run_id)) > 2, 60, lambda: "no process started")
        wait_for(lambda: len(site_records(tmp_path, run_id, "site-b", "round")) >= 4, 120,
                 lambda: cli("logs", run_id).stdout[-2000:])
        with Store.open() as store:
            stale = store.get_run(run_id)
        r = cli("stop", run_id, "--grace", "30")
        assert r.returncode == 0, r.stderr
        assert not marked(run_id)
        r = cli("resume", run_id, "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["whole_run"], r.stderr
        with Store.open() as store, NodePool(stale.spec().ssh) as pool:
            assert store.get_run(run_id).lighthouse["pid"] != stale.lighthouse["pid"]
            end = runs.wait(stale, store=store, pool=pool, poll_s=1, timeout_s=240)
        assert end.state == "finished"
        assert not marked(run_id), [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in marked(run_id)]
    finally:
        cli("stop", run_id, "--grace", "5")


def _final_ppl(tmp_path: Path, run_id: str) -> float:
    return site_records(tmp_path, run_id, "site-a", "round")[-1].val_ppl


def _kill_coordinator_and_finish(tmp_path: Path, spec: Path, rounds: int, stall_shown: bool) -> tuple[str, float]:
    """Launch `spec`, kill -9 its coordinator after 5 rounds, let status (the collector) restart it; the
    run finishes by itself. Returns the run id and seconds from the kill to the first round after it."""
    run_id = launch(spec)
    try:
        wait_for(lambda: len(site_records(tmp_path, run_id, "site-b", "round")) >= 5, 180,
                 lambda: cli("logs", run_id).stdout[-2000:])
        with Store.open() as store:
            lh = store.get_run(run_id).lighthouse
        t_kill = time.time()
        os.kill(int(lh["pid"]), signal.SIGKILL)
        if stall_shown:  # the sites say so within a few probes; status shows it (and then restarts it)
            wait_for(lambda: any(e.event == "coordinator_unreachable"
                                 for e in site_records(tmp_path, run_id, "site-a", "event")), 30,
                     lambda: "site-a never reported the dead Lighthouse")
            st = json.loads(cli("status", run_id, "--json").stdout)
            assert st["state"] == "running" and st["stalled"]["sites"], st
            assert "cannot reach the Lighthouse" in st["stalled"]["cause"] and st["stalled"]["since"] >= t_kill - 1
        else:  # resume counts a dead coordinator as dead: it restarts it (and no site, none died)
            r = cli("resume", run_id, "--json")
            assert r.returncode == 0, r.stderr
            res = json.loads(r.stdout)
            assert "outer parameter service" in res["coordinator_restarted"] and not res["relaunched"], res
        deadline = time.monotonic() + 240
        while (st := json.loads(cli("status", run_id, "--json").stdout))["state"] in ("launching", "running"):
            assert time.monotonic() < deadline, st
            time.sleep(1)
    finally:
        cli("stop", run_id, "--grace", "5")
    assert st["state"] == "finished", cli("logs", run_id).stdout[-3000:]
    assert [s["round"] for s in st["sites"]] == [rounds, rounds]
    assert st["stalled"] is None
    if stall_shown:  # the goodput ledger counts the stall as lost time (issue 41, item 4; dilococtl/goodput.py)
        m = st["metrics"]
        assert m["lost_s"]["failure_detection"] > 2.0 and 0 < m["goodput"] < 1, m
        print(f"\ngoodput {m['goodput']:.3f}; lost s: " + ", ".join(f"{k} {v:.1f}" for k, v in m["lost_s"].items()))
        assert all(x["useful_s"] + sum(x["lost_s"].values()) == pytest.approx(x["wall_s"])
                   for x in m["goodput_sites"].values()), m
    logs = cli("logs", run_id).stdout
    assert "coordinator_restart" in logs and "restarted on local at the same address" in logs, logs[-3000:]
    after = min(r.t for s in ("site-a", "site-b") for r in site_records(tmp_path, run_id, s, "round") if r.t > t_kill)
    assert not marked(run_id)
    return run_id, after - t_kill


def test_sync_lighthouse_killed_mid_run_is_restarted_and_the_run_goes_on(tmp_path):
    rounds = 30
    (tmp_path / "base").mkdir()
    base = write_spec(tmp_path / "base", name="sup-base", rounds=rounds, h=6)
    r = cli("launch", str(base), "--wait", "--json")  # the uninterrupted run of the same spec (bitwise equal ppl here)
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "finished", r.stderr[-2000:]
    want = _final_ppl(tmp_path / "base", json.loads(r.stdout)["id"])
    clean = json.loads(cli("status", json.loads(r.stdout)["id"], "--json").stdout)["metrics"]
    assert clean["lost_s"]["failure_detection"] == 0 and 0 < clean["goodput"] < 1, clean
    print(f"\nuninterrupted: goodput {clean['goodput']:.3f}; lost s: "
          + ", ".join(f"{k} {v:.1f}" for k, v in clean["lost_s"].items()))
    spec = write_spec(tmp_path, name="sup", rounds=rounds, h=6)
    run_id, gap = _kill_coordinator_and_finish(tmp_path, spec, rounds, stall_shown=True)
    got = _final_ppl(tmp_path, run_id)
    print(f"\nsync: Lighthouse kill -> next round {gap:.1f} s; ppl {got:.4f} vs uninterrupted {want:.4f}")
    assert gap < 30
    assert got == pytest.approx(want, rel=0.01)
    for site in ("site-a", "site-b"):  # every round after the restart had both sites
        assert all(x.k_active == 2 for x in site_records(tmp_path, run_id, site, "round"))


def test_async_outer_service_killed_mid_run_is_restarted_from_its_state(tmp_path):
    rounds = 30

    def async_spec(where: Path, name: str) -> Path:
        spec = write_spec(where, name=name, rounds=rounds, h=6)
        spec.write_text(spec.read_text().replace("[diloco]\n", '[diloco]\nmode = "async"\nasync_checkpoint_every = 1\n'))
        return spec

    (tmp_path / "base").mkdir()
    r = cli("launch", str(async_spec(tmp_path / "base", "asup-base")), "--wait", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "finished", r.stderr[-2000:]
    want = _final_ppl(tmp_path / "base", json.loads(r.stdout)["id"])
    run_id, gap = _kill_coordinator_and_finish(tmp_path, async_spec(tmp_path, "asup"), rounds, stall_shown=False)
    got = _final_ppl(tmp_path, run_id)
    print(f"\nasync: outer service kill -> next round {gap:.1f} s; ppl {got:.4f} vs uninterrupted {want:.4f}")
    log = (tmp_path / "work" / "runs" / run_id / "outer_service.log").read_text()
    resumed = [int(v) for v in re.findall(r"resumed at version (\d+)", log)]
    assert resumed and resumed[0] >= 1, log[-2000:]  # θ, momentum and version from its own saved state
    assert gap < 30
    # measured here: -1.9% to +1.3% of the uninterrupted run over four runs, +2.6% (11.79 vs 11.49) and +5.5%
    # (11.81 vs 11.19) on loaded CI hosts, -7.1% (10.72 vs 11.54) with the suite on every core: the kill
    # reorders the sites' pushes, and at 30 rounds of the tiny model that moves async's ppl by several
    # percent either way. A restart that lost θ costs far more (a fresh θ is at ppl ~250); the saved state
    # itself is checked above, so this bound only has to catch that
    assert want * 0.85 < got < want * 1.15
