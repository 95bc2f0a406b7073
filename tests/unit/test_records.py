"""`dilococtl runs` (filters, the duration / final perplexity / end-reason columns) and `runs rm`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dilococtl import records
from dilococtl.cli import app
from dilococtl.errors import BadInput
from dilococtl.store import Store
from tests.tui.fixtures import ROUND_S, T0, make_run, ppl_at


@pytest.fixture
def home_store():
    home = Path(os.environ["DILOCOCTL_HOME"])
    store = Store.open(home / "state.db")
    yield store
    store.close()


def three_runs(store):
    """finished (10 rounds) at T0, running (6) at T0+60, failed (3) at T0+120 named lab-x."""
    a = make_run(store, run_id="20260101-000000-aaaa", state="finished", rounds=10)
    b = make_run(store, run_id="20260101-000100-bbbb", rounds=6)
    c = make_run(store, run_id="20260101-000200-cccc", rounds=3)
    store.set_run_state(c.id, "failed", reason="site(s) site-b failed")
    for run, dt in ((b, 60), (c, 120)):
        store.db.conn.execute("UPDATE runs SET created = created + ? WHERE id = ?", (dt, run.id))
    store.db.conn.execute("UPDATE runs SET name = 'lab-x', finished = ? WHERE id = ?", (T0 + 160, c.id))
    store.db.conn.commit()
    return a, b, c


def test_rows_carry_duration_rounds_final_ppl_and_reason(home_store):
    a, b, c = three_runs(home_store)
    rows = {r.id: r for r in records.list_runs(home_store, now=T0 + 1000)}
    assert list(rows) == [c.id, b.id, a.id]  # newest first
    assert rows[a.id].duration_s == pytest.approx(ROUND_S * 10 + 5)  # finished: launch to end
    assert rows[b.id].duration_s == pytest.approx(1000 - 60)  # running: up to now
    assert rows[c.id].duration_s == pytest.approx(40)
    assert (rows[a.id].rounds, rows[a.id].rounds_planned) == (10, 10)
    assert rows[a.id].final_val_ppl == pytest.approx(ppl_at(10))
    assert rows[c.id].final_val_ppl == pytest.approx(ppl_at(3)) and rows[c.id].reason == "site(s) site-b failed"


def test_filters(home_store):
    a, b, c = three_runs(home_store)

    def ids(**kw):
        return [r.id for r in records.list_runs(home_store, **kw)]

    assert ids(state="running") == [b.id]
    assert ids(name="lab-*") == [c.id] and ids(name="local-2site") == [b.id, a.id]
    assert ids(since=T0 + 30) == [c.id, b.id]
    assert ids(limit=2) == [c.id, b.id]
    assert ids(state="finished", name="lab-*") == []
    with pytest.raises(BadInput, match="not a run state"):
        ids(state="runnning")
    with pytest.raises(BadInput, match="--limit must be >= 1"):
        ids(limit=0)


def test_runs_command_shows_the_columns_and_filters(home_store):
    a, b, c = three_runs(home_store)
    r = CliRunner().invoke(app, ["runs", "--state", "failed"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for cell in ("final ppl", "ended because", "duration", c.id, "3/10", f"{ppl_at(3):.3f}", "0:40",
                 "site(s) site-b failed"):
        assert cell in r.stdout, cell
    assert a.id not in r.stdout
    got = json.loads(CliRunner().invoke(app, ["runs", "--json", "--limit", "1"]).stdout)
    assert [x["id"] for x in got] == [c.id] and got[0]["final_val_ppl"] == pytest.approx(ppl_at(3))
    bad = CliRunner().invoke(app, ["runs", "--state", "nope", "--json"])
    assert bad.exit_code == 2 and json.loads(bad.stdout)["exit"] == 2


def test_rm_forgets_a_run_and_with_files_its_directories(home_store, tmp_path):
    a, b, c = three_runs(home_store)
    run_dir = tmp_path / "work" / "runs" / a.id
    (run_dir / "site-a" / "checkpoints").mkdir(parents=True)
    (run_dir / "site-a" / "node0.log").write_text("x")
    for site in ("site-a", "site-b"):
        home_store.db.conn.execute("UPDATE nodes SET run_dir = ? WHERE run_id = ? AND site = ?",
                                   (str(run_dir), a.id, site))
    other = tmp_path / "work" / "runs" / c.id  # another run's directory stays
    other.mkdir(parents=True)
    home_store.db.conn.commit()
    r = CliRunner().invoke(app, ["runs", "rm", a.id, "--files", "--yes", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == [{"id": a.id, "name": "local-2site", "files": [f"local:{run_dir}"], "errors": []}]
    assert not run_dir.exists() and other.exists()
    with Store.open(home_store.path) as s:
        assert [x.id for x in s.list_runs()] == [c.id, b.id]
        for table in ("sites", "nodes", "rounds", "steps", "events", "offsets", "launches"):
            assert s.db.conn.execute(f"SELECT COUNT(*) FROM {table} WHERE run_id = ?", (a.id,)).fetchone() == (0,)
        assert s.db.conn.execute("SELECT COUNT(*) FROM rounds WHERE run_id = ?", (c.id,)).fetchone()[0] > 0


def test_rm_refuses_active_runs_and_asks_without_yes(home_store):
    a, b, c = three_runs(home_store)
    r = CliRunner().invoke(app, ["runs", "rm", a.id, b.id, "--yes"])
    assert r.exit_code == 2 and f"not removing active run(s) {b.id} (running)" in r.stderr
    r = CliRunner().invoke(app, ["runs", "rm", c.id])  # CliRunner's stdin is no terminal
    assert r.exit_code == 2 and "no terminal to ask on; pass --yes" in r.stderr
    r = CliRunner().invoke(app, ["runs", "rm", "nosuch", "--yes"])
    assert r.exit_code == 2 and "no run with id or name 'nosuch'" in r.stderr
    with Store.open(home_store.path) as s:
        assert len(s.list_runs()) == 3  # nothing was removed by any of them
