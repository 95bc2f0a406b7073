"""The goodput ledger per round (issue 36, what report plots): each round's useful and lost seconds, summed
over the sites, add up to the run's figures; lying records keep every figure finite and >= 0."""

from __future__ import annotations

import json
import math

import pytest

from dilococtl import goodput
from dilococtl.errors import BadInput
from dilococtl.spec import spec_from_dict
from dilococtl.store import Store
from tests.unit.test_goodput import _event, _round

FIELDS = ("useful", *goodput.CAUSES)


@pytest.fixture
def store():
    with Store.open() as s:
        yield s


def _run(store, tmp_path, *, end: float | None = 125.0):
    """Site a: six steady rounds. Site b: a Coordinator stall in round 3's wait, round 4 rolled back (not
    committed), killed in round 5 and relaunched (+90, its round 5 began at +100). Ended at +`end`."""
    spec = spec_from_dict({"run": {"name": "gpr"}, "diloco": {"h": 10, "rounds": 6},
                           "sites": [{"name": n, "hosts": ["local"], "work_dir": str(tmp_path / "w")}
                                     for n in ("a", "b")]}, str(tmp_path / "spec.toml"))
    r = store.create_run(spec, state="running")
    t0 = r.created
    store.ingest(r.id, "a", "h", "/m", 1, [_event("start", t0)] + [_round(i, t0 + 10 * i) for i in range(1, 7)])
    store.ingest(r.id, "b", "h", "/m", 1, [
        _event("start", t0), _round(1, t0 + 10), _round(2, t0 + 20),
        _event("coordinator_unreachable", t0 + 34, since=t0 + 33), _round(3, t0 + 60, sync=32, quorum=31),
        _round(4, t0 + 70, committed=False),
        _event("start", t0 + 90), _round(5, t0 + 110), _round(6, t0 + 120)])
    if end is not None:
        store.db.conn.execute("UPDATE runs SET state = 'finished', finished = ? WHERE id = ?", (t0 + end, r.id))
        store.db.conn.commit()
    return store.get_run(r.id)


def _table(led: goodput.Ledger) -> dict[int, dict[str, float]]:
    return {x.round: {"useful": x.useful_s, **x.lost_s} for x in led.rounds}


def _nonzero(row: dict[str, float]) -> dict[str, float]:
    return {k: pytest.approx(v) for k, v in row.items() if abs(v) > 1e-9}


def test_each_round_gets_its_stall_rollback_and_relaunch_and_the_rounds_add_up_to_the_run(store, tmp_path):
    run = _run(store, tmp_path)
    led = goodput.ledger(run, store, bucket=1)
    rows = _table(led)
    assert list(rows) == [1, 2, 3, 4, 5, 6] and all(x.rounds == 1 for x in led.rounds)
    steady = {"useful": 16, "exchange": 3, "straggler": 1}  # both sites: 8 s compute, 1.5 exchange, 0.5 quorum
    assert _nonzero(rows[1]) == _nonzero(rows[2]) == steady
    # b's stall took its whole wait of round 3 (+28 to +60): failure detection, not exchange or straggler
    assert _nonzero(rows[3]) == {"useful": 16, "exchange": 1.5, "straggler": 0.5, "failure_detection": 32}
    assert _nonzero(rows[4]) == {"useful": 8, "discarded": 8, "exchange": 3, "straggler": 1}  # b's rolled back
    assert _nonzero(rows[5]) == {**steady, "restart": 30}  # b: its last round (+70) to round 5's start (+100)
    # the run ended: the time after each site's last round is its last round's (a: +60 to +125, b: +120 to +125)
    assert _nonzero(rows[6]) == {**steady, "other": 65 + 5}
    # the rounds add up to the run's figures, and those are status's (no two records overlap here)
    status = goodput.ledger(run, store)
    for k in FIELDS:
        total = sum(s.useful_s for s in led.sites) if k == "useful" else led.lost_s[k]
        assert sum(r[k] for r in rows.values()) == pytest.approx(total), k
        assert total == pytest.approx(sum(s.useful_s for s in status.sites) if k == "useful" else status.lost_s[k])
    assert led.goodput == pytest.approx(status.goodput) == pytest.approx((48 + 40) / 250)
    assert status.rounds == []  # status and watch do not pay for the rounds
    for s in led.sites:
        assert s.wall_s == 125 and s.useful_s + sum(s.lost_s.values()) == pytest.approx(125)


def test_buckets_of_rounds_sum_their_rounds_and_a_live_run_s_tail_is_the_round_in_flight(store, tmp_path):
    run = _run(store, tmp_path, end=None)
    one = _table(goodput.ledger(run, store, now=run.created + 125, bucket=1))
    # running: the time after each site's last round is the round it is in (a: 7, b: 7)
    assert _nonzero(one[7]) == {"other": 70} and _nonzero(one[6]) == {"useful": 16, "exchange": 3, "straggler": 1}
    four = goodput.ledger(run, store, now=run.created + 125, bucket=4)
    assert [(x.round, x.rounds) for x in four.rounds] == [(1, 4), (5, 4)]
    for k in FIELDS:
        assert _table(four)[1][k] == pytest.approx(sum(one[r][k] for r in (1, 2, 3, 4)))
        assert _table(four)[5][k] == pytest.approx(sum(one[r][k] for r in (5, 6, 7)))
    with pytest.raises(BadInput, match="bucket must be >= 1 rounds, got 0"):
        goodput.ledger(run, store, bucket=0)


HOSTILE = ["NaN", "Infinity", "-Infinity", "-5", "1e308", '"ten"', "null"]


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("column", ["compute_s", "sync_s", "quorum_s", "t"])
def test_a_lying_record_keeps_every_figure_finite_and_the_rounds_adding_up(store, tmp_path, column, value):
    """NaN and +-Infinity parse (Python's json), 1e308 is finite but past any wall, text and null are JSON."""
    run = _run(store, tmp_path)
    t0 = run.created
    obj = json.loads(_round(3, t0 + 30))  # site a's round 3, in place of the honest one
    obj[column] = "__lie__"
    line = json.dumps(obj).replace('"__lie__"', value)
    store.ingest(run.id, "a", "h", "/m", 2, [line])
    for led in (goodput.ledger(run, store, bucket=1), goodput.ledger(run, store)):
        figures = [led.goodput, *led.lost_s.values()] + [v for r in led.rounds for v in (r.useful_s, *r.lost_s.values())]
        assert all(math.isfinite(x) and x >= 0 for x in figures), led
    led = goodput.ledger(run, store, bucket=1)
    if column == "compute_s":  # not a number of seconds: 0; past the run's wall: the wall (125 s)
        assert _table(led)[3]["useful"] == pytest.approx(8 + (125 if value == "1e308" else 0))
    for k in goodput.CAUSES:
        assert sum(r.lost_s[k] for r in led.rounds) == pytest.approx(led.lost_s[k]), k
    assert sum(r.useful_s for r in led.rounds) == pytest.approx(sum(s.useful_s for s in led.sites))
