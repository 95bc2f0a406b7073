"""The dashboard app and its factory (shared by `dilococtl watch` and the tests).

Every refresh_s seconds (and on `r`) two thread workers may run: the loader reads a Snapshot
from the store, and, for an active run, the collector pulls new metric lines from the nodes
(dilococtl.runs.refresh). Neither runs twice at once, the UI thread only applies finished
snapshots, and a collector stuck on a dead node is shown as "not answering" while the store
keeps being read.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import DataTable, Footer

from dilococtl.errors import DilocoError
from dilococtl.states import ACTIVE_RUN_STATES
from dilococtl.store import Run
from dilococtl.tui.data import Loader, NodeCollector, Snapshot
from dilococtl.tui.screens.help import HelpScreen
from dilococtl.tui.screens.site_log import SiteLogScreen
from dilococtl.tui.widgets.events import EventsLog
from dilococtl.tui.widgets.header import RunHeader
from dilococtl.tui.widgets.plots import WIDE, EmptyState, Plots, render_plots
from dilococtl.tui.widgets.sites import SitesTable

TALL = 36  # rows from which the events pane grows (.tcss: Screen.-tall)
REFRESH_S = 2.0  # seconds between two refreshes
STALLED_AFTER = 2.0  # a collection running longer than this many refresh periods: "not answering"

Collector = Callable[[Run], object]


def _while_mounted(fn):
    """For timer and worker callbacks: while the app shuts down its widgets are gone; do nothing then."""

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        try:
            return fn(*args, **kw)
        except NoMatches:
            return None

    return wrapper


class DashboardApp(App[None]):
    """`dilococtl watch`: one run's header, sites, curves and events."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "dilococtl watch"
    # laid out for 80x24 first; the screen gets -wide from 120 columns and -tall from 36 rows (.tcss)
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (WIDE, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (TALL, "-tall")]
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("s", "cycle_site", "Site"),
        Binding("o", "sort", "Sort"),
        Binding("f", "filter_events", "Events"),
        Binding("v", "next_plot", "Plot"),
        Binding("l", "site_log", "Log"),
        Binding("e", "focus_events", "Scroll events", show=False),
        Binding("O", "reverse_sort", "Reverse sort", show=False),
        Binding("r", "refresh_now", "Refresh", show=False),
        Binding("p", "toggle_pause", "Pause", show=False),
    ]
    HELP = [  # (key, what it does): the help screen shows exactly these
        ("q", "quit"),
        ("?", "this help: the keys and what each column means"),
        ("s", "focus the next site (its row, efficiency and sync plots); or up/down, or click a row"),
        ("o", "sort the sites by the next column (O: the other way); or click a column's name"),
        ("O", "reverse the sort"),
        ("f", "filter the events: all, heals, quorum changes, rejections, problems"),
        ("e", "move the focus to the events to scroll them (e again: back to the sites)"),
        ("v", "show the next plot when only one fits (narrower than 120 columns)"),
        ("l", "the focused site's trainer log (Esc to come back)"),
        ("r", "refresh now: re-read the store (all plot data) and collect from the nodes"),
        ("p", "pause / resume updates"),
        ("ctrl+p", "command palette"),
    ]

    paused: reactive[bool] = reactive(False)
    focused_site: reactive[str] = reactive("")

    def __init__(self, *, loader: Loader, collector: Collector | None, refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.time, pool_factory: Callable[[Run], object] | None = None):
        super().__init__()
        self.loader = loader
        self.collector = collector
        self.refresh_s = refresh_s
        self.clock = clock
        self.snapshot = Snapshot(run=None)
        self.refreshes = 0  # snapshots applied
        self.collect_error: str | None = None
        self.collected_at: float | None = None  # monotonic time the last collection ended
        self._pool_factory = pool_factory
        self._pool: object | None = None
        self._pool_lock = threading.Lock()
        self._loading = False
        self._reload: bool | None = None  # a load asked for while one runs: full or not
        self._collect_since: float | None = None  # monotonic start of the collection in flight
        self._plot_key: tuple | None = None

    # --- layout ---------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        with Vertical(id="main"):
            table = SitesTable(id="sites")
            table.border_title = "sites"
            yield table
            yield EmptyState("", id="empty")
            yield Plots(id="plots")
            events = EventsLog(id="events")
            events.border_title = "events"
            yield events
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#plots").display = False
        self.query_one("#empty").update("loading…")
        self.refresh_now()
        self.set_interval(self.refresh_s, self._tick)

    def on_unmount(self) -> None:
        self.loader.close()
        if isinstance(self.collector, NodeCollector):
            self.collector.close()
        if self._pool is not None:
            self._pool.close()

    # --- the node pool (collector and log view share it) --------------------------------------

    def pool(self, run: Run | None = None) -> object:
        with self._pool_lock:
            if self._pool is None:
                run = run or self.snapshot.run
                if self._pool_factory is not None:
                    self._pool = self._pool_factory(run)
                else:
                    from dilococtl.nodes import NodePool

                    self._pool = NodePool(run.spec().ssh)
            return self._pool

    # --- refreshing -----------------------------------------------------------------------------

    @_while_mounted
    def _tick(self) -> None:
        if not self.paused:
            self.refresh_now(full=False)
        else:
            self._show_header()

    def refresh_now(self, full: bool = True) -> None:
        """Start a load (and a collection, for an active run) unless one is already running."""
        self._start_collect()
        if self._loading:
            self._reload = bool(self._reload) or full
            return
        self._loading = True
        self._load(full, self.focused_site, self._plot_sizes(), self._plot_key)

    @work(thread=True, group="load", exit_on_error=False)
    def _load(self, full: bool, site: str, sizes: dict | None, drawn: tuple | None) -> None:
        try:
            snap = self.loader.load(full=full)
        except Exception as e:  # a locked or broken store must not kill the view
            self.call_from_thread(self._load_failed, e)
            return
        plots, key = None, None
        if snap.has_rounds and sizes is not None:
            site = site if site in snap.series.sites else next(iter(snap.series.sites), "")
            key = plots_key(snap, site, sizes)
            if key != drawn:  # plotting costs; skip when nothing it shows changed
                plots = render_plots(snap.series, site, sizes)
        self.call_from_thread(self.apply, snap, plots, key)

    def _plot_sizes(self) -> dict[str, tuple[int, int]] | None:
        """The plots' sizes now; None while they are not laid out (hidden)."""
        sizes = self.query_one(Plots).sizes()
        return sizes if all(w > 0 and h > 0 for w, h in sizes.values()) else None

    @_while_mounted
    def replot(self) -> None:
        """Draw the plots again (focused site or size changed), in a worker."""
        sizes = self._plot_sizes()
        if self.snapshot.has_rounds and sizes is not None:
            key = plots_key(self.snapshot, self.focused_site, sizes)
            if key != self._plot_key:
                self._replot(self.snapshot, self.focused_site, sizes, key)

    @work(thread=True, group="plots", exclusive=True, exit_on_error=False)
    def _replot(self, snap: Snapshot, site: str, sizes: dict, key: tuple) -> None:
        plots = render_plots(snap.series, site, sizes)
        self.call_from_thread(self._show_drawn, plots, key)

    @_while_mounted
    def _show_drawn(self, plots: dict, key: tuple) -> None:
        if key[0] == self.focused_site:  # not overtaken by another `s`
            self.query_one(Plots).show(plots)
            self._plot_key = key

    def on_resize(self) -> None:
        self.call_after_refresh(self.replot)

    @_while_mounted
    def _load_failed(self, e: Exception) -> None:
        self._loading = False
        self.collect_error = f"store: {e}"
        self._show_header()

    def _start_collect(self) -> None:
        run = self.snapshot.run
        if self.collector is None or run is None or not self.snapshot.active or self._collect_since is not None:
            return
        self._collect_since = time.monotonic()
        self._collect(run)

    @work(thread=True, group="collect", exit_on_error=False)
    def _collect(self, run: Run) -> None:
        error = None
        try:
            self.collector(run)
        except DilocoError as e:
            error = str(e)
        except Exception as e:  # shown, never raised into the UI
            error = f"{type(e).__name__}: {e}"
        self.call_from_thread(self._collected, error)

    @_while_mounted
    def _collected(self, error: str | None) -> None:
        self._collect_since = None
        self.collected_at = time.monotonic()
        self.collect_error = error
        if not self.paused:  # what the collection brought in: show it now, not in refresh_s
            self.refresh_now(full=False)

    @_while_mounted
    def apply(self, snap: Snapshot, plots: dict | None = None, plot_key: tuple | None = None) -> None:
        """Show a snapshot, and the plots drawn for it if any (UI thread)."""
        self._loading = False
        self.refreshes += 1
        prev_run = self.snapshot.run.id if self.snapshot.run else None
        self.snapshot = snap
        if snap.run is not None and snap.run.id != prev_run:
            self.sub_title = f"{snap.run.name} {snap.run.id}"
        names = [s.site for s in snap.sites]
        if names and self.focused_site not in names:
            self.focused_site = names[0]
        self._show_header()
        self.query_one(SitesTable).show(snap.sites, snap.nodes, self.focused_site)
        if snap.run is not None and snap.events:
            self.query_one(EventsLog).add(snap.events, since=snap.run.created)
        self._show_plots()
        if plots is not None and plot_key is not None and plot_key[0] == self.focused_site:
            self.query_one(Plots).show(plots)
            self._plot_key = plot_key
        elif snap.has_rounds:
            self.call_after_refresh(self.replot)  # e.g. the plots were hidden until now: no size yet
        if self._reload is not None:
            full, self._reload = self._reload, None
            self.refresh_now(full=full)

    def status(self) -> str:
        """The collector's state, in words (second header line)."""
        if self.snapshot.run is None:
            return ""
        if not self.snapshot.active:
            return f"replay from the store (run {self.snapshot.run.state})"
        if self.collector is None:
            return "store only: not collecting from the nodes"
        if self._collect_since is not None:
            waited = time.monotonic() - self._collect_since
            if waited > STALLED_AFTER * self.refresh_s:
                return f"nodes: not answering for {waited:.0f}s (view shows what the store has)"
        if self.collect_error:
            return f"nodes: {self.collect_error}"
        return "nodes: ok" if self.collected_at is not None else "nodes: collecting…"

    def _show_header(self) -> None:
        self.query_one(RunHeader).show(self.snapshot, now=self.clock(), status=self.status(), paused=self.paused)

    def _show_plots(self) -> None:
        snap = self.snapshot
        empty, plots = self.query_one("#empty", EmptyState), self.query_one("#plots", Plots)
        if snap.run is None:
            empty.update("No runs recorded yet.\n\nStart one with `dilococtl launch SPEC`; "
                         "this view picks it up by itself.")
        elif not snap.has_rounds and snap.run.state not in ACTIVE_RUN_STATES:  # it ended: no curves will come
            empty.update(f"Run {snap.run.id} {snap.run.state} before its first round"
                         + (f": {snap.run.exit_reason}" if snap.run.exit_reason else ".")
                         + f"\n\n`dilococtl logs {snap.run.id}` shows its nodes' logs.")
        elif not snap.has_rounds:
            empty.update(f"Run {snap.run.id} ({snap.run.state}) has no rounds recorded yet.\n\n"
                         "Curves appear after the first outer round.")
        empty.display = not snap.has_rounds
        plots.display = snap.has_rounds

    # --- keys and commands --------------------------------------------------------------------

    def watch_paused(self, paused: bool) -> None:
        if self.is_mounted:
            _while_mounted(self._show_header)()

    def watch_focused_site(self, site: str) -> None:
        if not self.is_mounted:
            return
        try:
            self.query_one(SitesTable).focus_site(site)
        except NoMatches:
            return
        self.replot()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.cursor_row != event.data_table.cursor_row:
            return  # stale: posted while the rows were rebuilt (a sort); would pull the cursor back
        if event.row_key is not None and event.row_key.value:
            self.focused_site = event.row_key.value

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            from dilococtl.columns import SITE_COLUMNS

            self.push_screen(HelpScreen(self.HELP, [(c.name, c.help) for c in SITE_COLUMNS]))

    def action_sort(self) -> None:
        self.query_one(SitesTable).cycle_sort()

    def action_reverse_sort(self) -> None:
        table = self.query_one(SitesTable)
        table.sort_by(table.sort_key, reverse=not table.sort_reverse)

    def action_filter_events(self) -> None:
        self.query_one(EventsLog).cycle_filter()

    def action_focus_events(self) -> None:
        events, table = self.query_one(EventsLog), self.query_one(SitesTable)
        (table if events.has_focus else events).focus()

    def action_next_plot(self) -> None:
        self.query_one(Plots).cycle()

    def action_refresh_now(self) -> None:
        self.refresh_now(full=True)

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused

    def action_cycle_site(self) -> None:
        names = [s.site for s in self.snapshot.sites]
        if names:
            i = names.index(self.focused_site) if self.focused_site in names else -1
            self.focused_site = names[(i + 1) % len(names)]

    def action_site_log(self) -> None:
        if self.snapshot.run is None or not self.focused_site:
            self.notify("no site to show the log of", severity="warning")
            return
        run = self.snapshot.run
        self.push_screen(SiteLogScreen(self.focused_site, self.snapshot.nodes, lambda: self.pool(run)))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Refresh now", "Re-read the store and collect from the nodes", self.action_refresh_now)
        yield SystemCommand("Pause / resume updates", "Stop or restart the 2 s refresh", self.action_toggle_pause)
        yield SystemCommand("Help", "The dashboard's keys", self.action_help)
        for site in [s.site for s in self.snapshot.sites]:
            yield SystemCommand(f"Focus site {site}", f"Show {site}'s row and plots",
                                lambda site=site: setattr(self, "focused_site", site))
            yield SystemCommand(f"Log of site {site}", f"{site}'s trainer log",
                                lambda site=site: (setattr(self, "focused_site", site), self.action_site_log()))


def plots_key(snap: Snapshot, site: str, sizes: dict) -> tuple:
    """What the plots depend on: the focused site, their sizes, and the newest bucket of each site."""
    return (site, tuple(sorted(sizes.items())), snap.series.bucket_rounds, tuple(
        (name, len(bs), bs[-1].round, bs[-1].n, bs[-1].t) if bs else (name, 0)
        for name, bs in snap.series.sites.items()))


def make_app(run_id: str | None = None, store_path: str | Path | None = None, *, collect: bool = True,
             collector: Collector | None = None, refresh_s: float = REFRESH_S,
             clock: Callable[[], float] = time.time, max_points: int | None = None,
             pool_factory: Callable[[Run], object] | None = None, accept_new: bool = False) -> DashboardApp:
    """The dashboard for `run_id` (default: the newest active run, else the newest run).

    collect: pull new metrics from the nodes of an active run (False: show the store only).
    collector: what collecting calls, with the run (default: dilococtl.runs.refresh over a NodePool).
    clock: "now" for the elapsed time (tests freeze it). pool_factory: the NodePool for a run.
    """
    from dilococtl import queries

    loader = Loader(store_path, run_id, max_points=max_points or queries.DEFAULT_POINTS, clock=clock)
    if pool_factory is None and accept_new:
        def pool_factory(run: Run) -> object:
            from dilococtl.nodes import NodePool

            return NodePool(run.spec().ssh, accept_new=True)
    app = DashboardApp(loader=loader, collector=None, refresh_s=refresh_s, clock=clock, pool_factory=pool_factory)
    if collect:
        app.collector = collector or NodeCollector(store_path, app.pool)
    return app
