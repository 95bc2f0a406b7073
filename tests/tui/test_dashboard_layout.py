"""The dashboard at 80x24 and 160x45, driven with Pilot: what fits, sorting, the events pane
(scroll, filter), `?` for the columns, and the perplexity plot's one x axis (global tokens)."""

from __future__ import annotations

import pytest

from dilococtl import columns
from dilococtl.queries import series
from dilococtl.tui.app import make_app
from dilococtl.tui.screens.help import HelpScreen
from dilococtl.tui.widgets.events import EventsLog
from dilococtl.tui.widgets.plots import Plots, global_x, render_ppl
from dilococtl.tui.widgets.sites import SitesTable
from tests.tui.fixtures import NOW, T0, make_run
from tests.tui.test_watch_pilot import screen_text, settle

pytestmark = pytest.mark.anyio
SMALL, LARGE = (80, 24), (160, 45)


def app_for(store_path):
    return make_app(store_path=store_path, collect=False, clock=lambda: NOW, refresh_s=3600)


def table_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("│ site ")]


@pytest.mark.parametrize("size", [SMALL, LARGE])
async def test_every_line_fits_and_the_essentials_are_there(store, store_path, size):
    make_run(store, rounds=8, preempted="site-b")
    app = app_for(store_path)
    async with app.run_test(size=size) as pilot:
        await settle(app, pilot)
        text = screen_text(app)
        lines = text.splitlines()
        assert len(lines) == size[1] and all(len(ln) <= size[0] for ln in lines)
        (head,) = table_lines(text)
        for name in ("site", "state", "round", "K", "eff", "sync s", "WAN", "tok/s", "val ppl"):
            assert f" {name} " in head + " ", (name, head)
        if size == LARGE:
            assert all(f" {c.name} " in head + " " for c in columns.SITE_COLUMNS)
        else:
            assert "column(s) need a wider terminal" in text
        # the header: whole phrases, the sync share always
        top = lines[:2]
        assert any("rounds 8/10 (2 left)" in ln for ln in top)
        assert any("sync 16.1% of round time" in ln for ln in top)  # (8 x 1.5 + 6 x 2.5) / (14 x 12) s: records summed
        # the plots have room (more than a row), the events pane keeps its border
        assert "validation perplexity vs global tokens" in text
        assert sum("┤" in ln for ln in lines) >= 3  # y labels every 2+ rows (evenly spaced, issue 42)
        events_top = next(i for i, ln in enumerate(lines) if ln.startswith("╭─ events"))
        events_bottom = next(i for i, ln in enumerate(lines) if i > events_top and ln.startswith("╰"))
        assert events_bottom - events_top - 1 >= (3 if size == SMALL else 8)
        assert lines[-1].lstrip().startswith("q Quit")


async def test_the_table_does_not_scroll_sideways(store, store_path):
    make_run(store, rounds=8, preempted="site-b")
    app = app_for(store_path)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        table = app.query_one(SitesTable)
        before = screen_text(app)
        await pilot.press("right", "right", "right")
        await pilot.pause()
        assert table.scroll_x == 0 and table_lines(screen_text(app)) == table_lines(before)


async def test_rows_sort_by_a_column_either_way(store, store_path):
    make_run(store, rounds=8, preempted="site-b")  # val ppl: site-a 25.21 (8 rounds), site-b 28.49 (6)
    app = app_for(store_path)
    async with app.run_test(size=LARGE) as pilot:
        await settle(app, pilot)
        table = app.query_one(SitesTable)

        def order():
            return [k.value for k in table.rows]

        assert order() == ["site-a", "site-b"]
        presses = 0
        while table.sort_key != "val_ppl":
            await pilot.press("o")
            presses += 1
            assert presses <= len(columns.SITE_COLUMNS)
        await pilot.press("O")
        await pilot.pause()
        assert order() == ["site-b", "site-a"] and "sites · by val ppl ↓" in screen_text(app)
        table.sort_by("round")
        await pilot.pause()
        assert order() == ["site-b", "site-a"]  # 6 before 8
        table.sort_by("round")  # the same column again: the other way
        await pilot.pause()
        assert order() == ["site-a", "site-b"]
        # a row can be selected: the focused site (plots, log) is the row under the cursor
        focused = set()
        for key in ("up", "down", "up", "down"):
            await pilot.press(key)
            await pilot.pause()
            assert app.focused_site == order()[table.cursor_row]
            focused.add(app.focused_site)
        assert focused == {"site-a", "site-b"}


async def test_the_events_pane_scrolls_and_filters(store, store_path):
    run = make_run(store, rounds=8, preempted="site-b")
    for i in range(50):  # many events: more than the pane shows
        store.add_event(run.id, "quorum" if i % 10 else "rejected", f"event number {i}", site="site-a",
                        round=8, t=T0 + 200 + i)
    app = app_for(store_path)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        events = app.query_one(EventsLog)
        total = events.count
        assert total > 50 and "event number 49" in screen_text(app)  # follows the newest
        await pilot.press("e")
        assert events.has_focus
        await pilot.press("home")
        await pilot.pause()
        text = screen_text(app)
        assert "start" in text and "event number 49" not in text  # scrolled to the oldest
        await pilot.press("e")
        assert app.query_one(SitesTable).has_focus
        seen = []
        for _ in range(4):
            await pilot.press("f")
            await pilot.pause()
            seen.append(events.border_title)
        assert seen == [f"events · heals (1 of {total})", f"events · quorum changes (45 of {total})",
                        f"events · rejections (5 of {total})", f"events · problems (6 of {total})"]
        assert all(e.event in ("rejected", "preempted", "error") for e in events.shown())
        await pilot.press("f")
        assert events.border_title == "events" and len(events.shown()) == total


async def test_help_explains_every_column(store, store_path):
    make_run(store)
    app = app_for(store_path)
    async with app.run_test(size=LARGE) as pilot:
        await settle(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        text = screen_text(app)
        for c in columns.SITE_COLUMNS:
            assert c.help[:40] in " ".join(text.split()), c.name
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_a_narrow_terminal_shows_one_plot_at_a_time(store, store_path):
    make_run(store, rounds=6)
    app = app_for(store_path)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        assert "validation perplexity" in screen_text(app) and "compute efficiency" not in screen_text(app)
        await pilot.press("v")
        await settle(app, pilot)
        text = screen_text(app)
        assert "site-a: compute efficiency" in text and "validation perplexity" not in text
        await pilot.press("v")
        await settle(app, pilot)
        assert "site-a: sync seconds per round" in screen_text(app)
        await pilot.resize_terminal(*LARGE)
        await settle(app, pilot)
        text = screen_text(app)
        assert all(t in text for t in ("validation perplexity", "compute efficiency", "sync seconds"))
        assert app.query_one(Plots).wide()


def test_every_perplexity_curve_is_drawn_against_global_tokens(store):
    run = make_run(store, rounds=6)
    s = series(store, run.id)
    # each site trains 20 * 1024 tokens a round: at round r both sites together have 2 * 20480 * r
    assert global_x(s) == {r - 1: 2 * 20480 * r for r in range(1, 7)}
    text = render_ppl(s, 100, 20).plain
    assert "245760" in text  # the axis reaches the global tokens of round 6 ...
    assert all(str(20480 * r) not in text.split() for r in (5, 6))  # ... not a site's own 122880
