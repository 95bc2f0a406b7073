"""A rogue on the emulated WAN, holding no certificate of the run (issue 17, "what it must show" 5).

A 3-site lab; the run uses site0 and site1, the rogue (tests/e2e/rogue_agent.py) runs in site2's
namespace while the run trains, while site1 is killed, resumed and heals from site0, until the run
ends. It tries (a) to join the quorum through the Lighthouse's port with a real torchft Manager,
(b) to read heal state from the sites (torchft's checkpoint metadata, its HTTP checkpoint path),
(c) to connect to every port of both sites over TLS, with no certificate and with another run's
certificate naming a real site, and contribute a payload of huge floats, (d) to be the heal source
(announcing a higher step) and serve the healing site a pickle that creates a file when loaded.
Each is refused or has no effect, and the run completes with every round committed by both sites.

Without the protection the same rogue gets in. Run once by hand over transport = "gloo" (no relay,
plaintext Lighthouse, torchft's HTTP heal), same lab and flow: its Manager joined the quorum at its
first attempt (3 participants), both sites fetched its pickle and the marker file appeared 7 s after
it started; both sites' ManagerServers gave it their heal URLs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomlkit

from dilococtl import run_ca
from dilococtl.spec import load_spec
from tests.e2e.conftest import cli, dctl, lab_up
from trainer.records import parse_line

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 80  # with H = 30 (~2 s a round here): site0 still trains when site1 is back from its kill


@pytest.fixture(scope="module")
def lab3(tmp_path_factory):
    yield from lab_up(tmp_path_factory, "rogue", "--sites", "3", "--rate", "200mbit", "--rtt", "10ms",
                      runs=("rogue-run",))


def node(home: Path, name: str) -> dict:
    st = json.loads(dctl(home, "status", "--json").stdout)
    return next(n for n in st["nodes"] if n["name"] == name)


def listening_ports(netns: str) -> list[int]:
    """Every TCP port something listens on in `netns`, but its sshd."""
    out = subprocess.run(["ip", "netns", "exec", netns, "ss", "-ltnH"], capture_output=True, text=True,
                         check=True).stdout
    ports = {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}
    return sorted(ports - {22})


def records(path: Path, kind: str) -> list:
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(parse_line, lines) if r is not None and r.kind == kind]


def until(what, timeout: float, msg: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, msg
        time.sleep(0.5)


def siege(home: Path, spec: Path, transport: str, tmp: Path) -> dict:
    """Launch a 2-site run over `transport`, set the rogue on it, kill and resume site1 meanwhile; the
    rogue's results, the run's records and logs."""
    doc = tomlkit.parse(spec.read_text())
    doc["run"]["name"] = "rogue-run"
    doc["diloco"]["rounds"] = ROUNDS
    doc["diloco"]["h"] = 30
    doc["diloco"]["transport"] = transport
    doc["sites"] = doc["sites"][:2]
    doc["diloco"]["sites"] = 2
    path = home / f"rogue-{transport}.toml"
    path.write_text(tomlkit.dumps(doc))
    plain = tomllib.loads(path.read_text())
    s0, s1, rogue = node(home, "site0-n0"), node(home, "site1-n0"), node(home, "site2-n0")

    r = cli(home, "launch", str(path), "--json")
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["id"]
    dirs = {s["name"]: Path(s["work_dir"]) / "runs" / run_id / s["name"] for s in plain["sites"]}
    rounds = lambda site: records(dirs[site] / "metrics.jsonl", "round")  # noqa: E731
    rogue_proc = None
    try:
        until(lambda: len(rounds("site1")) >= 2, 180, "site1 never finished round 2")
        targets = [[s0["address"], p] for p in listening_ports(s0["netns"])] + \
                  [[s1["address"], p] for p in listening_ports(s1["netns"])]
        foreign = run_ca.ensure(tmp / "foreign_ca", "foreign", ["site0", "site1"])["site1"]  # a real site's name
        marker = tmp / "rogue-was-here"
        cfg = {"me": rogue["address"], "lighthouse": f"http://{s0['address']}:{load_spec(path).run.lighthouse_port}",
               "targets": targets, "marker": str(marker), "out": str(tmp / "rogue.json"), "stop": str(tmp / "stop"),
               "foreign": {"cert": str(foreign.cert), "key": str(foreign.key)}, "max_s": 600}
        rogue_proc = subprocess.Popen(["ip", "netns", "exec", rogue["netns"], sys.executable, "-m",
                                       "tests.e2e.rogue_agent", json.dumps(cfg)], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert rogue_proc.stdout.readline().strip() == "ready", rogue_proc.stderr.read()[-3000:]
        time.sleep(10)  # the rogue's Manager asks for quorums meanwhile

        # site1 dies and comes back: a new quorum, a heal from site0, site0's listener handshakes again
        assert len(rounds("site0")) < ROUNDS - 20, "the run went too fast for the rogue"
        dctl(home, "kill", "site1", "--grace", "5")
        t_resume = time.time()
        r = cli(home, "resume", run_id, "--json")
        assert r.returncode == 0, r.stderr
        until(lambda: any(e.event == "heal" and e.t > t_resume
                          for e in records(dirs["site1"] / "metrics.jsonl", "event")), 240,
              "site1 never healed after its resume")
        deadline = time.monotonic() + 400
        while True:
            r = cli(home, "status", run_id, "--json")
            st = json.loads(r.stdout)
            if st["state"] not in ("launching", "running"):
                break
            assert time.monotonic() < deadline, st
            time.sleep(2)
    finally:
        (tmp / "stop").touch()
        if rogue_proc is not None:
            try:
                rogue_proc.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                rogue_proc.kill()
                rogue_proc.communicate()
        cli(home, "stop", run_id, "--grace", "5", timeout=60)
    out = json.loads((tmp / "rogue.json").read_text())
    run_dir = dirs["site0"].parent
    return {"rogue": out, "state": st, "marker": marker, "t_resume": t_resume, "rounds": {s: rounds(s) for s in dirs},
            "events": {s: records(dirs[s] / "metrics.jsonl", "event") for s in dirs},
            "logs": {s: (dirs[s] / "node0.log").read_text(errors="replace") for s in dirs},
            "lighthouse_log": (run_dir / "lighthouse.log").read_text(errors="replace"),
            "relay_log": (run_dir / "lighthouse-relay.log").read_text(errors="replace")
            if (run_dir / "lighthouse-relay.log").exists() else "",
            "rogue_address": node(home, "site2-n0")["address"], "site0": s0["address"]}


@pytest.fixture(scope="module")
def tls_siege(lab3, tmp_path_factory):
    home, spec = lab3
    return siege(home, spec, "tls", tmp_path_factory.mktemp("siege"))


def test_a_rogue_cannot_join_the_quorum(tls_siege):
    s = tls_siege
    j = s["rogue"]["join"]
    assert j["attempts"] >= 3 and j["joined"] == 0, j
    assert "rogue" not in s["lighthouse_log"]  # the Lighthouse never heard of it
    # the relay refused it (its Manager's gRPC, and the TLS probes of the relay's port)
    refused = [x for x in s["relay_log"].splitlines() if "refused" in x and s["rogue_address"] in x]
    assert refused, s["relay_log"][-2000:]
    # every quorum held the two sites only (one while site1 was away)
    for site, rows in s["rounds"].items():
        assert rows and all(x.k_active in (1, 2) for x in rows), site


def test_a_rogue_reads_no_heal_state(tls_siege):
    s = tls_siege
    # no port of either site answers torchft's ManagerServer RPCs: a one-node site keeps it on loopback
    # (trainer.modes.ft), so the rogue learns not even the checkpoint metadata (over gloo: the sites' heal URLs)
    assert s["rogue"]["metadata"] == []
    # no port of either site serves torchft's HTTP checkpoint path (heal state travels over the mesh)
    assert s["rogue"]["http"] == []
    # and over TLS, whatever port it tried, it never received one byte of application data
    assert all(t["app_bytes"] == 0 for t in s["rogue"]["tls"]), s["rogue"]["tls"]
    heals = [e for e in s["events"]["site1"] if e.event == "heal" and e.t > s["t_resume"]]
    assert heals and heals[0].round > 0  # a heal did happen meanwhile, from site0, over the run's TLS mesh


def test_a_rogue_cannot_contribute_to_a_round(tls_siege):
    s = tls_siege
    probes = s["rogue"]["tls"]
    assert {t["cred"] for t in probes} == {"none", "foreign CA"}
    assert all(t["app_bytes"] == 0 for t in probes)
    # site0's ring listener handshook the rogue's held connections at the quorum after site1's return,
    # and refused them before reading a byte
    refused = [x for x in s["logs"]["site0"].splitlines()
               if "refused a connection from" in x and s["rogue_address"] in x]
    assert refused, (probes, [x for x in s["logs"]["site0"].splitlines() if "refused" in x or "transport" in x][-20:])
    # the run completed: every round committed, both sites end on the same finite perplexity
    assert s["state"]["state"] == "finished", s["state"]
    for site, rows in s["rounds"].items():
        # at most the round site1's kill interrupted went uncommitted
        assert rows[-1].round == ROUNDS and len([x for x in rows if not x.committed]) <= 1, site
    ppl = [[x.val_ppl for x in s["rounds"][site] if x.val_ppl is not None][-1] for site in ("site0", "site1")]
    assert ppl[0] == ppl[1] and ppl[0] < 50


def test_a_rogue_checkpoint_never_runs_on_a_healing_site(tls_siege):
    s = tls_siege
    assert not s["marker"].exists()
    assert s["rogue"]["http_requests"] == 0  # no healing site ever asked the rogue for state
    heal = [e for e in s["events"]["site1"] if e.event == "heal" and e.t > s["t_resume"]]
    assert heal and all("live peer" in e.message for e in heal)  # it healed, and from the run's own site0
