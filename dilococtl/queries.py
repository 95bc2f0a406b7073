"""Read-only queries over the store for views (watch, report) that must stay fast on long runs.

A run of 100k rounds must not be loaded row by row to draw a 200-column plot: `series`
folds the rounds into at most `max_points` buckets per site with range scans of a covering index
(migration m002_view_indexes) and caches the finished buckets, and the per-site "latest" lookups walk the primary key
backwards, O(log n) each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dilococtl import metrics
from dilococtl.db import rows
from dilococtl.metrics import RoundTime
from dilococtl.store import Event, Run, Store
from trainer.rules.mfu import mfu

DEFAULT_POINTS = 160  # buckets per plotted series: a terminal plot is ~75 cells (150 braille dots) wide


@dataclass(kw_only=True, slots=True)
class Bucket:
    """Consecutive rounds of one site folded together."""

    site: str
    round: int  # last round in the bucket
    n: int  # rounds in the bucket
    tokens: int  # tokens of the site at the bucket's last round
    val_ppl: float | None  # mean of the evaluated perplexities in the bucket
    compute_s: float  # summed over the bucket
    sync_s: float  # summed over the bucket
    bytes_sent: int
    bytes_recv: int
    t: float  # time of the bucket's last round

    @property
    def efficiency(self) -> float | None:
        return metrics.efficiency(self.compute_s, self.sync_s)

    @property
    def mean_sync_s(self) -> float:
        return self.sync_s / self.n if self.n else 0.0


@dataclass(kw_only=True, slots=True)
class Series:
    """Plot-ready series of a run: per site, and global (all sites at the same round bucket)."""

    bucket_rounds: int  # rounds per bucket (1: every round is its own point)
    sites: dict[str, list[Bucket]] = field(default_factory=dict)
    global_tokens: list[int] = field(default_factory=list)  # tokens summed over sites, per bucket
    global_ppl: list[float | None] = field(default_factory=list)  # perplexity averaged over sites
    round_time: RoundTime = field(default_factory=RoundTime)  # every round once (dilococtl.metrics)
    global_at: dict[int, int] = field(default_factory=dict)  # bucket number -> global_tokens there

    def tokens_of_all(self, b: Bucket) -> int:
        """The tokens of all sites at bucket `b`: the one token axis of per-site and global curves."""
        return self.global_at.get((b.round - 1) // self.bucket_rounds, b.tokens)

    @property
    def empty(self) -> bool:
        return not any(self.sites.values())


@dataclass(kw_only=True, slots=True)
class SiteStat:
    """One row of the dashboard's sites table."""

    site: str
    state: str
    round: int = 0  # newest round recorded
    step: int = 0
    h: int | None = None
    k_active: int | None = None
    k_nominal: int | None = None
    staleness: int | None = None
    last_sync_s: float | None = None
    last_round_s: float | None = None  # compute + sync of the newest round
    efficiency: float | None = None  # compute / (compute + sync) over the whole run
    wan_bps: float | None = None  # bytes sent + received per second of sync, newest round
    mfu: float | None = None  # model FLOPs utilisation of the newest step (trainer.rules.mfu; None: peak unknown)
    tokens_per_s: float | None = None  # from the newest step record
    tokens: int = 0
    val_ppl: float | None = None  # newest evaluated perplexity
    train_loss: float | None = None  # mean inner loss of the newest round
    bytes_sent: int = 0  # over the whole run
    bytes_recv: int = 0


def newest_active_run(store: Store) -> Run | None:
    """The newest run that is launching, running or preempted."""
    return store.active_run()


def watched_run(store: Store, run: str | None = None) -> Run | None:
    """The run watch follows: `run` by id/name (BadInput if unknown), else the newest active run, else
    the newest run (dilococtl.lookup.pick_run, for the other commands, takes the newest run)."""
    if run:
        return store.get_run(run)
    return newest_active_run(store) or store.latest_run()


def max_round(store: Store, run_id: str) -> int:
    """The highest round any site recorded (0: none). One primary-key probe per site."""
    best = 0
    for s in store.sites(run_id):
        row = store.db.conn.execute("SELECT max(round) FROM rounds WHERE run_id = ? AND site = ?",
                                    (run_id, s.name)).fetchone()
        best = max(best, row[0] or 0)
    return best


def bucket_width(rounds: int, max_points: int = DEFAULT_POINTS) -> int:
    """Rounds per bucket: the smallest power of two that keeps `rounds` within `max_points` buckets.

    Powers of two keep the bucket edges fixed while a run grows (they move only when the width
    doubles), so finished buckets can be cached.
    """
    width = 1
    while rounds > width * max(1, max_points):
        width *= 2
    return width


_BUCKET_SQL = ("SELECT max(round), count(*), max(tokens), avg(val_ppl), sum(compute_s), sum(sync_s),"
               " sum(bytes_sent), sum(bytes_recv), max(t) FROM rounds"
               " WHERE run_id = ? AND site = ? AND round BETWEEN ? AND ?")


def site_buckets(store: Store, run_id: str, site: str, width: int, *, first: int = 0,
                 last_round: int | None = None) -> list[Bucket]:
    """Buckets number `first`.. of one site (bucket k holds rounds k*width+1 .. (k+1)*width).

    One range query per bucket over the covering index: no sort, no temporary B-tree, so the cost
    is the rows read (a GROUP BY on the bucket expression was 2-3x slower at 100k rows).
    """
    if last_round is None:
        row = store.db.conn.execute("SELECT max(round) FROM rounds WHERE run_id = ? AND site = ?",
                                    (run_id, site)).fetchone()
        last_round = row[0] or 0
    out = []
    for k in range(first, (last_round + width - 1) // width):
        r = store.db.conn.execute(_BUCKET_SQL, (run_id, site, k * width + 1, (k + 1) * width)).fetchone()
        if r[1]:
            out.append(Bucket(site=site, round=r[0], n=r[1], tokens=r[2] or 0, val_ppl=r[3], compute_s=r[4] or 0.0,
                              sync_s=r[5] or 0.0, bytes_sent=r[6] or 0, bytes_recv=r[7] or 0, t=r[8] or 0.0))
    return out


# dilococtl.metrics.round_time in SQL, per bucket of `width` rounds: distinct rounds, records, and
# the records' sync and round seconds summed. The covering index rounds_by_round (m003) serves it in
# round order, so the GROUP BY does not sort (a sort per bucket made watch's cold load of 100k rounds
# 3-4x slower). tests/tui/test_metrics_agree.py holds the two forms together.
_ROUND_TIME_SQL = ("SELECT (round - 1) / ? AS k, count(DISTINCT round), count(*), sum(sync_s), sum(compute_s + sync_s)"
                   " FROM rounds WHERE run_id = ? AND round BETWEEN ? AND ? GROUP BY k")


def round_times(store: Store, run_id: str, width: int, first: int, last_round: int) -> dict[int, RoundTime]:
    """metrics.RoundTime of buckets number `first`.. of `width` rounds (up to `last_round`), all sites."""
    rows = store.db.conn.execute(_ROUND_TIME_SQL, (width, run_id, first * width + 1, last_round)).fetchall()
    return {k: RoundTime(rounds=n, records=recs, sync_s=sync or 0.0, round_s=total or 0.0)
            for k, n, recs, sync, total in rows}


class SeriesCache:
    """`series` that re-reads only the newest buckets on each call.

    Finished buckets are kept; each call re-reads every site's last two buckets and anything newer
    (a site that restarts redoes its rounds since its last checkpoint, which lie there). A change of
    bucket width, or `clear()`, reads everything again. The run-wide round time (every round once)
    is kept per bucket of rounds the same way.
    """

    def __init__(self, max_points: int = DEFAULT_POINTS) -> None:
        self.max_points = max_points
        self._key: tuple[str, int] | None = None  # (run_id, width) the cached buckets belong to
        self._sites: dict[str, list[Bucket]] = {}
        self._rounds: dict[int, RoundTime] = {}  # bucket number -> round time of its rounds over all sites

    def clear(self) -> None:
        self._key, self._sites, self._rounds = None, {}, {}

    def series(self, store: Store, run_id: str) -> Series:
        last = {s.name: store.db.conn.execute("SELECT max(round) FROM rounds WHERE run_id = ? AND site = ?",
                                              (run_id, s.name)).fetchone()[0] or 0
                for s in store.sites(run_id)}
        width = bucket_width(max(last.values(), default=0), self.max_points)
        if self._key != (run_id, width):
            self._key, self._sites, self._rounds = (run_id, width), {}, {}
        out = Series(bucket_rounds=width)
        reread = []  # per site, the first bucket read again
        for site, last_round in last.items():
            kept = self._sites.get(site, [])
            first = max(0, (kept[-1].round - 1) // width - 1) if kept else 0
            if last_round:  # a site without rounds adds none to re-read
                reread.append(first)
            kept = [b for b in kept if (b.round - 1) // width < first]
            kept += site_buckets(store, run_id, site, width, first=first, last_round=last_round)
            self._sites[site] = kept
            out.sites[site] = kept
        _add_global(out)
        first = min(reread, default=0)
        self._rounds = {k: v for k, v in self._rounds.items() if k < first}
        self._rounds.update(round_times(store, run_id, width, first, max(last.values(), default=0)))
        out.round_time = sum((self._rounds[k] for k in sorted(self._rounds)), RoundTime())
        return out


def series(store: Store, run_id: str, *, max_points: int = DEFAULT_POINTS) -> Series:
    """Per-site and global plot series of a run, downsampled to at most `max_points` buckets."""
    return SeriesCache(max_points).series(store, run_id)


def _add_global(out: Series) -> None:
    # per bucket of rounds: the tokens of all sites (a site without rounds there counts with the
    # tokens it had last: it trained no further), and the mean perplexity of the sites evaluated there
    groups: dict[int, dict[str, Bucket]] = {}
    for site, bs in out.sites.items():
        for b in bs:
            groups.setdefault((b.round - 1) // out.bucket_rounds, {})[site] = b
    tokens = dict.fromkeys(out.sites, 0)
    for key in sorted(groups):
        group = groups[key]
        for site, b in group.items():
            tokens[site] = b.tokens
        ppls = [b.val_ppl for b in group.values() if b.val_ppl is not None]
        out.global_tokens.append(sum(tokens.values()))
        out.global_at[key] = out.global_tokens[-1]
        out.global_ppl.append(sum(ppls) / len(ppls) if ppls else None)


def recent_events(store: Store, run_id: str, *, after_id: int = 0, limit: int = 200) -> list[Event]:
    """The newest `limit` events with id > `after_id`, by time (index events(run_id, id))."""
    found = rows(store.db, "SELECT * FROM events WHERE run_id = ? AND id > ? ORDER BY id DESC LIMIT ?",
                 (run_id, after_id, limit))
    return [Event.from_row(r) for r in sorted(found, key=lambda r: (r["t"], r["id"]))]


def latest_round_row(store: Store, run_id: str, site: str) -> dict[str, Any] | None:
    found = rows(store.db, "SELECT * FROM rounds WHERE run_id = ? AND site = ? ORDER BY round DESC LIMIT 1",
                 (run_id, site))
    return found[0] if found else None


def latest_ppl(store: Store, run_id: str, site: str) -> float | None:
    """The newest evaluated perplexity of a site (rounds without evaluation are skipped)."""
    row = store.db.conn.execute("SELECT val_ppl FROM rounds WHERE run_id = ? AND site = ? AND val_ppl IS NOT NULL"
                                " ORDER BY round DESC LIMIT 1", (run_id, site)).fetchone()
    return row[0] if row else None


def latest_tokens_per_s(store: Store, run_id: str, site: str) -> float | None:
    row = store.db.conn.execute("SELECT tokens_per_s FROM steps WHERE run_id = ? AND site = ?"
                                " ORDER BY step DESC LIMIT 1", (run_id, site)).fetchone()
    return row[0] if row else None


def site_stats(store: Store, run_id: str, buckets: Series | None = None) -> list[SiteStat]:
    """One row per site (in site order); pass the run's `series` to reuse its totals."""
    if buckets is None:
        buckets = series(store, run_id)
    out = []
    starts = {e.site: e.detail for e in store.events(run_id, kinds=("start",))}  # each site's newest
    for s in store.sites(run_id):
        st = SiteStat(site=s.name, state=s.state)
        row = latest_round_row(store, run_id, s.name)
        if row is not None:
            st.round, st.step, st.h = row["round"], row["step"], row["h"]
            st.k_active, st.k_nominal, st.staleness = row["k_active"], row["k_nominal"], row["staleness"]
            st.last_sync_s = row["sync_s"]
            st.last_round_s = (row["compute_s"] or 0.0) + (row["sync_s"] or 0.0)
            st.tokens = row["tokens"] or 0
            moved = (row["bytes_sent"] or 0) + (row["bytes_recv"] or 0)
            st.wan_bps = moved / row["sync_s"] if row["sync_s"] and moved else None
            st.val_ppl = latest_ppl(store, run_id, s.name)
            st.train_loss = row["train_loss"]
        bs = buckets.sites.get(s.name, [])
        st.efficiency = metrics.efficiency(sum(b.compute_s for b in bs), sum(b.sync_s for b in bs))
        st.bytes_sent = sum(b.bytes_sent for b in bs)
        st.bytes_recv = sum(b.bytes_recv for b in bs)
        st.tokens_per_s = latest_tokens_per_s(store, run_id, s.name)
        start = starts.get(s.name)
        if start is not None:
            st.mfu = mfu(st.tokens_per_s, start.get("flops_per_token"), start.get("peak_flops"))
        out.append(st)
    return out


STALL_EVENTS = ("coordinator_unreachable", "coordinator_back", "coordinator_restart")


def outage_since(event) -> float:
    """When a site says its outage began (detail "since"), or the event's time if that is not a finite number
    no later than the event: the site's word is a number from the wire."""
    try:
        since = float(event.detail.get("since") or event.t)
    except (TypeError, ValueError):
        return event.t
    return since if math.isfinite(since) and since <= event.t else event.t


def stall(store: Store, run_id: str) -> dict[str, Any] | None:
    """A run's sites waiting on a coordinator they cannot reach (issue 41): {"since", "cause", "sites",
    "by_site"}, or None. A site stalls from its newest `coordinator_unreachable` event until a later
    `coordinator_back` or round record of its own; the cause is the newest such event's message;
    `by_site` says since when each site waits."""
    events = store.events(run_id, kinds=STALL_EVENTS)
    if not any(e.event == "coordinator_unreachable" for e in events):
        return None
    latest = store.latest_rounds(run_id)
    stalled = []
    for site in dict.fromkeys(e.site for e in events if e.event == "coordinator_unreachable"):
        down = [e for e in events if e.site == site and e.event == "coordinator_unreachable"][-1]
        back = any(e.site == site and e.event == "coordinator_back" and e.t >= down.t for e in events)
        rec = latest.get(site)
        if not back and not (rec is not None and rec.t > down.t):
            stalled.append((outage_since(down), site, down.message))
    if not stalled:
        return None
    since, _, cause = min(stalled)
    return {"since": since, "cause": cause, "sites": sorted(s for _, s, _ in stalled),
            "by_site": {s: t for t, s, _ in stalled}}
