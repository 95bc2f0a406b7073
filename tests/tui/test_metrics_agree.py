"""status --json, the watch Snapshot and report show the same figures for the same recorded run
(one home: dilococtl/metrics.py), and those figures are the hand-computed ones."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dilococtl import columns, fmt, metrics
from dilococtl.cli import app
from dilococtl.paths import db_path
from dilococtl.report import SUMMARY_FILE, write_report
from dilococtl.store import Store
from dilococtl.tui.data import Loader
from tests.tui.fixtures import ROUND_S, add_rounds, make_run


@pytest.fixture
def recorded():
    """6 rounds of two sites (sync 1.5 s at site-a, 2.5 s at site-b, rounds of ROUND_S s); in round 3
    site-b is the straggler: 11.5 s of compute, then only the exchange (0.5 s)."""
    with Store.open(db_path()) as store:
        run = make_run(store, rounds=6, state="finished")
        add_rounds(store, run.id, "site-b", 3, 3, sync_s=0.5)
    return run


def test_status_watch_and_report_agree(recorded, tmp_path):
    # by hand: the sites' sync seconds over their round seconds, every record summed (issue 42): the
    # per-round sync seconds `logs` shows add up to the numerator
    sync, rounds_s = 6 * 1.5 + 5 * 2.5 + 0.5, 12 * ROUND_S
    wall = 6 * ROUND_S + 5  # the fixture's finished run ends 5 s after its last round
    eff = {"site-a": 6 * (ROUND_S - 1.5) / (6 * ROUND_S), "site-b": (5 * (ROUND_S - 2.5) + ROUND_S - 0.5) / (6 * ROUND_S)}

    r = CliRunner().invoke(app, ["status", recorded.id, "--json", "--no-refresh"])
    assert r.exit_code == 0, r.output
    status = json.loads(r.stdout)
    assert status["sync_share"] == pytest.approx(sync / rounds_s)
    assert status["metrics"]["sync_s"] == pytest.approx(sync)
    assert status["metrics"]["round_s"] == pytest.approx(rounds_s)
    assert status["metrics"]["wall_s"] == pytest.approx(wall)
    assert status["metrics"]["sync_share_of_wall"] == pytest.approx(sync / 2 / wall)  # a site's mean sync seconds
    by_site = {s["site"]: s for s in status["sites"]}
    assert {k: v["efficiency"] for k, v in by_site.items()} == pytest.approx(eff)
    assert {k: v["tokens_per_s"] for k, v in by_site.items()} == {"site-a": 40_000.0, "site-b": 38_000.0}
    assert {k: v["staleness"] for k, v in by_site.items()} == {"site-a": 0, "site-b": 0}

    snap = Loader(db_path(), recorded.id).load()
    assert snap.metrics is not None
    ledger = ("goodput", "lost_s", "goodput_sites")  # the goodput ledger's, beside the figures
    assert snap.metrics.to_json() == pytest.approx({k: v for k, v in status["metrics"].items() if k not in ledger})
    assert snap.goodput == pytest.approx(status["metrics"]["goodput"]) and 0 < snap.goodput < 1
    assert {s.site: s.efficiency for s in snap.metrics.sites} == pytest.approx(eff)
    for s in snap.metrics.sites:
        assert (s.tokens_per_s, s.staleness) == (by_site[s.site]["tokens_per_s"], by_site[s.site]["staleness"])

    with Store.open(db_path()) as store:
        write_report(store, recorded.id, tmp_path / "report")
    text = (tmp_path / "report" / SUMMARY_FILE).read_text()
    assert f"sync share of round time (compute + sync): {fmt.pct(status['sync_share'])} " in text
    assert f"of wall time: {fmt.pct(status['metrics']['sync_share_of_wall'])} " in text
    for site, s in by_site.items():  # the report's row is status's row in the shared cell formats
        cells = columns.text_cells(s)
        row = "| " + " | ".join(cells[c.key] for c in columns.SITE_COLUMNS) + " |"
        assert row in text and f"| {fmt.pct(eff[site])} |" in row and f"| {fmt.si(s['tokens_per_s'])} |" in row


def test_round_time_from_records_equals_the_stores_bucketed_fold(recorded):
    """The views read the fold per bucket of rounds in SQL; the e2e checks fold records in Python."""
    with Store.open(db_path()) as store:
        rows = store.rounds(recorded.id)
        for width_points in (1, 2, 160):  # buckets of 8, 4 and 1 round(s)
            snap = Loader(db_path(), recorded.id, max_points=width_points).load()
            assert snap.metrics.sync_share == pytest.approx(metrics.sync_share(rows))
            assert snap.metrics.rounds == 6
    assert metrics.sync_share([]) is None


def test_a_warm_refresh_folds_new_and_redone_rounds_like_a_cold_load(store_path):
    with Store.open(store_path) as store:
        run = make_run(store, rounds=6)
        loader = Loader(store_path, run.id, max_points=2)  # buckets of 4 rounds
        assert loader.load().metrics.rounds == 6
        add_rounds(store, run.id, "site-a", 7, 9, sync_s=0.25)  # site-b not there yet: a's own exchange
        add_rounds(store, run.id, "site-b", 2, 2, sync_s=0.5)  # a round redone after a restart
        warm = loader.load().metrics
        cold = Loader(store_path, run.id, max_points=2).load().metrics
        rows = store.rounds(run.id)
    assert warm.rounds == cold.rounds == 9
    assert warm.sync_s == pytest.approx(cold.sync_s) and warm.round_s == pytest.approx(cold.round_s)
    assert warm.sync_share == pytest.approx(metrics.sync_share(rows))
    # rounds 1-6 of both sites, site-b's round 2 redone at 0.5 s, then site-a's rounds 7-9
    assert warm.sync_s == pytest.approx(6 * 1.5 + 5 * 2.5 + 0.5 + 3 * 0.25)


def test_one_printed_digit_from_logs_to_status_watch_and_report(recorded, tmp_path):
    """Issue 42: the sum of the per-round sync seconds `logs` lists over the sum of their round times
    is the sync share report's summary, status and watch's header print, to the digit."""
    import re

    r = CliRunner().invoke(app, ["logs", recorded.id, "--json"])
    assert r.exit_code == 0, r.output
    recs = [x["record"] for x in map(json.loads, r.stdout.splitlines()) if x.get("kind") == "round"]
    assert len(recs) == 12
    digit = fmt.pct(sum(x["sync_s"] for x in recs) / sum(x["compute_s"] + x["sync_s"] for x in recs))
    assert digit == "15.3%"

    r = CliRunner().invoke(app, ["status", recorded.id, "--no-refresh"])
    assert r.exit_code == 0, r.output
    assert re.search(r"sync share of round time \(compute \+ sync\): (\S+)", r.stdout).group(1) == digit
    with Store.open(db_path()) as store:
        write_report(store, recorded.id, tmp_path / "report")
    text = (tmp_path / "report" / SUMMARY_FILE).read_text()
    assert re.search(r"sync share of round time \(compute \+ sync\): (\S+)", text).group(1) == digit
    snap = Loader(db_path(), recorded.id).load()
    assert fmt.pct(snap.metrics.sync_share) == digit  # watch's header prints this (test_watch_pilot.py)
    # and 1 - sync share is the sites' efficiency weighted by their round seconds (equal here)
    eff = [s.efficiency for s in snap.metrics.sites]
    assert fmt.pct(1 - sum(eff) / len(eff)) == digit
