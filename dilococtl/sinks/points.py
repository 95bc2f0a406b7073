"""The sinks' points, from the store's round rows: per site and for all sites, x = tokens of all sites.

A round is exported once every site that still runs has recorded it (or the run has ended), so its
x (the tokens of all sites then) and its all-sites values do not change after they were written.
The all-sites values fold a round as dilococtl.metrics does: the exchange is the least sync_s of
the sites; perplexity and loss are averaged over the sites that have them (watch's global curve).
"""

from __future__ import annotations

from collections.abc import Iterable

from dilococtl import metrics
from dilococtl.sinks.base import GLOBAL, Point
from dilococtl.states import ACTIVE_RUN_STATES, LIVE_SITE_STATES
from dilococtl.store import Run, Store
from trainer.records import RoundRecord

SITE_METRICS = ("loss", "val_ppl", "sync_s", "efficiency", "staleness", "bytes_sent", "k_active")


def ready_round(store: Store, run: Run) -> int:
    """The newest round every still-running site has recorded (every round once the run ended)."""
    newest = {s.name: 0 for s in store.sites(run.id)}
    for site, rec in store.latest_rounds(run.id).items():
        newest[site] = rec.round
    if run.state not in ACTIVE_RUN_STATES:
        return max(newest.values(), default=0)
    live = [newest[s.name] for s in store.sites(run.id) if s.state in LIVE_SITE_STATES]
    return min(live) if live else max(newest.values(), default=0)


def site_values(rec: RoundRecord) -> dict[str, float]:
    out = {"sync_s": rec.sync_s, "staleness": rec.staleness, "bytes_sent": rec.bytes_sent,
           "k_active": rec.k_active}
    if rec.train_loss is not None:
        out["loss"] = rec.train_loss
    if rec.val_ppl is not None:
        out["val_ppl"] = rec.val_ppl
    eff = metrics.efficiency(rec.compute_s, rec.sync_s)
    if eff is not None:
        out["efficiency"] = eff
    return out


def global_values(recs: list[RoundRecord]) -> dict[str, float]:
    out: dict[str, float] = {"sync_s": min(r.sync_s for r in recs), "staleness": max(r.staleness for r in recs),
                             "bytes_sent": sum(r.bytes_sent for r in recs), "k_active": max(r.k_active for r in recs)}
    for key, vals in (("loss", [r.train_loss for r in recs]), ("val_ppl", [r.val_ppl for r in recs])):
        vals = [v for v in vals if v is not None]
        if vals:
            out[key] = sum(vals) / len(vals)
    eff = metrics.efficiency(sum(r.compute_s for r in recs), sum(r.sync_s for r in recs))
    if eff is not None:
        out["efficiency"] = eff
    return out


def _tokens_before(store: Store, run_id: str, after: int) -> dict[str, int]:
    """Per site, its tokens at its newest round <= `after` (the x of the rounds to come starts there)."""
    out = {}
    for s in store.sites(run_id):
        row = store.db.conn.execute("SELECT tokens FROM rounds WHERE run_id = ? AND site = ? AND round <= ?"
                                    " ORDER BY round DESC LIMIT 1", (run_id, s.name, after)).fetchone()
        out[s.name] = (row[0] or 0) if row else 0
    return out


def new_points(store: Store, run: Run, after: int) -> list[Point]:
    """The points of rounds after `after` that are ready (see the module docstring), in round order."""
    last = ready_round(store, run)
    if last <= after:
        return []
    tokens = _tokens_before(store, run.id, after)
    by_round: dict[int, list[RoundRecord]] = {}
    for rec in store.rounds(run.id, after=after):
        if rec.round <= last:
            by_round.setdefault(rec.round, []).append(rec)
    return [_point(r, by_round[r], tokens) for r in sorted(by_round)]


def _point(r: int, recs: Iterable[RoundRecord], tokens: dict[str, int]) -> Point:
    recs = list(recs)
    values: dict[str, float] = {}
    for rec in recs:
        tokens[rec.site] = rec.tokens
        for key, v in site_values(rec).items():
            values[f"{key}/{rec.site}"] = float(v)
    for key, v in global_values(recs).items():
        values[f"{GLOBAL}/{key}"] = float(v)
    return Point(round=r, tokens=sum(tokens.values()), t=max(rec.t for rec in recs), values=values)
