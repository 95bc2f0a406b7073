"""What the dashboard shows, read from the store off the UI thread. No textual import here.

`Loader.load()` runs in a worker thread with its own store connection and returns a `Snapshot`;
the app applies it on the UI thread. `NodeCollector` pulls new metrics from the nodes into the
store (dilococtl.runs.refresh) in another worker, so a slow or dead node delays nothing but itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dilococtl import goodput, metrics, queries
from dilococtl.metrics import RunMetrics
from dilococtl.queries import SeriesCache, SiteStat
from dilococtl.states import ACTIVE_RUN_STATES
from dilococtl.store import Event, Node, Run, Store

EVENT_BACKLOG = 300  # events shown when a view opens (the newest); later ones are appended
ETA_WINDOW_BUCKETS = 3  # the ETA uses the mean round time of each site's newest buckets


@dataclass(kw_only=True, slots=True)
class Snapshot:
    """One refresh worth of data for the dashboard."""

    run: Run | None  # None: no run recorded (yet)
    mode: str = ""  # diloco.mode of the run's spec
    rounds_planned: int = 0
    sites: list[SiteStat] = field(default_factory=list)
    series: queries.Series | None = None
    events: list[Event] = field(default_factory=list)  # new since the previous snapshot
    nodes: list[Node] = field(default_factory=list)
    load_s: float = 0.0  # seconds the load took (for the benchmark and the status line)
    predicted_sync_share: float | None = None  # from the tune-h run made for this spec and H
    metrics: RunMetrics | None = None  # the run's derived figures (dilococtl.metrics), as status shows them
    stalled: dict | None = None  # sites waiting on an unreachable coordinator (dilococtl.queries.stall)
    goodput: float | None = None  # share of the sites' wall time that reached θ (dilococtl.goodput), as status

    @property
    def rounds_done(self) -> int:
        return max((s.round for s in self.sites), default=0)

    @property
    def has_rounds(self) -> bool:
        return self.series is not None and not self.series.empty

    @property
    def active(self) -> bool:
        return self.run is not None and self.run.state in ACTIVE_RUN_STATES

    def elapsed_s(self, now: float) -> float:
        """Seconds since launch; up to the end for a run that has ended."""
        if self.run is None:
            return 0.0
        end = self.run.finished if (self.run.finished and not self.active) else now
        return max(0.0, end - self.run.created)

    def eta_s(self) -> float | None:
        """Seconds left at the recent pace of the slowest site; None when unknown or not running."""
        if not self.active or self.series is None or self.rounds_planned <= 0:
            return None
        left = max(0, self.rounds_planned - self.rounds_done)
        paces = []
        for buckets in self.series.sites.values():
            recent = buckets[-ETA_WINDOW_BUCKETS:]
            n = sum(b.n for b in recent)
            if n:
                paces.append(sum(b.compute_s + b.sync_s for b in recent) / n)
        return left * max(paces) if paces else None


class _OwnStore:
    """A store connection of one worker; close() never closes it under a call in flight."""

    def __init__(self, store_path: str | Path | None) -> None:
        self.store_path = store_path
        self._store: Store | None = None
        self._lock = threading.Lock()  # held by a load/collection while it uses the connection
        self._closed = False

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store.open(self.store_path)
        return self._store

    def close(self) -> None:
        """Close now, or when the call in flight ends: quitting never waits for it (or a dead node)."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            try:
                self._close_store()
            finally:
                self._lock.release()

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


GOODPUT_EVERY_S = 10.0  # see Loader._goodput_of


class Loader(_OwnStore):
    """Reads snapshots of one run (or of the newest run, once there is one) from the store."""

    def __init__(self, store_path: str | Path | None, run_id: str | None = None, *,
                 max_points: int = queries.DEFAULT_POINTS, backlog: int = EVENT_BACKLOG,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(store_path)
        self.run_id = run_id
        self.clock = clock  # "now" of a running run's wall time (goodput); tests freeze it
        self.backlog = backlog
        self.cache = SeriesCache(max_points)
        self._last_event = 0
        self._spec: tuple[str, str, int, float | None] | None = None  # (run id, mode, rounds, predicted share)
        self._goodput: tuple[tuple[str, str], float, float | None] | None = None  # ((run, state), when, goodput)

    def _goodput_of(self, run: Run, store) -> float | None:
        """The run's goodput (dilococtl.goodput), computed at most every GOODPUT_EVERY_S: its sums read every
        round row, 60 ms of a 100 ms refresh at 100k rows, for a figure that moves slowly."""
        now, key = self.clock(), (run.id, run.state)
        if self._goodput is None or self._goodput[0] != key or \
                (run.state in ACTIVE_RUN_STATES and now - self._goodput[1] >= GOODPUT_EVERY_S):
            self._goodput = (key, now, goodput.ledger(run, store, now=now).goodput)
        return self._goodput[2]

    def find_run(self) -> Run | None:
        """The run to show; without an id, the newest active run, else the newest (then kept)."""
        run = queries.watched_run(self.store, self.run_id)
        if run is not None:
            self.run_id = run.id
        return run

    def load(self, *, full: bool = False) -> Snapshot:
        """A snapshot; `full` drops the cached plot buckets and reads them all again."""
        with self._lock:
            try:
                return self._load(full)
            finally:
                if self._closed:
                    self._close_store()

    def _load(self, full: bool) -> Snapshot:
        t0 = time.perf_counter()
        run = self.find_run()
        if run is None:
            return Snapshot(run=None, load_s=time.perf_counter() - t0)
        if full:
            self.cache.clear()
        store = self.store
        if self._spec is None or self._spec[0] != run.id:
            from dilococtl.tune.history import tune_for

            spec = run.spec()
            tune = tune_for(store, run)
            predicted = tune.prediction.get("sync_share") if tune else None
            self._spec = (run.id, spec.diloco.mode, spec.diloco.rounds, predicted)
            self._last_event = 0
        series = self.cache.series(store, run.id)
        events = queries.recent_events(store, run.id, after_id=self._last_event, limit=self.backlog)
        if events:
            self._last_event = max(e.id for e in events)
        sites = queries.site_stats(store, run.id, series)
        return Snapshot(run=run, mode=self._spec[1], rounds_planned=self._spec[2], predicted_sync_share=self._spec[3],
                        sites=sites, series=series, events=events, metrics=metrics.run_metrics(run, series.round_time, sites),
                        nodes=store.nodes(run.id), load_s=time.perf_counter() - t0,
                        stalled=queries.stall(store, run.id) if run.state in ACTIVE_RUN_STATES else None,
                        goodput=self._goodput_of(run, store))


class NodeCollector(_OwnStore):
    """Pulls new metric lines from the run's nodes into the store and updates states.

    Called from a worker thread, one call at a time; keeps its own store connection.
    `pool` returns the app's NodePool (shared with the log view).
    """

    def __init__(self, store_path: str | Path | None, pool: Callable[[Run], object]) -> None:
        super().__init__(store_path)
        self.pool = pool

    def __call__(self, run: Run) -> Run:
        from dilococtl import runs as runs_mod

        with self._lock:
            try:
                return runs_mod.refresh(run, store=self.store, pool=self.pool(run))
            finally:
                if self._closed:
                    self._close_store()
