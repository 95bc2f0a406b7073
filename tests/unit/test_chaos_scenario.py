"""`lab chaos` scenarios: parsing, every refusal (one line naming the fault), conflicts, jitter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dilococtl.errors import BadInput
from dilococtl.lab import chaos, model, scenario

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lab() -> model.LabState:
    """3 sites x 2 nodes, planned only (nothing created)."""
    return model.plan(lab_id="abcd", block="10.250.0.0/16", sites=3, nodes_per_site=2, rate_bit=50_000_000,
                      rtt_ms=80.0, links=[], python="/usr/bin/python3")


def one(body: str, top: str = "") -> str:
    return f"{top}\n[[fault]]\n{body}\n"


GOOD = """
jitter = "5s"
[[fault]]
at = "90s"
kind = "kill"
target = "site2"
restart_after = "20s"
[[fault]]
at = "3m"
kind = "cut"
target = "site0-site1"
for = "30s"
[[fault]]
at = "1m30s"
kind = "degrade"
target = "site1-site2"
rtt = "3x"
for = 30
[[fault]]
at = 400
kind = "loss"
target = "site0-site2"
percent = 1
for = "1m"
[[fault]]
at = "5m"
kind = "flap"
target = "site0-site1"
for = "40s"
period = "10s"
[[fault]]
at = "5m"
kind = "slow"
target = "site1-n0"
factor = 2.0
for = "2m"
"""


def test_a_good_scenario_parses_every_kind(lab):
    sc = scenario.parse(GOOD, lab)
    assert sc.jitter_s == 5.0
    assert [(f.index, f.kind, f.at_s, f.for_s) for f in sc.faults] == [
        (1, "kill", 90.0, 0.0), (2, "cut", 180.0, 30.0), (3, "degrade", 90.0, 30.0), (4, "loss", 400.0, 60.0),
        (5, "flap", 300.0, 40.0), (6, "slow", 300.0, 120.0)]
    kill, cut, degrade, loss, flap, slow = sc.faults
    assert kill.restart_after_s == 20.0 and kill.grace_s == 5.0 and kill.nodes == ("site2-n0", "site2-n1")
    assert cut.sites == ("site0", "site1") and degrade.rtt == "3x" and degrade.rate == ""
    assert loss.percent == 1.0 and flap.period_s == 10.0
    assert slow.nodes == ("site1-n0",) and slow.sites == ("site1",) and slow.site == "site1" and cut.site == ""
    assert cut.describe() == "cut site0-site1 for 30s"
    assert kill.describe() == "kill site2, relaunch after 20s"


@pytest.mark.parametrize("text,want", [
    ("1m30s", 90.0), ("90s", 90.0), ("3m", 180.0), ("500ms", 0.5), ("1h", 3600.0), ("1.5s", 1.5), (45, 45.0),
    (2.5, 2.5), (0, 0.0)])
def test_durations(text, want):
    assert scenario.duration(text, "at", scenario.MAX_AT_S) == want


@pytest.mark.parametrize("body,msg", [
    # unknown kind, unknown key, missing keys
    ('at = "1s"\nkind = "explode"\ntarget = "site0"', "fault 1: unknown kind 'explode'"),
    ('at = "1s"\ntarget = "site0"', "fault 1: missing key 'kind'"),
    ('at = "1s"\nkind = "cut"\ntarget = "site0"\nfor = "5s"\nfo = "5s"', "fault 1 (cut): unknown key 'fo'"),
    ('at = "1s"\nkind = "kill"\ntarget = "site0"\nfor = "5s"', "fault 1 (kill): unknown key 'for'"),
    ('kind = "cut"\ntarget = "site0"\nfor = "5s"', "fault 1 (cut): missing key 'at'"),
    ('at = "1s"\nkind = "cut"\nfor = "5s"', "fault 1 (cut): missing key 'target'"),
    ('at = "1s"\nkind = "cut"\ntarget = "site0"', "fault 1 (cut): missing key 'for'"),
    ('at = "1s"\nkind = "loss"\ntarget = "site0-site1"\nfor = "5s"', "fault 1 (loss): missing key 'percent'"),
    ('at = "1s"\nkind = "slow"\ntarget = "site0"\nfor = "5s"', "fault 1 (slow): missing key 'factor'"),
    ('at = "1s"\nkind = "degrade"\ntarget = "site0-site1"\nfor = "5s"', "a degrade needs rate and/or rtt"),
    # bad durations
    ('at = "90"\nkind = "cut"\ntarget = "site0"\nfor = "5s"', "fault 1 (cut): at: bad duration '90'"),
    ('at = "1x"\nkind = "cut"\ntarget = "site0"\nfor = "5s"', "fault 1 (cut): at: bad duration '1x'"),
    ('at = "1s2"\nkind = "cut"\ntarget = "site0"\nfor = "5s"', "at: bad duration '1s2'"),
    ('at = "-5s"\nkind = "cut"\ntarget = "site0"\nfor = "5s"', "at: bad duration '-5s'"),
    ('at = -5\nkind = "cut"\ntarget = "site0"\nfor = "5s"', "at: -5 must be a finite number of seconds >= 0"),
    ('at = nan\nkind = "cut"\ntarget = "site0"\nfor = "5s"', "at: nan must be a finite"),
    ('at = inf\nkind = "cut"\ntarget = "site0"\nfor = "5s"', "at: inf must be a finite"),
    ('at = 1e300\nkind = "cut"\ntarget = "site0"\nfor = "5s"', "is longer than the most allowed"),
    ('at = "99999999h"\nkind = "cut"\ntarget = "site0"\nfor = "5s"', "is longer than the most allowed"),
    ('at = true\nkind = "cut"\ntarget = "site0"\nfor = "5s"', "at: True is not a duration"),
    ('at = "1s"\nkind = "cut"\ntarget = "site0"\nfor = 0', "fault 1 (cut): for must be longer than 0s"),
    ('at = "1s"\nkind = "cut"\ntarget = "site0"\nfor = "2d"', "for: bad duration '2d'"),
    ('at = "1s"\nkind = "kill"\ntarget = "site0"\nrestart_after = -1', "restart_after: -1 must be"),
    ('at = "1s"\nkind = "kill"\ntarget = "site0"\ngrace = "1h"', "grace: '1h' is longer than the most"),
    # numbers out of range, NaN, inf, wrong types
    ('at = "1s"\nkind = "loss"\ntarget = "site0-site1"\nfor = "5s"\npercent = 0', "percent: 0 must be in (0, 50]"),
    ('at = "1s"\nkind = "loss"\ntarget = "site0-site1"\nfor = "5s"\npercent = 51', "percent: 51 must be in (0, 50]"),
    ('at = "1s"\nkind = "loss"\ntarget = "site0-site1"\nfor = "5s"\npercent = nan', "percent: nan must be in"),
    ('at = "1s"\nkind = "loss"\ntarget = "site0-site1"\nfor = "5s"\npercent = "1%"', "percent: '1%' is not a number"),
    ('at = "1s"\nkind = "slow"\ntarget = "site0"\nfor = "5s"\nfactor = 1', "factor: 1 must be in (1, 20]"),
    ('at = "1s"\nkind = "slow"\ntarget = "site0"\nfor = "5s"\nfactor = 21', "factor: 21 must be in (1, 20]"),
    ('at = "1s"\nkind = "slow"\ntarget = "site0"\nfor = "5s"\nfactor = inf', "factor: inf must be in"),
    ('at = "1s"\nkind = "slow"\ntarget = "site0"\nfor = "5s"\nfactor = -2', "factor: -2 must be in"),
    ('at = "1s"\nkind = "flap"\ntarget = "site0-site1"\nfor = "5s"\nperiod = "10s"', "period (10s) is longer than"),
    ('at = "1s"\nkind = "flap"\ntarget = "site0-site1"\nfor = "5s"\nperiod = "100ms"', "period must be at least 1s"),
    ('at = "1s"\nkind = "degrade"\ntarget = "site0-site1"\nfor = "5s"\nrate = "50mbps"', "rate: bad rate '50mbps'"),
    ('at = "1s"\nkind = "degrade"\ntarget = "site0-site1"\nfor = "5s"\nrtt = "0x"', "rtt: '0x': the factor"),
    ('at = "1s"\nkind = "degrade"\ntarget = "site0-site1"\nfor = "5s"\nrtt = "nanx"', "rtt: bad duration 'nanx'"),
    ('at = "1s"\nkind = "degrade"\ntarget = "site0-site1"\nfor = "5s"\nrtt = 80', "rtt: 80 must be a string"),
    ('at = "1s"\nkind = "degrade"\ntarget = "site0-site1"\nfor = "5s"\nrtt = "20s"', "rtt: bad duration '20s'"),
    # targets that are no site, node or link of this lab
    ('at = "1s"\nkind = "kill"\ntarget = "site9"', "fault 1 (kill): target 'site9' is no site or node"),
    ('at = "1s"\nkind = "slow"\ntarget = "site0-n7"\nfor = "5s"\nfactor = 2', "target 'site0-n7' is no site or node"),
    ('at = "1s"\nkind = "cut"\ntarget = "site0-site9"\nfor = "5s"', "target 'site0-site9' is not a link A-B or a site"),
    ('at = "1s"\nkind = "cut"\ntarget = "site0-n0"\nfor = "5s"', "target 'site0-n0' is not a link A-B or a site"),
    ('at = "1s"\nkind = "cut"\ntarget = "site0-site0"\nfor = "5s"', "target 'site0-site0' is not a link"),
    ('at = "1s"\nkind = "loss"\ntarget = "site0"\nfor = "5s"\npercent = 1', "target 'site0' is not a link A-B of"),
    ('at = "1s"\nkind = "cut"\ntarget = ""\nfor = "5s"', "target must be a non-empty string"),
    ('at = "1s"\nkind = "cut"\ntarget = 3\nfor = "5s"', "target must be a non-empty string"),
])
def test_bad_faults_are_refused_in_one_line_naming_the_fault(lab, body, msg):
    with pytest.raises(BadInput) as e:
        scenario.parse(one(body), lab)
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text,msg", [
    ("", "no faults: write one [[fault]] table per fault"),
    ("fault = 3", "no faults"),
    ("[fault]\nat = 1", "no faults"),
    ("bogus = 1\n" + one('at = "1s"\nkind = "cut"\ntarget = "site0"\nfor = "5s"'), "unknown top-level key 'bogus'"),
    ('jitter = "-1s"\n' + one('at = "1s"\nkind = "cut"\ntarget = "site0"\nfor = "5s"'), "jitter: bad duration"),
    ('jitter = "2h"\n' + one('at = "1s"\nkind = "cut"\ntarget = "site0"\nfor = "5s"'), "jitter: '2h' is longer"),
    ("[[fault]\n", "not valid TOML"),
])
def test_bad_scenarios_are_refused(lab, text, msg):
    with pytest.raises(BadInput) as e:
        scenario.parse(text, lab, path="s.toml")
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_the_second_fault_is_named_by_its_index(lab):
    text = one('at = "1s"\nkind = "cut"\ntarget = "site0"\nfor = "5s"') + \
        one('at = "1s"\nkind = "slow"\ntarget = "site1"\nfor = "5s"\nfactor = 99')
    with pytest.raises(BadInput, match=r"^fault 2 \(slow\): factor: 99 must be in \(1, 20\]$"):
        scenario.parse(text, lab)


@pytest.mark.parametrize("a,b,conflict", [
    # cut while cut, on one link; a site cut holds every link of the site
    ('at = "10s"\nkind = "cut"\ntarget = "site0-site1"\nfor = "30s"',
     'at = "20s"\nkind = "cut"\ntarget = "site1-site0"\nfor = "5s"', "on link site0-site1 (cut/flap)"),
    ('at = "10s"\nkind = "cut"\ntarget = "site1"\nfor = "30s"',
     'at = "20s"\nkind = "flap"\ntarget = "site0-site1"\nfor = "10s"', "on link site0-site1 (cut/flap)"),
    ('at = "10s"\nkind = "degrade"\ntarget = "site0-site1"\nfor = "30s"\nrate = "1mbit"',
     'at = "39s"\nkind = "degrade"\ntarget = "site0-site1"\nfor = "30s"\nrtt = "2x"', "(degrade)"),
    ('at = "10s"\nkind = "loss"\ntarget = "site0-site1"\nfor = "30s"\npercent = 1',
     'at = "0s"\nkind = "loss"\ntarget = "site1-site0"\nfor = "11s"\npercent = 2', "(loss)"),
    ('at = "10s"\nkind = "slow"\ntarget = "site1"\nfor = "30s"\nfactor = 2',
     'at = "20s"\nkind = "slow"\ntarget = "site1-n1"\nfor = "30s"\nfactor = 3', "on node site1-n1 (slow)"),
    ('at = "10s"\nkind = "kill"\ntarget = "site1"\nrestart_after = "20s"',
     'at = "40s"\nkind = "kill"\ntarget = "site1-n0"', "on node site1-n0 (kill)"),
    # no conflict: back to back, other links, other kinds on one link
    ('at = "10s"\nkind = "cut"\ntarget = "site0-site1"\nfor = "30s"',
     'at = "40s"\nkind = "cut"\ntarget = "site0-site1"\nfor = "5s"', None),
    ('at = "10s"\nkind = "cut"\ntarget = "site0-site1"\nfor = "30s"',
     'at = "20s"\nkind = "cut"\ntarget = "site1-site2"\nfor = "30s"', None),
    ('at = "10s"\nkind = "cut"\ntarget = "site0-site1"\nfor = "30s"',
     'at = "20s"\nkind = "loss"\ntarget = "site0-site1"\nfor = "30s"\npercent = 1', None),
    ('at = "10s"\nkind = "kill"\ntarget = "site1"\nrestart_after = "20s"',
     'at = "20s"\nkind = "slow"\ntarget = "site1"\nfor = "30s"\nfactor = 2', None),
])
def test_overlapping_faults_on_one_link_or_node_conflict(lab, a, b, conflict):
    text = one(a) + one(b)
    if conflict is None:
        assert len(scenario.parse(text, lab).faults) == 2
        return
    with pytest.raises(BadInput) as e:
        scenario.parse(text, lab)
    assert str(e.value).startswith("fault 2 (") and "overlaps fault 1" in str(e.value) and conflict in str(e.value)


def test_jitter_widens_the_conflict_check(lab):
    text = one('at = "10s"\nkind = "cut"\ntarget = "site0-site1"\nfor = "30s"') + \
        one('at = "45s"\nkind = "cut"\ntarget = "site0-site1"\nfor = "5s"')
    assert len(scenario.parse(text, lab).faults) == 2
    with pytest.raises(BadInput, match="within the jitter of 3s"):
        scenario.parse('jitter = "3s"\n' + text, lab)


def test_same_seed_same_schedule_and_jitter_stays_in_bounds(lab):
    sc = scenario.parse(GOOD, lab)
    a, b, c = scenario.plan(sc, 7), scenario.plan(sc, 7), scenario.plan(sc, 8)
    assert a.to_json() == b.to_json() and a.seed == 7
    assert [p.at_s for p in a.items] != [p.at_s for p in c.items]
    for p in a.items:
        assert abs(p.at_s - p.fault.at_s) <= 5.0 and p.at_s != p.fault.at_s
    assert [p.at_s for p in a.items] == sorted(p.at_s for p in a.items)
    # the draw is random.Random(seed).uniform per fault, in scenario order
    import random

    rng = random.Random(7)
    want = {f.index: f.at_s + rng.uniform(-5, 5) for f in sc.faults}
    assert {p.fault.index: p.at_s for p in a.items} == pytest.approx(want)


def test_no_jitter_keeps_times_and_jitter_never_goes_before_the_start(lab):
    sc = scenario.parse(one('at = "1s"\nkind = "cut"\ntarget = "site0"\nfor = "5s"'), lab)
    assert [p.at_s for p in scenario.plan(sc, 3).items] == [1.0]
    sc = scenario.parse('jitter = "1h"\n' + one('at = "1s"\nkind = "cut"\ntarget = "site0"\nfor = "5s"'), lab)
    assert all(scenario.plan(sc, s).items[0].at_s >= 0 for s in range(20))
    assert scenario.plan(sc).seed >= 0  # no --seed: one is drawn and reported
    with pytest.raises(BadInput, match="--seed"):
        scenario.plan(sc, -1)


def test_the_standard_playbook_is_valid_for_the_3_site_lab():
    lab = model.plan(lab_id="abcd", block="10.250.0.0/16", sites=3, nodes_per_site=1, rate_bit=50_000_000,
                     rtt_ms=80.0, links=[], python="/usr/bin/python3")
    sc = scenario.load(ROOT / "playbooks" / "chaos-standard.toml", lab)
    kinds = [f.kind for f in sc.faults]
    kills = [f for f in sc.faults if f.kind == "kill"]
    assert sorted(f.target for f in kills) == ["site0", "site1", "site2"]
    assert all(f.restart_after_s == 20.0 for f in kills)
    assert [f.for_s for f in sc.faults if f.kind == "cut"] == [30.0]
    (slow,) = [f for f in sc.faults if f.kind == "slow"]
    assert slow.factor == 2.0
    (spike,) = [f for f in sc.faults if f.kind == "degrade"]
    assert spike.rtt == "3x" and spike.for_s == 30.0
    (loss,) = [f for f in sc.faults if f.kind == "loss"]
    assert loss.percent == 1.0 and loss.for_s == 60.0
    assert set(kinds) == {"kill", "cut", "slow", "degrade", "loss"}
    # at most two faults at once (kills held for grace + relaunch delay)
    spans = [(f.at_s, f.at_s + (f.grace_s + f.restart_after_s if f.kind == "kill" else f.for_s)) for f in sc.faults]
    for t, _ in spans:
        assert sum(a <= t < b for a, b in spans) <= 2


# --- which run chaos replays against --------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    from dilococtl.store import Store

    with Store.open(tmp_path / "state.db") as s:
        yield s


def lab_at(block: str) -> model.LabState:
    return model.plan(lab_id="abcd", block=block, sites=3, nodes_per_site=1, rate_bit=50_000_000,
                      rtt_ms=80.0, links=[], python="/usr/bin/python3")


def test_the_newest_running_run_of_this_lab_is_chosen(store):
    from dilococtl.spec import load_spec
    from dilococtl.states import RunState

    spec = load_spec(ROOT / "playbooks" / "lab-3site.toml")  # hosts 10.210.(i+1).10: a lab on 10.210.0.0/16
    old = store.create_run(spec)
    store.set_run_state(old.id, RunState.RUNNING)
    store.set_run_state(old.id, RunState.FINISHED)
    run = store.create_run(spec, run_id="20990101-000000-beef")
    store.set_run_state(run.id, RunState.RUNNING)
    said = []
    assert chaos.choose_run(store, None, lab_at("10.210.0.0/16"), said.append).id == run.id
    assert chaos.choose_run(store, run.id[:8], lab_at("10.210.0.0/16"), said.append).id == run.id
    with pytest.raises(BadInput, match=r"^run 20990101-000000-beef is not a run of this lab \(abcd\): 10\.210\.1\.10 is no lab node$"):
        chaos.choose_run(store, None, lab_at("10.250.0.0/16"), said.append)
    with pytest.raises(BadInput, match="is finished: chaos replays faults against a running run"):
        chaos.choose_run(store, old.id, lab_at("10.210.0.0/16"), said.append)
    store.set_run_state(run.id, RunState.STOPPED)
    with pytest.raises(BadInput, match="no running run in this DILOCOCTL_HOME"):
        chaos.choose_run(store, None, lab_at("10.210.0.0/16"), said.append)


def test_a_launching_run_gets_its_wait_then_a_clear_refusal(store):
    from dilococtl.spec import load_spec

    run = store.create_run(load_spec(ROOT / "playbooks" / "lab-3site.toml"))  # launching, never starts
    said = []
    with pytest.raises(BadInput, match=f"run {run.id} is still launching after 1s"):
        chaos.choose_run(store, None, lab_at("10.210.0.0/16"), said.append, wait_s=1.0)
    assert said == [f"chaos: run {run.id} is launching; waiting up to 1s for it to start"]


def test_a_relaunching_kill_must_hit_a_node_of_the_run(store):
    from dilococtl.spec import load_spec

    lab = model.plan(lab_id="abcd", block="10.210.0.0/16", sites=4, nodes_per_site=1, rate_bit=50_000_000,
                     rtt_ms=80.0, links=[], python="/usr/bin/python3")
    run = store.create_run(load_spec(ROOT / "playbooks" / "lab-3site.toml"))  # sites 0..2 of the 4
    ok = scenario.parse(one('at = "1s"\nkind = "kill"\ntarget = "site3"'), lab)  # no relaunch: fine
    chaos.check_kills(ok, run, store, lab)
    bad = scenario.parse(one('at = "1s"\nkind = "kill"\ntarget = "site3-n0"\nrestart_after = "5s"'), lab)
    with pytest.raises(BadInput, match=r"^fault 1 \(kill site3-n0, relaunch after 5s\): site3-n0 runs no site of run"):
        chaos.check_kills(bad, run, store, lab)


def test_a_replay_against_a_run_that_ended_applies_nothing(store, tmp_path):
    import threading

    from dilococtl.spec import load_spec
    from dilococtl.states import RunState

    lab = lab_at("10.210.0.0/16")
    run = store.create_run(load_spec(ROOT / "playbooks" / "lab-3site.toml"))
    store.set_run_state(run.id, RunState.RUNNING)
    store.set_run_state(run.id, RunState.FINISHED)
    sc = scenario.parse(one('at = "1s"\nkind = "cut"\ntarget = "site0"\nfor = "5s"')
                     + one('at = "2s"\nkind = "kill"\ntarget = "site1"\nrestart_after = "1s"'), lab)
    said: list[str] = []
    replay = chaos.Replay(scenario.plan(sc, 0), state=lab, run_id=run.id, start=run.created,
                          store_path=tmp_path / "state.db", say=said.append, stop=threading.Event())
    outcomes = replay.run()
    assert [(o.index, o.applied_at, o.ended_at, o.detail) for o in outcomes] == [
        (1, None, None, {"skipped": "the run was finished first"}),
        (2, None, None, {"skipped": "the run was finished first"})]
    assert said == [f"chaos: run {run.id} is finished: the 2 fault(s) not yet applied are skipped"]
    assert store.events(run.id, kinds=["chaos"]) == []


def test_the_cli_refuses_without_a_lab_in_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from dilococtl.cli import app

    monkeypatch.setenv("DILOCOCTL_HOME", str(tmp_path))
    r = CliRunner().invoke(app, ["lab", "chaos", str(ROOT / "playbooks" / "chaos-standard.toml"), "--json"])
    assert r.exit_code == 2
    assert len(r.stderr.strip().splitlines()) == 1
    err = json.loads(r.stdout)
    assert err["exit"] == 2 and ("no lab is up in this DILOCOCTL_HOME" in err["error"] or "needs root" in err["error"])
