"""One home for the figures derived from a run's records: efficiency, sync share, staleness, throughput.

`status` (dilococtl/runs.py), `watch` (dilococtl/tui/data.py) and `report` (dilococtl/report.py)
all read them from here, so the same run shows the same figures everywhere.

- compute efficiency of a site: its compute seconds / (compute + sync) over its rounds.
- sync share of round time: each round counted once, as the sites lived it together: the round
  lasts the slowest site's compute plus the exchange; the exchange is the least sync_s of the
  sites (the site that arrived last waited only for it, the others also for the straggler's
  compute, which is not WAN time). Share = exchange seconds / round seconds, summed over rounds.
  It is what tune-h predicts (its `sync_share`). It is NOT a share of the run's wall time, which
  also holds start-up, evaluation, checkpoints and restarts: `sync_share_of_wall` is that one.
  The store's views fold the same way in SQL (dilococtl.queries.round_times; a test holds the two
  together). In async mode the sites do not share rounds, yet rounds of the same number are still
  folded together, as `status` always did: a known approximation there.
- staleness and throughput: a site's newest round's staleness and newest step's tokens/s.
"""

from __future__ import annotations

import math
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
    """Seconds summed over rounds, each round counted once (see the module docstring)."""

    rounds: int = 0
    sync_s: float = 0.0  # per round, the exchange: the least sync_s over the sites
    round_s: float = 0.0  # per round, the slowest site's compute + the exchange

    @property
    def sync_share(self) -> float | None:
        return self.sync_s / self.round_s if self.round_s > 0 else None

    def __add__(self, other: RoundTime) -> RoundTime:
        return RoundTime(rounds=self.rounds + other.rounds, sync_s=self.sync_s + other.sync_s,
                         round_s=self.round_s + other.round_s)


def fold_rounds(per_round: Iterable[tuple[float, float]]) -> RoundTime:
    """RoundTime of rounds given as (slowest compute_s, least sync_s) each."""
    out = RoundTime()
    for compute_s, sync_s in per_round:
        out.rounds += 1
        out.sync_s += sync_s
        out.round_s += compute_s + sync_s
    return out


def round_time(rows: Iterable[_RoundTimes]) -> RoundTime:
    """RoundTime of round records (any sites; grouped by round here)."""
    by_round: dict[int, tuple[float, float]] = {}
    for r in rows:
        c, s = by_round.get(r.round, (-math.inf, math.inf))
        by_round[r.round] = (max(c, r.compute_s), min(s, r.sync_s))
    return fold_rounds(by_round.values())


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
    sync_s: float  # exchange seconds summed over rounds
    round_s: float  # round seconds (slowest compute + exchange) summed over rounds
    sync_share: float | None  # sync_s / round_s: "sync share of round time"
    wall_s: float  # the run's wall time: launch to end (to `now` while it runs)
    sync_share_of_wall: float | None  # sync_s / wall_s
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
    return RunMetrics(rounds=rt.rounds, sync_s=rt.sync_s, round_s=rt.round_s, sync_share=rt.sync_share,
                      wall_s=wall, sync_share_of_wall=rt.sync_s / wall if wall > 0 and rt.rounds else None,
                      sites=[SiteMetrics(site=s.site, efficiency=s.efficiency, staleness=s.staleness,
                                         tokens_per_s=s.tokens_per_s) for s in stats])
