"""dilococtl.queries: bucketed series equal the raw rows, the cache equals a fresh read, run picking."""

from __future__ import annotations

import math

from dilococtl import queries
from dilococtl.migrations import MIGRATIONS
from tests.tui.fixtures import add_rounds, make_run, ppl_at


def raw(store, run_id, site):
    return store.db.conn.execute(
        "SELECT count(*), sum(compute_s), sum(sync_s), max(tokens), sum(bytes_sent) FROM rounds"
        " WHERE run_id = ? AND site = ?", (run_id, site)).fetchone()


def test_bucket_width_is_a_power_of_two_within_max_points():
    assert queries.bucket_width(0, 160) == 1
    assert queries.bucket_width(160, 160) == 1
    assert queries.bucket_width(161, 160) == 2
    assert queries.bucket_width(50_000, 160) == 512  # 50000 / 512 = 98 buckets


def test_series_buckets_add_up_to_the_rows(store):
    run = make_run(store, rounds=3)
    add_rounds(store, run.id, "site-a", 4, 1000)
    s = queries.series(store, run.id, max_points=100)
    assert s.bucket_rounds == 16
    a = s.sites["site-a"]
    assert len(a) == math.ceil(1000 / 16) and [b.round for b in a][:2] == [16, 32] and a[-1].round == 1000
    n, compute, sync, tokens, sent = raw(store, run.id, "site-a")
    assert sum(b.n for b in a) == n == 1000
    assert math.isclose(sum(b.compute_s for b in a), compute) and math.isclose(sum(b.sync_s for b in a), sync)
    assert a[-1].tokens == tokens and sum(b.bytes_sent for b in a) == sent
    assert math.isclose(a[0].val_ppl, sum(ppl_at(r) for r in range(1, 17)) / 16)
    # global: site-b stopped at round 3, its tokens still count; ppl averages the sites evaluated there
    assert s.global_tokens[0] == a[0].tokens + s.sites["site-b"][0].tokens
    assert s.global_tokens[-1] == a[-1].tokens + s.sites["site-b"][-1].tokens
    assert math.isclose(s.global_ppl[-1], a[-1].val_ppl)


def test_cache_reads_only_new_buckets_and_equals_a_fresh_read(store):
    run = make_run(store, rounds=3)
    add_rounds(store, run.id, "site-a", 4, 300)
    cache = queries.SeriesCache(max_points=50)
    first = cache.series(store, run.id)
    add_rounds(store, run.id, "site-a", 301, 320)
    add_rounds(store, run.id, "site-a", 318, 320, sync_s=6.0)  # a restarted site redid its last rounds
    again = cache.series(store, run.id)
    fresh = queries.series(store, run.id, max_points=50)
    assert again.sites == fresh.sites and again.global_ppl == fresh.global_ppl
    assert again.sites["site-a"][-1].round == 320 and first.sites["site-a"][-1].round == 300
    add_rounds(store, run.id, "site-a", 321, 500)  # the width doubles: everything is read again
    grown = cache.series(store, run.id)
    assert grown.bucket_rounds == 16 and grown.sites == queries.series(store, run.id, max_points=50).sites


def test_site_stats(store):
    run = make_run(store, rounds=4, preempted="site-b")
    stats = {s.site: s for s in queries.site_stats(store, run.id)}
    a, b = stats["site-a"], stats["site-b"]
    assert (a.round, a.step, a.k_active, a.k_nominal, a.staleness) == (4, 80, 2, 2, 0)
    assert b.state == "preempted" and b.round == 2
    assert math.isclose(a.efficiency, 10.5 / 12) and math.isclose(b.efficiency, 9.5 / 12)
    assert math.isclose(a.wan_bps, 1_000_000 / 1.5) and a.last_sync_s == 1.5
    assert a.tokens_per_s == 40_000.0 and math.isclose(a.val_ppl, ppl_at(4))


def test_site_stats_mfu_from_each_sites_newest_start_event(store):
    run = make_run(store, rounds=4)
    assert {s.mfu for s in queries.site_stats(store, run.id)} == {None}  # no peak said: a CPU's run
    store.add_event(run.id, "start", "old", site="site-a", detail={"flops_per_token": 1.0, "peak_flops": 1.0},
                    t=run.created + 50)
    store.add_event(run.id, "start", "resumed", site="site-a", detail={"flops_per_token": 2e6, "peak_flops": 1e12},
                    t=run.created + 60)
    store.add_event(run.id, "start", "liar", site="site-b", detail={"flops_per_token": "1e6", "peak_flops": -1.0},
                    t=run.created + 60)
    stats = {s.site: s for s in queries.site_stats(store, run.id)}
    assert math.isclose(stats["site-a"].mfu, 40_000 * 2e6 / 1e12)  # tokens/s of its newest step
    assert stats["site-b"].mfu is None  # a peak or a FLOP count that is not a positive number: no MFU


def test_recent_events_newest_then_polled(store):
    run = make_run(store, rounds=6)
    evs = queries.recent_events(store, run.id, limit=3)
    assert len(evs) == 3 and [e.t for e in evs] == sorted(e.t for e in evs)
    assert max(e.id for e in evs) == max(e.id for e in store.events(run.id))
    store.add_event(run.id, "error", "boom", site="site-a", t=run.created + 999)
    new = queries.recent_events(store, run.id, after_id=max(e.id for e in evs))
    assert [(e.event, e.message) for e in new] == [("error", "boom")]


def test_view_indexes_migration_is_applied(store):
    assert "m002_view_indexes" in [m.__name__ for m in MIGRATIONS]
    names = {r[0] for r in store.db.conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"rounds_series", "events_run_id"} <= names
    plan = store.db.conn.execute("EXPLAIN QUERY PLAN " + queries._BUCKET_SQL, ("r", "s", 1, 2)).fetchall()
    assert "COVERING INDEX rounds_series" in " ".join(str(p) for p in plan)


def test_watched_run_prefers_the_newest_active_run(store):
    assert queries.watched_run(store) is None
    active = make_run(store, run_id="20260101-000000-0001", state="running")
    store.db.conn.execute("UPDATE runs SET created = created - 10 WHERE id = ?", (active.id,))
    store.db.conn.commit()
    make_run(store, run_id="20260101-000000-0002", state="finished")
    assert queries.watched_run(store).id == active.id
    assert queries.watched_run(store, "20260101-000000-0002").id == "20260101-000000-0002"
