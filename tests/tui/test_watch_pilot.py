"""The dashboard driven with Pilot: keys, refreshes, empty states, a node that stops answering."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import pytest
from rich.console import Console

from dilococtl.errors import Unreachable
from dilococtl.store import Store
from dilococtl.tui.app import DashboardApp, make_app
from dilococtl.tui.screens.help import HelpScreen
from dilococtl.tui.screens.site_log import SiteLogScreen
from dilococtl.tui.widgets.sites import SitesTable
from tests.tui.fixtures import NOW, add_rounds, make_run

SIZE = (130, 42)
pytestmark = pytest.mark.anyio


async def settle(app: DashboardApp, pilot) -> None:
    """Wait until the workers in flight are done and their results are on screen."""
    from textual.worker import WorkerCancelled

    for _ in range(3):
        try:
            await app.workers.wait_for_complete()
        except WorkerCancelled:  # a plot overtaken by a newer one (exclusive worker): wait for that
            await pilot.pause()
            await app.workers.wait_for_complete()
        await pilot.pause()


async def wait_for(pilot, cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.05)


def screen_text(app) -> str:
    """What the terminal shows, as plain text (the rendering export_screenshot makes, without SVG)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, record=True,
                      legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False)


def round_cell(app, site: str) -> str:
    table = app.query_one(SitesTable)
    return str(table.get_cell(site, "round"))


async def test_help_lists_every_key_and_closes(store, store_path):
    make_run(store)
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = screen_text(app)
        for key, what in app.HELP:
            assert key in text and what.split(":")[0] in text
        # every binding of the app is in the help, and nothing the help promises is missing
        assert {b.key_display or b.key for b in app.BINDINGS} <= {k for k, _ in app.HELP}
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_q_quits(store, store_path):
    make_run(store)
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("q")
        await pilot.pause()
        assert app._exit


async def test_r_shows_new_rows_at_once(store, store_path):
    run = make_run(store, rounds=3)
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW, refresh_s=3600)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert round_cell(app, "site-a") == "3"
        with Store.open(store_path) as other:  # another process (the collector) writes
            add_rounds(other, run.id, "site-a", 4, 5)
        await pilot.pause(0.3)
        assert round_cell(app, "site-a") == "3"  # the timer (1 h) has not fired
        await pilot.press("r")
        await settle(app, pilot)
        assert round_cell(app, "site-a") == "5"
        assert "rounds 5/10 (5 left)" in screen_text(app)


async def test_rows_inserted_appear_after_the_next_refresh(store, store_path):
    run = make_run(store, rounds=3)
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW, refresh_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        with Store.open(store_path) as other:
            add_rounds(other, run.id, "site-b", 4, 7)
            other.add_event(run.id, "h_changed", "H 20 -> 40 (sync above budget)", site="site-b", round=7,
                            t=run.created + 100)
        seen = app.refreshes
        await wait_for(pilot, lambda: app.refreshes >= seen + 2)
        await pilot.pause()
        assert round_cell(app, "site-b") == "7"
        text = screen_text(app)
        assert "h_changed" in text and "H 20 -> 40" in text


async def test_s_cycles_the_focused_site(store, store_path):
    make_run(store)
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.focused_site == "site-a"
        assert "site-a: compute efficiency" in screen_text(app)
        await pilot.press("s")
        await pilot.pause()
        assert app.focused_site == "site-b"
        assert app.query_one(SitesTable).cursor_row == 1
        text = screen_text(app)
        assert "site-b: compute efficiency" in text and "site-b: sync seconds" in text
        await pilot.press("s")
        assert app.focused_site == "site-a"  # wraps around


def log_rows(app) -> list[str]:
    """The log view's rows as shown (a long line is several rows)."""
    return [strip.text.rstrip() for strip in app.screen.query_one("#site-log").lines]


async def test_l_shows_the_focused_sites_log(store, store_path, tmp_path):
    make_run(store, log_dir=tmp_path)
    (tmp_path / "site-a.log").write_text("alpha line 1\nalpha line 2\n")
    (tmp_path / "site-b.log").write_text("bravo line 1\nbravo line 2\n")
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("s", "l")
        assert isinstance(app.screen, SiteLogScreen) and app.screen.site == "site-b"
        await settle(app, pilot)
        assert log_rows(app) == ["bravo line 1", "bravo line 2"]
        with open(tmp_path / "site-b.log", "a") as f:  # the log is followed while open
            f.write("bravo line 3\n")
        app.screen.read_more()
        await settle(app, pilot)
        assert log_rows(app)[-1] == "bravo line 3"
        await pilot.press("escape")
        assert not isinstance(app.screen, SiteLogScreen)


async def test_q_quits_from_the_log_view_and_library_chatter_stays_out(store, store_path, tmp_path):
    """Issue 42: help says q quits, and in the log view it went back instead; the view was all
    torchft INFO lines."""
    make_run(store, log_dir=tmp_path)
    (tmp_path / "site-a.log").write_text(
        "2026-12-01T20:42:16.869 [INFO] [torchft::manager] - quorum tick\n"
        "[rank0]: round 1 done\n")
    (tmp_path / "site-b.log").write_text("")
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        assert isinstance(app.screen, SiteLogScreen)
        await settle(app, pilot)
        assert log_rows(app) == ["[rank0]: round 1 done"]
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0 and not app.is_running


async def test_the_log_view_wraps_long_lines_at_80_columns(store, store_path, tmp_path):
    """Issue 42: at 80x24 the log view cut lines at the terminal's edge, so a failure's cause (the
    end of torchrun's error line) could not be read."""
    make_run(store, log_dir=tmp_path)
    long = ("[rank0]: ValueError: data.path /home/user/corpus/shards does not exist: " + "word " * 30
            + "THE-END-OF-THE-LINE")
    (tmp_path / "site-a.log").write_text(f"short line\n{long}\n")
    (tmp_path / "site-b.log").write_text("")
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("l")
        await settle(app, pilot)
        await pilot.pause()
        log = app.screen.query_one("#site-log")
        rows = log_rows(app)
        assert rows[0] == "short line" and len(rows) >= 4, rows  # the long line is 3+ rows
        assert all(len(r) <= log.scrollable_content_region.width <= 80 for r in rows), rows
        assert " ".join(" ".join(rows[1:]).split()) == " ".join(long.split())  # nothing cut
        assert "THE-END-OF-THE-LINE" in screen_text(app)  # and its end is on screen
        assert log.virtual_size.width <= log.scrollable_content_region.width  # no sideways scroll


async def test_a_run_that_failed_before_its_first_round_says_why(store, store_path):
    run = make_run(store, with_data=False)
    store.set_run_state(run.id, "failed", reason="site-a failed before its first round: error: data.path: x")
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        text = screen_text(app)
    assert f"Run {run.id} failed before its first round: site-a failed" in text
    assert "has no rounds recorded yet" not in text


async def test_p_pauses_updates(store, store_path):
    run = make_run(store, rounds=3)
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW, refresh_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("p")
        assert app.paused
        await settle(app, pilot)
        assert "PAUSED" in screen_text(app)
        seen = app.refreshes
        with Store.open(store_path) as other:
            add_rounds(other, run.id, "site-a", 4, 4)
        await pilot.pause(0.6)  # six refresh periods
        assert app.refreshes == seen and round_cell(app, "site-a") == "3"
        await pilot.press("p")
        await wait_for(pilot, lambda: app.refreshes > seen)
        await pilot.pause()
        assert round_cell(app, "site-a") == "4" and "PAUSED" not in screen_text(app)


async def test_command_palette_has_the_dashboard_commands(store, store_path):
    make_run(store)
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert {"Refresh now", "Pause / resume updates", "Focus site site-b", "Log of site site-a"} <= set(titles)
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"pause / resume")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.paused)


async def test_no_runs_shows_an_empty_state(store_path):
    Store.open(store_path).close()
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        text = screen_text(app)
        assert "No runs recorded yet" in text and "dilococtl watch: no run" in text
        assert not app.query_one("#plots").display


async def test_a_run_without_rounds_shows_an_empty_state(store, store_path):
    run = make_run(store, with_data=False)
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        text = screen_text(app)
        assert f"Run {run.id} (running) has no rounds recorded yet" in text
        assert round_cell(app, "site-a") == "0"
        assert "rounds 0/10 (10 left)" in text and "ETA -" in text
        with Store.open(store_path) as other:  # the first rounds arrive: curves replace the message
            add_rounds(other, run.id, "site-a", 1, 2)
        await pilot.press("r")
        await settle(app, pilot)
        text = screen_text(app)
        assert app.query_one("#plots").display and "has no rounds" not in text
        assert "validation perplexity vs global tokens" in text
        assert "666.67kB/s" in text  # cells that grew from "-" are shown whole (the column widens)


async def test_a_node_that_stops_answering_does_not_freeze_the_view(store, store_path):
    run = make_run(store, rounds=3)
    release = threading.Event()
    calls = []

    def hung_collector(r):  # an SSH read that never comes back (until the test ends)
        calls.append(r.id)
        release.wait(30)

    app = make_app(store_path=store_path, collector=hung_collector, clock=lambda: NOW, refresh_s=0.1)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: calls)
            with Store.open(store_path) as other:
                add_rounds(other, run.id, "site-a", 4, 6)
            await wait_for(pilot, lambda: round_cell(app, "site-a") == "6")
            # after STALLED_AFTER refresh periods the header says so (the 0.1 s refreshes go on)
            await wait_for(pilot, lambda: "nodes: not answering for" in screen_text(app))
            assert calls == [run.id]  # never a second collection on top of the stuck one
            release.set()
            await asyncio.sleep(0)
    finally:
        release.set()


async def test_collector_errors_are_shown(store, store_path):
    make_run(store, rounds=3)

    def failing(r):
        raise Unreachable("gpu-a1: ssh connect failed: Connection refused")

    app = make_app(store_path=store_path, collector=failing, clock=lambda: NOW, refresh_s=3600)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("r")
        await settle(app, pilot)
        assert "nodes: gpu-a1: ssh connect failed: Connection refused" in screen_text(app)
        assert round_cell(app, "site-a") == "3"  # the store is still shown


async def test_finished_runs_are_replayed_without_collecting(store, store_path):
    make_run(store, state="finished", rounds=10)
    calls = []
    app = make_app(store_path=store_path, collector=calls.append, clock=lambda: NOW, refresh_s=3600)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("r")
        await settle(app, pilot)
        text = screen_text(app)
        assert calls == []
        assert "replay from the store (run finished)" in text
        assert "elapsed 0:02:05" in text  # 10 rounds of 12 s + 5 s, not up to the frozen now


@pytest.mark.parametrize("state", ["finished", "running"])
async def test_default_run_is_the_newest_active_else_the_newest(store, store_path, state):
    older = make_run(store, run_id="20260101-000000-0001", state="running")
    store.db.conn.execute("UPDATE runs SET created = created - 10 WHERE id = ?", (older.id,))
    store.db.conn.commit()
    if state == "finished":  # no active run left: the newest run is shown
        store.set_run_state(older.id, "stopped")
    newer = make_run(store, run_id="20260101-000000-0002", state="finished")
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        expected = newer if state == "finished" else older
        assert app.snapshot.run.id == expected.id


async def test_header_shows_the_sync_share_beside_the_tune_h_prediction(store, store_path):
    run = make_run(store, rounds=3)
    # rounds of site-a: 1.5 s sync, site-b: 2.5 s, in rounds of ROUND_S seconds each
    store.add_tune(spec_path=run.spec_path, links=[], step_s=0.1, payload_bytes=500_000, h=20, budget=0.1,
                   prediction={"sync_share": 0.083})
    app = make_app(store_path=store_path, collect=False, clock=lambda: NOW, refresh_s=3600)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        from tests.tui.fixtures import ROUND_S

        text = screen_text(app)
        # the sites' sync seconds over their round seconds, summed over the records (issue 42)
        assert f"sync {(1.5 + 2.5) / (2 * ROUND_S) * 100:.1f}% of round time (tune-h 8.3%)" in text, text[:400]
