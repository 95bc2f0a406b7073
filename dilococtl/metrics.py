"""One home for the figures derived from a run's records: efficiency, sync share, staleness, throughput.

`status` (dilococtl/runs.py), `watch` (dilococtl/tui/data.py) and `report` (dilococtl/report.py)
all read them from here, so the same run shows the same figures everywhere.

- compute efficiency of a site: its compute seconds / (compute + sync) over its rounds.
- sync share of round time: the sites' sync seconds summed over their round records / their round
  seconds (compute + sync) summed over the same records: what the per-round sync seconds in
  `logs` add up to, so every view (report's summary, status, watch) prints the same digit, and
  it is 1 - the record-weighted efficiency of the sites. A site's sync seconds hold the wait for
  a straggler too: the time the site did not compute, as tune-h's `sync_share` (1 - efficiency)
  counts it. It is NOT a share of the run's wall time, which also holds start-up, evaluation,
  checkpoints and restarts: `sync_share_of_wall` is that one (a site's mean sync seconds / wall).
  The store's views sum the same way in SQL per bucket of rounds (dilococtl.queries.round_times;
  a test holds the two together).
- staleness and throughput: a site's newest round's staleness and newest step's tokens/s; MFU,
  those tokens/s against the peak of the site's devices (trainer.rules.mfu.mfu, from the constants
  of the site's `start` event; dilococtl.queries.site_stats).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dilococtl.states import ACTIVE_RUN_STATES

if TYPE_CHECKING:
    from dilococtl.store import Run


class _RoundTimes(Protocol):
    round: int
    compute_s: float
    sync_s: float


class _SiteFigures(Protocol):  # dilococtl.queries.SiteStat
    site: str
    efficiency: float | None
    staleness: int | None
    tokens_per_s: float | None


def efficiency(compute_s: float, sync_s: float) -> float | None:
    """compute / (compute + sync); None when no time was recorded."""
    total = compute_s + sync_s
    return compute_s / total if total > 0 else None


@dataclass(kw_only=True, slots=True)
class RoundTime:
    """Seconds summed over round records, all sites (see the module docstring)."""

    rounds: int = 0  # distinct rounds recorded (each once, whatever the number of sites)
    records: int = 0  # round records summed (site x round)
    sync_s: float = 0.0  # the records' sync seconds, summed
    round_s: float = 0.0  # the records' compute + sync seconds, summed

    @property
    def sync_share(self) -> float | None:
        return self.sync_s / self.round_s if self.round_s > 0 else None

    def __add__(self, other: RoundTime) -> RoundTime:
        return RoundTime(rounds=self.rounds + other.rounds, records=self.records + other.records,
                         sync_s=self.sync_s + other.sync_s, round_s=self.round_s + other.round_s)


def round_time(rows: Iterable[_RoundTimes]) -> RoundTime:
    """RoundTime of round records (any sites)."""
    out, seen = RoundTime(), set()
    for r in rows:
        seen.add(r.round)
        out.records += 1
        out.sync_s += r.sync_s
        out.round_s += r.compute_s + r.sync_s
    out.rounds = len(seen)
    return out


def sync_share(rows: Iterable[_RoundTimes]) -> float | None:
    """Sync share of round time of these round records (module docstring)."""
    return round_time(rows).sync_share


@dataclass(kw_only=True, slots=True)
class SiteMetrics:
    site: str
    efficiency: float | None  # compute / (compute + sync) over the site's rounds
    staleness: int | None  # of its newest round
    tokens_per_s: float | None  # of its newest step record


@dataclass(kw_only=True, slots=True)
class RunMetrics:
    """The run-wide figures every view shows."""

    rounds: int  # rounds counted (each once, whatever the number of sites)
    sync_s: float  # the sites' sync seconds, summed over their round records
    round_s: float  # the sites' round seconds (compute + sync), summed over the same records
    sync_share: float | None  # sync_s / round_s: "sync share of round time"
    wall_s: float  # the run's wall time: launch to end (to `now` while it runs)
    sync_share_of_wall: float | None  # a site's mean sync seconds (sync_s / sites with rounds) / wall_s
    sites: list[SiteMetrics] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"rounds": self.rounds, "sync_s": self.sync_s, "round_s": self.round_s,
                "sync_share": self.sync_share, "wall_s": self.wall_s, "sync_share_of_wall": self.sync_share_of_wall}


def wall_s(run: Run, now: float | None = None) -> float:
    """Seconds from launch to the run's end (to `now` while it has not ended)."""
    end = run.finished if (run.finished and run.state not in ACTIVE_RUN_STATES) else \
        (now if now is not None else time.time())
    return max(0.0, end - run.created)


def run_metrics(run: Run, rt: RoundTime, stats: Iterable[_SiteFigures], *, now: float | None = None) -> RunMetrics:
    """The figures of `run` from its round time and site rows (dilococtl.queries: `series(...).round_time`,
    `site_stats`)."""
    wall = wall_s(run, now)
    stats = list(stats)
    timed = max(1, sum(1 for s in stats if s.efficiency is not None))  # sites with round time recorded
    return RunMetrics(rounds=rt.rounds, sync_s=rt.sync_s, round_s=rt.round_s, sync_share=rt.sync_share,
                      wall_s=wall, sync_share_of_wall=rt.sync_s / timed / wall if wall > 0 and rt.rounds else None,
                      sites=[SiteMetrics(site=s.site, efficiency=s.efficiency, staleness=s.staleness,
                                         tokens_per_s=s.tokens_per_s) for s in stats])
