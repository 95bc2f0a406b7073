"""The goodput ledger (issue 36) adds up: useful time plus lost time by cause is the wall time, per site,
and each cause gets what the records say."""

from __future__ import annotations

import pytest

from dilococtl import goodput
from dilococtl.spec import spec_from_dict
from dilococtl.store import Store
from trainer.records import EventRecord, RoundRecord, to_line


def _round(n: int, t: float, *, compute: float = 8.0, sync: float = 2.0, quorum: float = 0.5,
           committed: bool = True) -> str:
    return to_line(RoundRecord(round=n, step=n * 10, h=10, compute_s=compute, sync_s=sync, bytes_sent=0,
                               bytes_recv=0, k_active=2, k_nominal=2, outer_lr=0.7, committed=committed,
                               quorum_s=quorum, t=t))


def _event(name: str, t: float, **detail) -> str:
    return to_line(EventRecord(event=name, detail=detail, t=t))


@pytest.fixture
def run(tmp_path):
    with Store.open() as store:
        spec = spec_from_dict({"run": {"name": "gp"}, "diloco": {"h": 10, "rounds": 9},
                               "sites": [{"name": n, "hosts": ["local"], "work_dir": str(tmp_path / "w")}
                                         for n in ("a", "b")]}, str(tmp_path / "spec.toml"))
        r = store.create_run(spec)
        yield store, r


def test_steady_rounds_are_useful_exchange_and_straggler_time(run):
    store, r = run
    t0 = r.created
    # started 5 s after launch, three rounds of 8 s compute + 2 s sync (0.5 s of it the quorum)
    store.ingest(r.id, "a", "h", "/m", 1, [_event("start", t0 + 5)] + [_round(i, t0 + 5 + 10 * i) for i in (1, 2, 3)])
    led = goodput.ledger(store.get_run(r.id), store, now=t0 + 40)
    (a,) = led.sites
    assert a.wall_s == pytest.approx(40)
    assert a.useful_s == pytest.approx(24)
    assert a.lost_s["exchange"] == pytest.approx(4.5) and a.lost_s["straggler"] == pytest.approx(1.5)
    assert a.lost_s["other"] == pytest.approx(10)  # start-up (5) and the tail after round 3 (5)
    assert a.useful_s + sum(a.lost_s.values()) == pytest.approx(a.wall_s)
    assert led.goodput == pytest.approx(24 / 40)
    assert led.to_json()["lost_s"]["exchange"] == pytest.approx(4.5)


def test_a_stall_a_relaunch_and_a_failed_round_each_land_in_their_cause(run):
    store, r = run
    t0 = r.created
    lines = [_event("start", t0), _round(1, t0 + 10), _round(2, t0 + 20)]
    # round 3: the Lighthouse died as the site began to wait (+28); the first failed probe came 5 s later,
    # the round committed at +60
    lines += [_event("coordinator_unreachable", t0 + 34, since=t0 + 33), _round(3, t0 + 60, sync=32, quorum=31)]
    # round 4 was not committed
    lines += [_round(4, t0 + 70, committed=False)]
    # killed 5 s into round 5; relaunched at +90, its round 5 began at +100 (load and heal) and ended at +110
    lines += [_event("start", t0 + 90), _round(5, t0 + 110)]
    store.ingest(r.id, "b", "h", "/m", 1, lines)
    (b,) = goodput.ledger(store.get_run(r.id), store, now=t0 + 110).sites
    assert b.lost_s["failure_detection"] == pytest.approx(32)  # the wait from +28 to round 3's record at +60
    assert b.lost_s["straggler"] == pytest.approx(0.5 * 4)  # rounds 1, 2, 4, 5: the stall took round 3's wait
    assert b.lost_s["exchange"] == pytest.approx(1.5 * 4)
    assert b.lost_s["discarded"] == pytest.approx(8)
    assert b.lost_s["restart"] == pytest.approx(30)  # +70 (last round) to +100 (first round's start)
    assert b.useful_s == pytest.approx(32)
    assert b.useful_s + sum(b.lost_s.values()) == pytest.approx(b.wall_s) and b.lost_s["other"] >= 0


def test_no_rounds_no_sites_and_no_goodput(run):
    store, r = run
    led = goodput.ledger(store.get_run(r.id), store, now=r.created + 5)
    assert led.sites == [] and led.goodput is None and led.lost_s == dict.fromkeys(goodput.CAUSES, 0.0)


@pytest.mark.parametrize("since", [-1e300, 5e9])  # NaN and inf never reach the store (records are strict JSON)
def test_a_site_s_hostile_outage_start_keeps_the_ledger_finite_and_inside_the_wall(run, since):
    import math

    store, r = run
    t0 = r.created
    store.ingest(r.id, "a", "h", "/m", 1, [_event("start", t0), _round(1, t0 + 10),
                                           _event("coordinator_unreachable", t0 + 14, since=since),
                                           _round(2, t0 + 40, sync=22, quorum=21)])
    (a,) = goodput.ledger(store.get_run(r.id), store, now=t0 + 40).sites
    assert all(math.isfinite(v) and v >= 0 for v in a.lost_s.values())
    assert a.useful_s + sum(a.lost_s.values()) == pytest.approx(a.wall_s)
    assert a.lost_s["failure_detection"] == pytest.approx(22)  # round 2's wait, whatever the site claimed
    assert a.useful_s == pytest.approx(16)
