"""diloco.grace: launch sets the Lighthouse's join window to grace x the exchange tune-h predicted for the
spec and its H, bounded; no tune or a record that is not a duration leaves run.join_timeout_ms alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from dilococtl import grace
from dilococtl.errors import BadInput
from dilococtl.spec import load_spec
from dilococtl.store import Store
from tests.unit.test_derive_transport import SPEC  # two sites on their own hosts, [diloco] h = 50 and {extra}


def _spec(tmp_path: Path, extra: str = "grace = 0.5"):
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(preset="tiny", extra=extra))
    return load_spec(p)


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "state.db") as s:
        yield s


def _tune(store, spec, sync_s, h: int = 50):
    return store.add_tune(spec_path=spec.path, links=[], step_s=0.1, payload_bytes=1, h=h, budget=0.1,
                          prediction={"sync_s": sync_s})


def test_the_window_is_grace_times_the_predicted_exchange(tmp_path, store):
    spec = _spec(tmp_path)
    t = _tune(store, spec, 2.4)
    notes: list[str] = []
    out, got = grace.apply(spec, store, notes.append)
    assert got == {"join_timeout_ms": 1200, "grace": 0.5, "predicted_sync_s": 2.4, "tune_id": t.id}
    assert out.run.join_timeout_ms == 1200 and spec.run.join_timeout_ms == 5000  # a copy; 5000: the default
    assert notes == ["grace 0.5 x the 2.40 s exchange tune 1 predicted: a round's quorum waits 1.20 s for a late site"]


def test_only_a_tune_at_the_specs_h_counts_and_the_newest_wins(tmp_path, store):
    spec = _spec(tmp_path)
    _tune(store, spec, 2.0, h=100)  # another H: another exchange share, not this run's
    assert grace.window(spec, store) is None
    _tune(store, spec, 2.0)
    _tune(store, spec, 8.0)
    assert grace.window(spec, store)["join_timeout_ms"] == 4000


def test_bounded_below_and_above(tmp_path, store):
    spec = _spec(tmp_path)
    _tune(store, spec, 0.01)  # 5 ms: a site a scheduler tick late would be dropped
    assert grace.window(spec, store)["join_timeout_ms"] == grace.MIN_MS
    _tune(store, spec, 1e12)
    assert grace.window(spec, store)["join_timeout_ms"] == 86_400_000  # MAX_WAIT_S: every wait has a bound


@pytest.mark.parametrize("sync_s", [float("nan"), float("inf"), -1.0, 0, "2.0", True, None, [2.0]])
def test_a_prediction_that_is_not_a_duration_is_not_used(tmp_path, store, sync_s):
    spec = _spec(tmp_path)
    _tune(store, spec, sync_s)
    notes: list[str] = []
    out, got = grace.apply(spec, store, notes.append)
    assert got is None and out.run.join_timeout_ms == 5000
    assert len(notes) == 1 and "no tune-h prediction" in notes[0] and "5000 ms" in notes[0]


def test_off_by_default_and_silent(tmp_path, store):
    spec = _spec(tmp_path, extra="")
    _tune(store, spec, 2.0)
    notes: list[str] = []
    assert grace.apply(spec, store, notes.append) == (spec, None) and notes == []


@pytest.mark.parametrize("extra, msg", [
    ("grace = -0.5", "diloco.grace: must be in [0, 100]"),
    ("grace = 101.0", "diloco.grace: must be in [0, 100]"),
    ("grace = nan", "diloco.grace: must be a finite number"),
    ('grace = 0.5\nmode = "async"', "diloco.grace: a quorum's wait for late sites"),
    ('grace = 0.5\nalgorithm = "ddp"', "diloco.grace: a quorum's wait for late sites"),
])
def test_bad_values_are_refused_in_one_line(tmp_path, extra, msg):
    with pytest.raises(BadInput, match=None) as e:
        _spec(tmp_path, extra=extra)
    assert msg in str(e.value) and "\n" not in str(e.value)
