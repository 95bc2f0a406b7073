"""`dilococtl lab chaos` on the emulated WAN, as a user types it: a bad scenario is refused in one line
with nothing applied; a chaos stopped by SIGTERM restores every link and process (exit 143); a
scenario with each fault kind once replays against a running 3-site run (exit 0), every fault and
its restore land in the run's events, the killed site is relaunched, and the run finishes with a
finite perplexity, every link back to its shape, no chaos rule left and no process left stopped.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomlkit

from dilococtl.lab import faults, model
from dilococtl.store import Store
from tests.e2e.conftest import cli, dctl, lab_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]
NAME = "chaos-e2e"
ROUNDS = 80  # ~1 s a round here: the killed site is back well before the others finish


@pytest.fixture(scope="module")
def chaoslab(tmp_path_factory):
    yield from lab_up(tmp_path_factory, "chaoslab", "--sites", "3", "--rate", "50mbit", "--rtt", "40ms",
                      runs=(NAME,))


def lab_state(home: Path) -> model.LabState:
    return model.from_json((home / "lab" / "state.json").read_text())


def shapes(home: Path) -> dict:
    st = json.loads(dctl(home, "status", "--json").stdout)
    return {x["link"]: (x["rate_bit"], x["delay_ms"], x["cut"]) for x in st["links"]}


def chaos_rules(home: Path) -> list[str]:
    """The DROP / statistic rules chaos holds in the core, as `lab status --json` lists them."""
    return json.loads(dctl(home, "status", "--json").stdout)["chaos_rules"]


def stopped(home: Path) -> list[int]:
    return faults.stopped_processes([n.netns for n in lab_state(home).nodes])


def chaos(home: Path, scenario: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "DILOCOCTL_HOME": str(home)}
    return subprocess.Popen([sys.executable, "-m", "dilococtl", "lab", "chaos", str(scenario), *args], cwd=ROOT,
                            env=env, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def chaos_events(home: Path, run_id: str, after_id: int = 0) -> list:
    with Store.open(home / "state.db") as store:
        return store.events(run_id, kinds=["chaos"], after_id=after_id)


def until(what, timeout: float, msg: str):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, msg
        time.sleep(0.3)
    return got


def test_a_bad_scenario_is_refused_in_one_line_and_nothing_is_applied(chaoslab):
    home, _ = chaoslab
    bad = home / "bad.toml"
    bad.write_text('[[fault]]\nat = "1s"\nkind = "cut"\ntarget = "site0-site1"\nfor = "5s"\n'
                   '[[fault]]\nat = "2s"\nkind = "slow"\ntarget = "site1"\nfor = "5s"\nfactor = 99\n')
    r = cli(home, "lab", "chaos", str(bad), "--json")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: fault 2 (slow): factor: 99 must be in (1, 20]"]
    assert json.loads(r.stdout) == {"error": "fault 2 (slow): factor: 99 must be in (1, 20]", "exit": 2}
    bad.write_text('[[fault]]\nat = "1s"\nkind = "loss"\ntarget = "site0-site9"\nfor = "5s"\npercent = 1\n')
    r = cli(home, "lab", "chaos", str(bad), "--dry-run")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "fault 1 (loss): target 'site0-site9' is not a link A-B of this lab" in r.stderr
    assert chaos_rules(home) == [] and stopped(home) == []
    r = cli(home, "lab", "chaos", str(ROOT / "playbooks" / "chaos-standard.toml"), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    assert [f["kind"] for f in json.loads(r.stdout)["faults"]].count("kill") == 3


def test_every_fault_kind_replays_against_a_run_and_everything_is_restored(chaoslab):
    home, spec = chaoslab
    doc = tomlkit.parse(spec.read_text())
    doc["run"]["name"] = NAME
    doc["run"]["grace_s"] = 4  # inside the kill's 5 s grace: the trainer saves on SIGTERM, then exits
    doc["diloco"].update(rounds=ROUNDS, h=10)
    path = home / f"{NAME}.toml"
    path.write_text(tomlkit.dumps(doc))
    before = shapes(home)
    env = {**os.environ, "DILOCOCTL_HOME": str(home)}
    launch = subprocess.Popen([sys.executable, "-m", "dilococtl", "launch", str(path), "--wait", "--json"],
                              cwd=ROOT, env=env, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        # 1. a chaos stopped by SIGTERM while four faults hold: everything restored, exit 143
        held = home / "held.toml"
        held.write_text("\n".join(
            f'[[fault]]\nat = 0\nkind = "{k}"\ntarget = "{t}"\nfor = "5m"\n{extra}' for k, t, extra in (
                ("slow", "site0", "factor = 5"), ("cut", "site1", ""),
                ("degrade", "site0-site2", 'rate = "1mbit"\nrtt = "200ms"'),
                ("loss", "site1-site2", "percent = 50"))))
        run_id = until(lambda: cli(home, "runs", "--json").returncode == 0 and next(
            (r["id"] for r in json.loads(cli(home, "runs", "--json").stdout) if r["name"] == NAME), None),
            60, "the run was never recorded")
        p = chaos(home, held, "--json")  # no --run: the newest run, waited for while it launches
        until(lambda: len(chaos_events(home, run_id)) >= 4 or p.poll() is not None, 90,
              "the held faults never all started")
        assert p.poll() is None, p.communicate()
        rules = chaos_rules(home)
        assert sum("statistic" not in x for x in rules) == 4 and sum("statistic" in x for x in rules) == 2, rules
        assert shapes(home)["site0>site2"][:2] == (1_000_000, 100.0)
        assert until(lambda: stopped(home), 5, "no process of site0 was ever seen stopped")
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 143, err
        summary = json.loads(out)
        assert summary["interrupted"] == "SIGTERM"
        assert all(f["applied_at"] is not None and f["ended_at"] is not None for f in summary["faults"]), summary
        assert chaos_rules(home) == [] and shapes(home) == before and stopped(home) == []
        held_events = chaos_events(home, run_id)
        assert sorted((e.detail["fault"], e.detail["phase"]) for e in held_events) == \
            sorted((i, ph) for i in range(1, 5) for ph in ("start", "end"))
        assert all("chaos stopped early" in e.message for e in held_events if e.detail["phase"] == "end")

        # 2. each kind once, from a few seconds after the sites train
        def rounds() -> int:
            with Store.open(home / "state.db") as store:
                latest = store.latest_rounds(run_id)
            return min((r.round for r in latest.values()), default=0) if len(latest) == 3 else 0

        until(lambda: rounds() >= 2, 120, "the sites never trained 2 rounds")
        with Store.open(home / "state.db") as store:
            t0 = time.time() - store.get_run(run_id).created + 6  # chaos starts in ~2 s
        every = home / "every.toml"
        every.write_text(f"""
[[fault]]
at = {t0:.1f}
kind = "slow"
target = "site1"
factor = 3
for = "8s"
[[fault]]
at = {t0 + 1:.1f}
kind = "cut"
target = "site0-site1"
for = "6s"
[[fault]]
at = {t0 + 1:.1f}
kind = "loss"
target = "site0-site2"
percent = 10
for = "10s"
[[fault]]
at = {t0 + 8:.1f}
kind = "degrade"
target = "site1-site2"
rtt = "3x"
rate = "10mbit"
for = "6s"
[[fault]]
at = {t0 + 12:.1f}
kind = "flap"
target = "site0-site2"
for = "6s"
period = "2s"
[[fault]]
at = {t0 + 15:.1f}
kind = "kill"
target = "site2"
restart_after = "5s"
""")
        seen = max((e.id for e in held_events), default=0)
        p = chaos(home, every, "--json", "--seed", "1", "--run", run_id)
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        # right after chaos: links, rules and processes are as they were
        assert chaos_rules(home) == [] and shapes(home) == before and stopped(home) == []
        summary = json.loads(out)
        assert summary["run"] == run_id and summary["seed"] == 1 and summary["interrupted"] is None
        got = {f["kind"]: f for f in summary["faults"]}
        assert sorted(got) == sorted(["slow", "cut", "loss", "degrade", "flap", "kill"])
        for f in summary["faults"]:
            assert f["planned_at"] - 0.5 <= f["applied_at"] <= f["planned_at"] + 3, f
            assert f["ended_at"] >= f["applied_at"], f
        assert got["cut"]["ended_at"] - got["cut"]["applied_at"] == pytest.approx(6, abs=2)
        assert got["loss"]["detail"]["dropped_packets"] > 0  # xt_statistic drops in this kernel
        assert 0.5 < got["slow"]["detail"]["stopped_share"] < 0.8 and got["slow"]["detail"]["processes"] >= 1
        assert got["flap"]["detail"]["toggles"] == 6
        assert got["kill"]["detail"]["relaunched"] is True and got["kill"]["detail"]["attempt"] == 2
        events = chaos_events(home, run_id, after_id=seen)
        assert sorted((e.detail["fault"], e.detail["phase"]) for e in events) == \
            sorted((i, ph) for i in range(1, 7) for ph in ("start", "end"))
        by = {(e.detail["fault"], e.detail["phase"]): e for e in events}
        assert by[(2, "start")].message == "chaos: cut site0-site1 for 6s" and by[(2, "start")].site == ""
        assert by[(2, "end")].message == "chaos: site0-site1 restored"
        assert by[(6, "start")].site == "site2" and by[(6, "end")].message.startswith("chaos: site2 relaunched")
        # `dilococtl logs --json` shows them beside the run's own events
        r = cli(home, "logs", run_id, "--json")
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
        assert sum(x["record"]["event"] == "chaos" for x in lines if x["kind"] == "event") >= 12 + 8

        out, err = launch.communicate(timeout=240)
    finally:
        if launch.poll() is None:
            cli(home, "stop", NAME, "--grace", "5", timeout=60)
            launch.kill()
            launch.communicate()
    assert launch.returncode == 0, err[-3000:]
    st = json.loads(cli(home, "status", run_id, "--json").stdout)
    assert st["state"] == "finished" and math.isfinite(st["final_val_ppl"]), st
    assert [s["round"] for s in st["sites"]] == [ROUNDS] * 3
    with Store.open(home / "state.db") as store:
        assert [x.reason for x in store.launches(run_id, site="site2")] == ["launch", "resume"]
    assert chaos_rules(home) == [] and shapes(home) == before and stopped(home) == []
    print(f"\nchaos e2e: final val ppl {st['final_val_ppl']:.3f}; faults applied/ended (s from start): " + "; ".join(
        f"{f['kind']} {f['applied_at']:.1f}/{f['ended_at']:.1f}" for f in summary["faults"])
        + f"; loss dropped {got['loss']['detail']['dropped_packets']} packets; slow stopped share "
        f"{got['slow']['detail']['stopped_share']}")
