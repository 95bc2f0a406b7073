"""Run and site states: one enum each, the allowed moves written once and enforced by the store."""

import sqlite3
from pathlib import Path

import pytest

from dilococtl.errors import BadInput
from dilococtl.spec import load_spec
from dilococtl.states import RUN_MOVES, SITE_MOVES, RunState, SiteState, check_run_move, check_site_move
from dilococtl.store import Store

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "state.db")
    yield s
    s.close()


def test_values_are_the_strings_stored_before_the_enums():
    # rows written by earlier versions must read back: no migration
    assert [str(s) for s in RunState] == ["launching", "running", "finished", "failed", "stopped", "preempted"]
    assert [str(s) for s in SiteState] == ["pending", "starting", "running", "finished", "failed", "stopped",
                                           "preempted", "lost"]
    assert set(RUN_MOVES) == set(RunState) and set(SITE_MOVES) == set(SiteState)


def test_run_moves():
    assert check_run_move("run r", "running", "finished") is RunState.FINISHED
    assert check_run_move("run r", "finished", "finished") is RunState.FINISHED  # staying put
    for new in RunState:
        if new is not RunState.FINISHED:
            with pytest.raises(BadInput, match="run r is finished: it cannot become"):
                check_run_move("run r", "finished", new)
    with pytest.raises(BadInput, match="run r is failed: it cannot become running"):
        check_run_move("run r", "failed", "running")  # only resume (-> launching) leaves failed
    with pytest.raises(BadInput, match="unknown run state 'paused'"):
        check_run_move("run r", "running", "paused")


def test_site_moves():
    for old in SiteState:
        if old is not SiteState.PENDING:
            with pytest.raises(BadInput, match="cannot become pending"):
                check_site_move("site a", old, "pending")
    for new in ("failed", "preempted", "stopped", "lost"):
        with pytest.raises(BadInput, match="site a is finished: it cannot become"):
            check_site_move("site a", "finished", new)
    assert check_site_move("site a", "finished", "running") is SiteState.RUNNING  # a relaunch
    assert check_site_move("site a", "lost", "running") is SiteState.RUNNING  # it answers again
    with pytest.raises(BadInput, match="unknown site/node state 'zombie'"):
        check_site_move("site a", "running", "zombie")


def test_the_store_refuses_an_illegal_move_and_keeps_the_row(store):
    run = store.create_run(load_spec(PLAYBOOKS / "lab-3site.toml"))
    host = store.nodes(run.id, "site1")[0].host
    store.set_node(run.id, "site1", host, state="running")
    store.set_node(run.id, "site1", host, state="finished")
    with pytest.raises(BadInput, match=f"node {host} of site site1 .* is finished: it cannot become failed"):
        store.set_node(run.id, "site1", host, state="failed", pid=7)
    node = store.nodes(run.id, "site1")[0]
    assert (node.state, node.pid) == (SiteState.FINISHED, None)  # nothing of the refused update was written
    store.set_site_state(run.id, "site1", "running")
    with pytest.raises(BadInput, match="site site1 .* is running: it cannot become pending"):
        store.set_site_state(run.id, "site1", "pending")
    assert store.sites(run.id)[1].state is SiteState.RUNNING
    # records come back as enum members, stored as the plain strings
    assert store.get_run(run.id).state is RunState.LAUNCHING
    raw = sqlite3.connect(store.path).execute("SELECT state FROM sites WHERE run_id = ? AND name = 'site1'",
                                              (run.id,)).fetchone()[0]
    assert raw == "running" and type(raw) is str
