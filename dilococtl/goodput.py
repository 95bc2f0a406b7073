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

The causes add up to the wall time by construction (`other` is the remainder, never below 0). Goodput is
useful / wall summed over the sites: with a steady step time that is the tokens that reached θ against the
tokens the sites could have trained at full speed with no sync, as the issue defines it. A round or step
redone after a restart replaces its record in the store, so lost inner steps are counted in `restart`
(the time from the site's last round to its return), not as discarded rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dilococtl import queries
from dilococtl.metrics import wall_s

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
class Ledger:
    sites: list[SiteLedger]

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


_SUMS = ("SELECT site, sum(CASE WHEN committed THEN compute_s ELSE 0 END), sum(CASE WHEN committed THEN 0 ELSE"
         " compute_s END), sum(sync_s), sum(min(sync_s, max(0, coalesce(quorum_s, 0)))) FROM rounds WHERE run_id = ?"
         " GROUP BY site")


def _one(store: Store, sql: str, *args) -> float | None:
    row = store.db.conn.execute(sql, args).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def _site_ledger(store: Store, run_id: str, site: str, sums: tuple, events: list, start: float,
                 end: float) -> SiteLedger:
    """One site's ledger: its totals from one SQL sum; only the rounds a stall or a relaunch touches are read
    (watch computes it every refresh, over runs of 100k rounds)."""
    useful, discarded, sync, quorum = (float(x or 0.0) for x in sums)
    where = "FROM rounds WHERE run_id = ? AND site = ?"
    stalls = []
    for e in (e for e in events if e.event == "coordinator_unreachable"):
        # The outage is the wait of the round the site was in: from that wait's start (the first failed probe
        # comes up to a probe interval into it) to `coordinator_back` or the round's end. While that round has
        # not ended, from when the site says it began, not before its previous round ended (a site's claim).
        prev = _one(store, f"SELECT max(t) {where} AND t <= ?", run_id, site, e.t)
        nxt = store.db.conn.execute(f"SELECT t - sync_s, t {where} AND t > ? ORDER BY t LIMIT 1",
                                    (run_id, site, e.t)).fetchone()
        began = nxt[0] if nxt is not None else queries.outage_since(e)
        ends = [x.t for x in events if x.event == "coordinator_back" and x.t >= e.t] + \
               ([nxt[1]] if nxt is not None else []) + [end]
        stalls.append((max(start, prev if prev is not None else start, began), min(end, min(ends))))
    stalls = _union(stalls)
    lost = dict.fromkeys(CAUSES, 0.0)
    lost["exchange"], lost["straggler"], lost["discarded"] = sync - quorum, quorum, discarded
    touched = {}
    for a, b in stalls:  # a stall inside a round's wait is failure detection, not exchange or straggler
        for t, sync_s, quorum_s in store.db.conn.execute(
                f"SELECT t, sync_s, quorum_s {where} AND t >= ? AND t - sync_s <= ?", (run_id, site, a, b)):
            touched[t] = (sync_s, quorum_s)
    for t, (sync_s, quorum_s) in touched.items():
        stalled = min(sync_s, _overlap(stalls, t - sync_s, t))
        q_all = min(sync_s, max(0.0, quorum_s or 0.0))
        q = min(sync_s - stalled, max(0.0, (quorum_s or 0.0) - stalled))
        lost["exchange"] += (sync_s - stalled - q) - (sync_s - q_all)
        lost["straggler"] += q - q_all
    lost["failure_detection"] = sum(b - a for a, b in stalls)
    starts = sorted(e.t for e in events if e.event == "start")
    for s in starts[1:]:  # relaunches: from the last round before it to the first round's start after it
        before = _one(store, f"SELECT max(t) {where} AND t <= ?", run_id, site, s)
        after = _one(store, f"SELECT min(t - compute_s - sync_s) {where} AND t > ?", run_id, site, s)
        if before is not None and after is not None:
            lost["restart"] += (after - before) - _overlap(stalls, before, after)
    wall = max(0.0, end - start)
    lost["other"] = max(0.0, wall - useful - sum(lost.values()))
    return SiteLedger(site=site, wall_s=wall, useful_s=useful, lost_s=lost)


def ledger(run: Run, store: Store, now: float | None = None) -> Ledger:
    """The run's goodput ledger (module docstring): one SiteLedger per site with round records."""
    wall = wall_s(run, now)
    start, end = run.created, run.created + wall
    sums = {row[0]: row[1:] for row in store.db.conn.execute(_SUMS, (run.id,))}
    events = store.events(run.id, kinds=_EVENTS)
    order = [x.name for x in store.sites(run.id)]
    return Ledger(sites=[_site_ledger(store, run.id, site, sums[site], [e for e in events if e.site == site],
                                      start, end)
                         for site in sorted(sums, key=lambda x: order.index(x) if x in order else len(order))])
