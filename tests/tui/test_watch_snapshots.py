"""Snapshot tests of the dashboard (pytest-textual-snapshot) at the two sizes it is laid out for:
80x24 (a plain terminal: the essential columns, one plot, a bordered events pane) and 160x45
(every column, the three plots). A running run, a finished run and a run with a preempted site.
Run ids, times and the clock are fixed (tests/tui/fixtures.py), and the app does not collect from
nodes, so the screens are the same on every machine.

Update after an intended change: `pytest tests/tui/test_watch_snapshots.py --snapshot-update`, then
look at the SVGs under tests/tui/__snapshots__/ before committing them.
"""

from __future__ import annotations

import pytest

from dilococtl.tui.app import make_app
from tests.tui.fixtures import NOW, make_run

SIZES = {"80x24": (80, 24), "160x45": (160, 45)}


async def loaded(pilot) -> None:
    from tests.tui.test_watch_pilot import settle

    await settle(pilot.app, pilot)


def app_for(store_path):
    # refresh_s: no timer tick while the screenshot is taken
    return make_app(store_path=store_path, collect=False, clock=lambda: NOW, refresh_s=3600)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("kind", ["running", "finished", "preempted_site"])
def test_dashboard_snapshot(snap_compare, store, store_path, kind, size):
    if kind == "running":
        make_run(store, rounds=6)
    elif kind == "finished":
        make_run(store, state="finished", rounds=10)
    else:
        make_run(store, rounds=8, preempted="site-b")
    assert snap_compare(app_for(store_path), terminal_size=SIZES[size], run_before=loaded)


def test_help_snapshot_at_80x24(snap_compare, store, store_path):
    make_run(store, rounds=6)

    async def help_open(pilot):
        await loaded(pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(app_for(store_path), terminal_size=SIZES["80x24"], run_before=help_open)
