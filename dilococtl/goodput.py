"""The goodput ledger (issue 36): where each site's wall time went, from the records status already reads.

For every site that trained, over the run's wall time (launch to end, to now while it runs):

- useful: compute seconds of its committed rounds (inner steps whose update reached θ);
- exchange: sync seconds of its rounds less their quorum part (the compressed average, the commit);
- straggler: the quorum part (waiting for the other sites to arrive);
- failure_detection: stalled on a coordinator it could not reach (from the start of the wait in which
  `coordinator_unreachable` was reported until `coordinator_back` or its next round), taken out of the
  round's sync seconds before the two above;
- restart: from its last round before a relaunch (the inner steps done since are lost) to the start of its
  first round after it: downtime, start-up, checkpoint load and heal;
- discarded: compute seconds of rounds that were not committed;
- other: the rest (first start-up, evaluations, checkpoints, the tail after its last round).

The causes add up to the wall time by construction (`other` is the remainder of each round's cell below,
never below 0: only records that overlap in time make the sum exceed the wall). Goodput is
useful / wall summed over the sites: with a steady step time that is the tokens that reached θ against the
tokens the sites could have trained at full speed with no sync, as the issue defines it. A round or step
redone after a restart replaces its record in the store, so lost inner steps are counted in `restart`
(the time from the site's last round to its return), not as discarded rounds.

Per round (`ledger(..., bucket=N)`, what report plots): each site's wall time is cut at its round records
(in time order), and a record's cell, from the site's previous record to its own, is its round's: its
compute and sync seconds, a stall or a relaunch that ended in it, and `other` for the rest of the cell;
the time after a site's last record is the round in flight (its last round once the run has ended). The
run's figures are the sums of the cells, so the rounds add up to them exactly. A record's seconds are
the site's word: a value that is not a finite number of seconds >= 0 (NaN, inf, negative, text) counts
as 0 and one above the run's wall time as the wall time, a time outside the run as its start or end, so
a lying record moves its own cell, never the sums to NaN or below 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dilococtl import queries
from dilococtl.errors import BadInput
from dilococtl.metrics import wall_s
from dilococtl.states import ACTIVE_RUN_STATES

if TYPE_CHECKING:
    from dilococtl.store import Run, Store

CAUSES = ("exchange", "straggler", "failure_detection", "restart", "discarded", "other")
_EVENTS = ("start", "coordinator_unreachable", "coordinator_back")


@dataclass(kw_only=True, slots=True)
class SiteLedger:
    site: str
    wall_s: float
    useful_s: float
    lost_s: dict[str, float] = field(default_factory=dict)  # cause -> seconds (CAUSES)

    @property
    def goodput(self) -> float | None:
        return self.useful_s / self.wall_s if self.wall_s > 0 else None


@dataclass(kw_only=True, slots=True)
class RoundLedger:
    round: int  # the first round of the bucket
    rounds: int  # rounds in the bucket (ledger's `bucket`)
    useful_s: float  # summed over the sites
    lost_s: dict[str, float] = field(default_factory=dict)  # cause -> seconds summed over the sites

    def to_json(self) -> dict:
        return {"round": self.round, "rounds": self.rounds, "useful_s": self.useful_s, "lost_s": self.lost_s}


@dataclass(kw_only=True, slots=True)
class Ledger:
    sites: list[SiteLedger]
    rounds: list[RoundLedger] = field(default_factory=list)  # by round; only when asked (ledger's `bucket`)

    @property
    def goodput(self) -> float | None:
        wall = sum(s.wall_s for s in self.sites)
        return sum(s.useful_s for s in self.sites) / wall if wall > 0 else None

    @property
    def lost_s(self) -> dict[str, float]:
        return {c: sum(s.lost_s.get(c, 0.0) for s in self.sites) for c in CAUSES}

    def to_json(self) -> dict:
        return {"goodput": self.goodput, "lost_s": self.lost_s,
                "goodput_sites": {s.site: {"goodput": s.goodput, "useful_s": s.useful_s, "wall_s": s.wall_s,
                                           "lost_s": s.lost_s} for s in self.sites}}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)


def _secs(col: str) -> str:
    """A record's seconds as the ledger counts them (module docstring). An honest value takes the first test
    alone (text sorts above every number, NaN is NULL); x - x = 0 is false for inf."""
    return (f"(CASE WHEN {col} BETWEEN 0 AND :wall THEN {col} WHEN typeof({col}) IN ('real', 'integer')"
            f" AND {col} > :wall AND {col} - {col} = 0 THEN :wall ELSE 0.0 END)")


# A site's rounds with their seconds and times as counted (:start and :end bound the run); `span` is the
# record's cell, from the site's previous record in time order (or the run's start) to its own.
_ROWS = (f"SELECT site, coalesce(CAST(round AS INTEGER), 0) AS round, committed, {_secs('compute_s')} AS c,"
         f" {_secs('sync_s')} AS s, {_secs('quorum_s')} AS q, CASE WHEN t BETWEEN :start AND :end THEN t"
         " WHEN typeof(t) IN ('real', 'integer') AND t - t = 0 THEN min(max(t, :start), :end) END AS t"
         " FROM rounds WHERE run_id = :run")
_CELLS = (f"SELECT *, t - coalesce(lag(t) OVER (PARTITION BY site ORDER BY t, round), :start) AS span"
          f" FROM ({_ROWS})")
# per site (and bucket of rounds): one pass over the rows, whatever the stalls and relaunches. The cells'
# window sorts every row (~6x the plain sums at 100k rounds): only the per-round figures pay for it.
_SUMS = ("SELECT site, {key}, sum(CASE WHEN committed THEN c ELSE 0 END), sum(CASE WHEN committed THEN 0 ELSE c END),"
         " sum(s), sum(min(s, q)), {other}, max(t), max(round) FROM ({rows}) GROUP BY site{by}")
_SITE = f"FROM ({_ROWS} AND site = :site)"  # the few rows a stall or a relaunch touches


class _Cells:
    """One site's figures per bucket of rounds: what the SQL sums give, then the stalls and relaunches."""

    def __init__(self, bucket: int | None):
        self.per_round = bucket is not None  # None: the run's sums only, one bucket
        self.bucket = bucket or 1 << 62
        self.by: dict[int, dict[str, float]] = {}

    def add(self, rnd: int, what: str, x: float) -> None:
        key = max(0, rnd - 1) // self.bucket
        cell = self.by.setdefault(key, dict.fromkeys(("useful", *CAUSES), 0.0))
        cell[what] += x


def _site_ledger(store: Store, args: dict, site: str, sums: list[tuple], events: list, cells: _Cells,
                 tail_round: int | None) -> SiteLedger:
    """One site's ledger into `cells`: its sums per bucket from one SQL pass (`sums`: key, then _SUMS'
    columns); only the rounds a stall or a relaunch touches are read again (watch computes it every refresh,
    over runs of 100k rounds)."""
    conn, args = store.db.conn, {**args, "site": site}
    start, end = args["start"], args["end"]
    for key, useful, discarded, sync, quorum, other, *_ in sums:
        first = key * cells.bucket + 1  # a round of the bucket: it files the sums there
        for what, x in (("useful", useful), ("discarded", discarded), ("exchange", (sync or 0.0) - (quorum or 0.0)),
                        ("straggler", quorum), ("other", other)):
            cells.add(first, what, float(x or 0.0))
    last_t = max((t for *_, t, _ in sums if t is not None), default=None)

    def one(sql: str, **kw):
        return conn.execute(sql, {**args, **kw}).fetchone()

    def remainder(rnd: int) -> float:
        """The cell of round `rnd` less its compute and sync seconds (what _SUMS counted as `other`)."""
        row = one(f"SELECT t, c, s {_SITE} WHERE round = :r", r=rnd)
        if row is None or row[0] is None:
            return 0.0
        prev = one(f"SELECT t {_SITE} WHERE (t, round) < (:t, :r) ORDER BY t DESC, round DESC LIMIT 1",
                   t=row[0], r=rnd)
        return row[0] - (prev[0] if prev is not None else start) - row[1] - row[2]

    tail = tail_round if tail_round is not None else max((r for *_, r in sums if r is not None), default=0)
    spans: list[tuple[int | None, float, float]] = []  # (round of the cell or None: the tail, from, to)
    for e in (e for e in events if e.event == "coordinator_unreachable"):
        # The outage is the wait of the round the site was in: from that wait's start (the first failed probe
        # comes up to a probe interval into it) to `coordinator_back` or the round's end. While that round has
        # not ended, from when the site says it began, not before its previous round ended (a site's claim).
        prev = one(f"SELECT max(t) {_SITE} WHERE t <= :x", x=e.t)[0]
        nxt = one(f"SELECT t - s, t, round {_SITE} WHERE t > :x ORDER BY t, round LIMIT 1", x=e.t)
        began = nxt[0] if nxt is not None else queries.outage_since(e)
        ends = [x.t for x in events if x.event == "coordinator_back" and x.t >= e.t] + \
               ([nxt[1]] if nxt is not None else []) + [end]
        spans.append((nxt[2] if nxt is not None else None, max(start, prev if prev is not None else start, began),
                      min(end, min(ends))))
    # each stall lies in one cell (between the records around its report): a union per cell counts it once
    stall_of = {r: _union([(a, b) for x, a, b in spans if x == r]) for r in {x for x, _, _ in spans}}
    stalls = _union([s for v in stall_of.values() for s in v])
    extra: dict[int | None, float] = {}  # per cell: lost seconds outside its compute and sync
    for r, v in stall_of.items():
        fd = sum(b - a for a, b in v)
        cells.add(tail if r is None else r, "failure_detection", fd)
        extra[r] = extra.get(r, 0.0) + fd
    touched = {}
    for a, b in stalls:  # a stall inside a round's wait is failure detection, not exchange or straggler
        for t, sync_s, quorum_s, rnd in conn.execute(f"SELECT t, s, q, round {_SITE} WHERE t >= :a AND t - s <= :b",
                                                     {**args, "a": a, "b": b}):
            touched[rnd] = (t, sync_s, quorum_s)
    for rnd, (t, sync_s, quorum_s) in touched.items():
        stalled = min(sync_s, _overlap(stalls, t - sync_s, t))
        q_all = min(sync_s, quorum_s)
        q = min(sync_s - stalled, max(0.0, quorum_s - stalled))
        cells.add(rnd, "exchange", (sync_s - stalled - q) - (sync_s - q_all))
        cells.add(rnd, "straggler", q - q_all)
        extra[rnd] = extra.get(rnd, 0.0) - stalled  # taken from the round's sync, not from the rest of its cell
    for s in sorted(e.t for e in events if e.event == "start")[1:]:
        # relaunches: from the last round before it to the first round's start after it
        before = one(f"SELECT max(t) {_SITE} WHERE t <= :x", x=s)[0]
        after = one(f"SELECT t - c - s, round {_SITE} WHERE t > :x ORDER BY t - c - s LIMIT 1", x=s)
        if before is not None and after is not None:
            lost = max(0.0, (after[0] - before) - _overlap(stalls, before, after[0]))
            cells.add(after[1], "restart", lost)
            extra[after[1]] = extra.get(after[1], 0.0) + lost
    for rnd, x in extra.items():  # the rest of a cell with a stall or relaunch in it, never below 0
        if rnd is not None and abs(x) > 1e-12 and cells.per_round:
            rest = remainder(rnd)
            cells.add(rnd, "other", max(0.0, rest - x) - max(0.0, rest))
    tail_s = end - (last_t if last_t is not None else start)
    cells.add(tail, "other", max(0.0, tail_s - extra.get(None, 0.0)))
    total = {k: sum(c[k] for c in cells.by.values()) for k in ("useful", *CAUSES)}
    if not cells.per_round:  # no cells: the rest of the wall (the same figure where no two records overlap in time)
        total["other"] = max(0.0, (end - start) - sum(v for k, v in total.items() if k != "other"))
    return SiteLedger(site=site, wall_s=end - start, useful_s=total["useful"], lost_s={c: total[c] for c in CAUSES})


def ledger(run: Run, store: Store, now: float | None = None, *, bucket: int | None = None) -> Ledger:
    """The run's goodput ledger (module docstring): one SiteLedger per site with round records; with
    `bucket`, also the sites' sums per `bucket` rounds (Ledger.rounds), from the same pass over the rows."""
    if bucket is not None and bucket < 1:
        raise BadInput(f"bucket must be >= 1 rounds, got {bucket}")
    wall = wall_s(run, now)
    args = {"run": run.id, "start": run.created, "end": run.created + wall, "wall": wall}
    # (grouping by a constant as well would sort every row: status and watch group by site alone)
    sql = _SUMS.format(key="0", other="NULL", rows=_ROWS, by="") if bucket is None else \
        _SUMS.format(key=f"max(0, round - 1) / {int(bucket)}", other="sum(max(0, span - c - s))", rows=_CELLS,
                     by=", 2")
    sums: dict[str, list[tuple]] = {}
    for row in store.db.conn.execute(sql, args):
        sums.setdefault(row[0], []).append(row[1:])
    events = store.events(run.id, kinds=_EVENTS)
    order = [x.name for x in store.sites(run.id)]
    live = not (run.finished and run.state not in ACTIVE_RUN_STATES)
    by_round: dict[int, dict[str, float]] = {}
    sites = []
    for site in sorted(sums, key=lambda x: order.index(x) if x in order else len(order)):
        cells = _Cells(bucket)
        last = max((r for *_, r in sums[site] if r is not None), default=0)
        sites.append(_site_ledger(store, args, site, sums[site], [e for e in events if e.site == site], cells,
                                  last + 1 if live else None))
        for k, c in cells.by.items():
            into = by_round.setdefault(k, dict.fromkeys(("useful", *CAUSES), 0.0))
            for what, x in c.items():
                into[what] += x
    rounds = [] if bucket is None else [
        RoundLedger(round=k * bucket + 1, rounds=bucket, useful_s=c["useful"], lost_s={x: c[x] for x in CAUSES})
        for k, c in sorted(by_round.items())]
    return Ledger(sites=sites, rounds=rounds)
