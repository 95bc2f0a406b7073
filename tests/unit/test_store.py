"""The SQLite store: migrations, WAL, run states, idempotent metric ingestion, offsets."""

import copy
import re
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from dilococtl import store as store_mod
from dilococtl.errors import BadInput
from dilococtl.migrations import MIGRATIONS, migrate
from dilococtl.paths import db_path
from dilococtl.spec import load_spec
from dilococtl.spec_types import SpecError
from dilococtl.store import Store, new_run_id
from trainer.records import EventRecord, MetricsWriter, RoundRecord, StepRecord, to_line

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "state.db")
    yield s
    s.close()


@pytest.fixture
def spec():
    return load_spec(PLAYBOOKS / "lab-3site.toml")


def count(store, table, run_id=None):
    sql = f"SELECT count(*) FROM {table}" + (" WHERE run_id = ?" if run_id else "")
    return store.db.conn.execute(sql, (run_id,) if run_id else ()).fetchone()[0]


def round_rec(r, site="site0", **kw):
    base = dict(round=r, step=20 * r, h=20, compute_s=2.0, sync_s=0.5, bytes_sent=1000, bytes_recv=2000,
                k_active=3, k_nominal=3, outer_lr=0.7, committed=True, train_loss=3.0 - r / 10,
                val_loss=2.9 - r / 10, val_ppl=18.0 - r, tokens=20480 * r, site=site, t=1000.0 + r)
    base.update(kw)
    return RoundRecord(**base)


def test_default_path_is_under_dilococtl_home():
    s = Store.open()
    try:
        assert s.path == db_path() and s.path.exists()
    finally:
        s.close()


def test_migrations_apply_once(tmp_path):
    path = tmp_path / "state.db"
    Store.open(path).close()
    s = Store.open(path)  # second open: nothing to do
    try:
        rows = s.db.conn.execute("SELECT name FROM _migrations ORDER BY name").fetchall()
        assert [r[0] for r in rows] == [fn.__name__ for fn in MIGRATIONS]
        assert migrate(s.db) == []
        assert {"runs", "sites", "nodes", "launches", "rounds", "steps", "events", "offsets", "tunes"} \
            <= set(s.db.table_names())
    finally:
        s.close()


def test_wal_and_busy_timeout(store, spec):
    conn = store.db.conn
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    store.create_run(spec)
    assert Path(str(store.path) + "-wal").exists()


def test_a_second_writer_waits_for_the_lock(tmp_path, spec):
    a, b = Store.open(tmp_path / "s.db"), Store.open(tmp_path / "s.db")
    try:
        run = a.create_run(spec)
        a.db.conn.execute("BEGIN IMMEDIATE")  # hold the write lock for a moment
        threading.Timer(0.4, lambda: a.db.conn.execute("COMMIT")).start()
        t0 = time.monotonic()
        b.set_run_state(run.id, "running")  # waits (busy timeout) instead of failing
        assert time.monotonic() - t0 >= 0.3
        assert a.get_run(run.id).state == "running"
    finally:
        a.close()
        b.close()


def test_run_id_is_sortable_and_unique():
    ids = [new_run_id(1_700_000_000 + i) for i in range(3)]
    assert all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", i) for i in ids)
    assert ids == sorted(ids)
    assert ids[0].startswith("20231114-221320-")
    assert len({new_run_id(1_700_000_000) for _ in range(50)}) > 40


def test_create_run_records_sites_and_nodes(store, spec):
    run = store.create_run(spec, lighthouse={"url": "http://10.210.1.10:29510"})
    assert run.name == "lab-3site" and run.state == "launching" and run.lighthouse["url"].endswith(":29510")
    assert run.spec() == spec
    sites = store.sites(run.id)
    assert [(s.name, s.idx, s.hosts, s.nproc, s.state) for s in sites] == [
        ("site0", 0, ["10.210.1.10"], 1, "pending"), ("site1", 1, ["10.210.2.10"], 1, "pending"),
        ("site2", 2, ["10.210.3.10"], 1, "pending")]
    nodes = store.nodes(run.id)
    assert [(n.site, n.host, n.rank) for n in nodes] == [
        ("site0", "10.210.1.10", 0), ("site1", "10.210.2.10", 0), ("site2", "10.210.3.10", 0)]
    assert nodes[0].run_dir == f"/tmp/dilococtl-lab/runs/{run.id}"


def test_h100_run_has_32_node_rows_with_ranks(store):
    run = store.create_run(load_spec(PLAYBOOKS / "h100-4continents.toml"), run_dirs={"eu-west": "/x"})
    nodes = store.nodes(run.id)
    assert len(nodes) == 32
    assert [n.rank for n in store.nodes(run.id, "us-east")] == list(range(8))
    assert {n.run_dir for n in store.nodes(run.id, "eu-west")} == {"/x"}


def test_get_run_by_id_name_and_prefix(store, spec):
    first = store.create_run(spec, run_id="20260101-000000-aaaa")
    second = store.create_run(spec, run_id="20260102-000000-bbbb")
    assert store.get_run(first.id).id == first.id
    assert store.get_run("lab-3site").id == second.id  # newest with that name
    assert store.get_run("20260101").id == first.id  # unique prefix
    with pytest.raises(BadInput, match="ambiguous"):
        store.get_run("2026010")
    with pytest.raises(BadInput, match="no run with id or name 'nope'"):
        store.get_run("nope")
    assert [r.id for r in store.list_runs()] == [second.id, first.id]
    assert store.latest_run().id == second.id
    assert store.active_run("lab-3site").id == second.id
    store.set_run_state(second.id, "failed", "boom")
    assert store.active_run("lab-3site").id == first.id


def test_state_transitions(store, spec):
    run = store.create_run(spec)
    assert store.set_run_state(run.id, "running").state == "running"
    pre = store.set_run_state(run.id, "preempted", "SIGTERM on site1")
    assert pre.finished is not None and pre.exit_reason == "SIGTERM on site1"
    back = store.set_run_state(run.id, "launching", "resume")  # resume clears the end
    assert back.finished is None and back.exit_reason is None
    store.set_run_state(run.id, "running")
    done = store.set_run_state(run.id, "finished", "10 rounds")
    assert done.state == "finished" and done.finished >= done.created and done.exit_reason == "10 rounds"
    assert store.set_run_state(run.id, "finished").finished == done.finished  # same state: no-op
    with pytest.raises(BadInput, match="is finished: it cannot become running"):
        store.set_run_state(run.id, "running")
    with pytest.raises(BadInput, match="unknown run state 'paused'"):
        store.set_run_state(run.id, "paused")
    assert store.get_run(run.id).state == "finished"


def test_bad_spec_writes_nothing(store, spec, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((PLAYBOOKS / "lab-3site.toml").read_text().replace('name = "site2"', 'name = "site0"'))
    with pytest.raises(SpecError, match=r"sites\[2\]\.name: duplicate site name 'site0'"):
        store.create_run(load_spec(bad))
    # a spec built in code (not through load_spec) is validated again before anything is written
    broken = copy.deepcopy(spec)
    broken.sites[2].name = "site0"
    with pytest.raises(SpecError, match="duplicate site name"):
        store.create_run(broken)
    # a failure inside the transaction (an id already taken) leaves no partial rows either
    store.create_run(spec, run_id="r1")
    with pytest.raises(BadInput, match="cannot record run r1"):
        store.create_run(spec, run_id="r1")
    assert (count(store, "runs"), count(store, "sites"), count(store, "nodes")) == (1, 3, 3)


def test_nodes_sites_and_launches(store, spec):
    run = store.create_run(spec)
    node = store.set_node(run.id, "site1", "10.210.2.10", state="running", pid=4242, log_path="/tmp/l.log")
    assert (node.state, node.pid, node.log_path, node.rank) == ("running", 4242, "/tmp/l.log", 0)
    assert store.set_node(run.id, "site1", "10.210.2.10", state="failed").pid == 4242  # others unchanged
    with pytest.raises(BadInput, match="no node '10.9.9.9'"):
        store.set_node(run.id, "site1", "10.9.9.9", state="running")
    with pytest.raises(BadInput, match="unknown site/node state"):
        store.set_node(run.id, "site1", "10.210.2.10", state="zombie")
    store.set_site_state(run.id, "site2", "running")
    assert [s.state for s in store.sites(run.id)] == ["pending", "pending", "running"]
    assert store.add_launch(run.id, "site0").attempt == 1
    assert store.add_launch(run.id, "site0", reason="resume", ok=False, message="ssh refused").attempt == 2
    assert store.add_launch(run.id, "site1").attempt == 1
    rows = store.launches(run.id, site="site0")
    assert [(r.attempt, r.reason, r.ok, r.message) for r in rows] == [
        (1, "launch", True, ""), (2, "resume", False, "ssh refused")]


def metrics_lines(tmp_path, site="site0"):
    w = MetricsWriter(tmp_path / site / "metrics.jsonl", site)
    w.write(StepRecord(step=1, round=1, loss=5.5, lr=1e-3, step_s=0.1, tokens_per_s=1000.0, t=1000.1))
    w.write(StepRecord(step=2, round=1, loss=5.0, lr=2e-3, step_s=0.1, tokens_per_s=1100.0, t=1000.2))
    w.write(round_rec(1, site=site))
    w.write(EventRecord(event="checkpoint", message="round 1", detail={"round": 1, "path": "/c/1"}, round=1,
                        t=1000.3))
    w.close()
    data = (tmp_path / site / "metrics.jsonl").read_bytes()
    return data.decode().splitlines(keepends=True), len(data)


def test_ingest_is_idempotent(store, spec, tmp_path):
    run = store.create_run(spec)
    lines, end = metrics_lines(tmp_path)
    lines_with_noise = [*lines, "\n", '{"kind": "step", "ste', "not json\n"]
    assert store.ingest(run.id, "site0", "10.210.1.10", "/m.jsonl", end, lines_with_noise) == 4
    assert store.ingest(run.id, "site0", "10.210.1.10", "/m.jsonl", end, lines) == 0  # collected twice
    assert (count(store, "steps"), count(store, "rounds"), count(store, "events")) == (2, 1, 1)
    steps = store.steps(run.id, "site0")
    assert [(s.step, s.loss, s.site) for s in steps] == [(1, 5.5, "site0"), (2, 5.0, "site0")]
    (r,) = store.rounds(run.id)
    assert (r.round, r.committed, r.val_ppl, r.bytes_sent, r.site) == (1, True, 17.0, 1000, "site0")
    assert r.efficiency == pytest.approx(2.0 / 2.5)
    (e,) = store.events(run.id, site="site0")
    assert (e.event, e.detail, e.round, e.message) == ("checkpoint", {"round": 1, "path": "/c/1"}, 1, "round 1")


def test_the_exchange_parts_of_a_round_are_stored_and_a_store_from_before_them_keeps_its_rows(tmp_path, spec):
    path = tmp_path / "old.db"
    s = Store.open(path)
    run = s.create_run(spec)
    s.ingest(run.id, "site0", "h", "/m", 1, [to_line(round_rec(1, sync_s=0.61))])
    s.close()
    # make it the store as it was before m004: no part columns, and that round in it
    conn = sqlite3.connect(path)
    for col in ("exchange_t", "quorum_s", "weight_s", "payload_s"):
        conn.execute(f"ALTER TABLE rounds DROP COLUMN {col}")
    conn.execute("DELETE FROM _migrations WHERE name = 'm004_round_parts'")
    conn.commit()
    conn.close()
    s = Store.open(path)
    try:
        s.ingest(run.id, "site0", "h", "/m", 2, [to_line(round_rec(2, quorum_s=0.04, weight_s=0.1, payload_s=0.3))])
        r1, r2 = s.rounds(run.id)
        assert (r1.sync_s, r1.quorum_s, r1.weight_s, r1.payload_s) == (0.61, None, None, None)
        assert (r2.quorum_s, r2.weight_s, r2.payload_s) == (0.04, 0.1, 0.3)
    finally:
        s.close()


def test_a_rerun_round_replaces_the_row(store, spec):
    run = store.create_run(spec)
    store.ingest(run.id, "site0", "h", "/m", 10, [to_line(round_rec(1)), to_line(round_rec(2))])
    # after a restart from the round-1 checkpoint, round 2 is done again with other numbers
    assert store.ingest(run.id, "site0", "h", "/m", 20, [to_line(round_rec(2, k_active=2, val_ppl=15.5))]) == 1
    rows = store.rounds(run.id, "site0")
    assert [(r.round, r.k_active, r.val_ppl) for r in rows] == [(1, 3, 17.0), (2, 2, 15.5)]


def test_latest_rounds_per_site(store, spec):
    run = store.create_run(spec)
    store.ingest(run.id, "site0", "h1", "/m", 1, [to_line(round_rec(r)) for r in (1, 2, 3)])
    store.ingest(run.id, "site1", "h2", "/m", 1, [to_line(round_rec(r, site="site1")) for r in (1, 2)])
    latest = store.latest_rounds(run.id)
    assert {s: r.round for s, r in latest.items()} == {"site0": 3, "site1": 2}
    assert [(r.round, r.site) for r in store.rounds(run.id)] == [
        (1, "site0"), (1, "site1"), (2, "site0"), (2, "site1"), (3, "site0")]


def test_offset_persists_across_reopen(tmp_path, spec):
    path = tmp_path / "state.db"
    s = Store.open(path)
    run = s.create_run(spec)
    assert s.offset(run.id, "site0", "10.210.1.10", "/r/site0/metrics.jsonl") == 0
    lines, end = metrics_lines(tmp_path)
    s.ingest(run.id, "site0", "10.210.1.10", "/r/site0/metrics.jsonl", end, lines)
    s.close()
    s = Store.open(path)
    try:
        assert s.offset(run.id, "site0", "10.210.1.10", "/r/site0/metrics.jsonl") == end
        assert s.offset(run.id, "site0", "10.210.2.10", "/r/site0/metrics.jsonl") == 0
    finally:
        s.close()


def test_ingest_failure_stores_neither_records_nor_offset(store, spec, tmp_path, monkeypatch):
    run = store.create_run(spec)
    lines, end = metrics_lines(tmp_path)
    real = store_mod.parse_line
    seen = []

    def failing(line):
        seen.append(line)
        if len(seen) == 3:
            raise RuntimeError("collector died")
        return real(line)

    monkeypatch.setattr(store_mod, "parse_line", failing)
    with pytest.raises(RuntimeError):
        store.ingest(run.id, "site0", "h", "/m", end, lines)
    assert (count(store, "steps"), count(store, "rounds"), store.offset(run.id, "site0", "h", "/m")) == (0, 0, 0)
    monkeypatch.setattr(store_mod, "parse_line", real)
    assert store.ingest(run.id, "site0", "h", "/m", end, lines) == 4
    assert store.offset(run.id, "site0", "h", "/m") == end


def test_ingest_into_unknown_run_is_refused(store):
    with pytest.raises(BadInput, match="no such run 'nope'"):
        store.ingest("nope", "a", "h", "/m", 5, [])


def test_events_dedupe_order_and_polling(store, spec):
    run = store.create_run(spec)
    assert store.add_event(run.id, "resume", "relaunched site1", site="site1", detail={"attempt": 2}, t=50.0)
    assert not store.add_event(run.id, "resume", "relaunched site1", site="site1", t=50.0)  # same event
    assert store.add_event(run.id, "launch", "started", t=10.0)
    evs = store.events(run.id)
    assert [(e.event, e.site, e.t) for e in evs] == [("launch", "", 10.0), ("resume", "site1", 50.0)]
    assert evs[1].detail == {"attempt": 2}
    newest_id = max(e.id for e in evs)
    assert store.events(run.id, after_id=newest_id) == []
    assert [e.event for e in store.events(run.id, kinds=["resume"])] == ["resume"]
    assert [e.event for e in store.events(run.id, limit=1)] == ["resume"]


def test_steps_limit_keeps_the_newest(store, spec):
    run = store.create_run(spec)
    recs = [StepRecord(step=i, round=1, loss=9.0 - i, lr=1e-3, step_s=0.1, tokens_per_s=1.0, t=100.0 + i)
            for i in range(1, 11)]
    store.ingest(run.id, "site2", "h", "/m", 1, [to_line(r) for r in recs])
    assert [s.step for s in store.steps(run.id, limit=3)] == [8, 9, 10]
    assert [s.step for s in store.steps(run.id, "site2", after_step=8)] == [9, 10]


def test_tunes_round_trip(store):
    links = [{"a": "site0", "b": "site1", "mbit": 48.1, "rtt_ms": 80.2}]
    t = store.add_tune(spec_path="p.toml", links=links, step_s=0.05, payload_bytes=125_248, h=40, budget=0.1,
                       prediction={"sync_s": 0.2, "efficiency": 0.91}, created=5.0)
    store.add_tune(spec_path="q.toml", links=[], step_s=0.1, payload_bytes=1, h=10, budget=0.1, prediction={},
                   created=6.0)
    assert (t.links, t.h, t.prediction["efficiency"]) == (links, 40, 0.91)
    assert [x.spec_path for x in store.tunes()] == ["q.toml", "p.toml"]
    assert [x.id for x in store.tunes(spec_path="p.toml")] == [t.id]


def test_db_is_usable_from_another_connection(tmp_path, spec):
    s = Store.open(tmp_path / "x.db")
    run = s.create_run(spec)
    s.close()
    with sqlite3.connect(tmp_path / "x.db") as conn:
        assert conn.execute("SELECT state FROM runs WHERE id = ?", (run.id,)).fetchone() == ("launching",)


def test_each_exchange_of_a_fragmented_round_is_stored_and_a_bad_value_reads_as_none(store, spec):
    run = store.create_run(spec)
    store.ingest(run.id, "site0", "h", "/m", 1, [to_line(round_rec(1, exchange_bytes=[4000, 3900]))])
    store.ingest(run.id, "site1", "h", "/m", 1, [to_line(round_rec(1, site="site1"))])
    # a node's record may hold anything there: it is stored, and read back as no list
    store.ingest(run.id, "site2", "h", "/m", 1, [to_line(round_rec(1, site="site2", exchange_bytes={"a": 1}))])
    got = {r.site: r.exchange_bytes for r in store.rounds(run.id)}
    assert got == {"site0": [4000, 3900], "site1": None, "site2": None}
