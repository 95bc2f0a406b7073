"""The run's end as torchft's Lighthouse shows it (its status page, GET /status).

A site the quorum went on without (a straggler, with `min_sites` under `sites`) may ask for its next
quorum after the other sites committed the run's last round and exited: that quorum can never form,
and torchft would wait out the quorum timeout (15 minutes) before failing the site. A site that
finishes the run therefore heartbeats once under the replica id `SITE:dilococtl-ended` (trainer.modes.ft
announce_end); the page lists every replica that heartbeated and how long ago, and the Lighthouse has
no other read API. A waiting site whose peers announced the end, and none of whose peers heartbeats any
more, knows the run is over. torchft is pinned (pyproject.toml), and the page's markup with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ENDED = "dilococtl-ended"  # the replica id suffix of a site's end-of-run heartbeat
GONE_S = 10.0  # a replica whose last heartbeat is older than this has left (torchft beats every 100 ms)

_BEAT = re.compile(r"<li class=\"heartbeat[^\"]*\">\s*([^<]+?): seen ([^<]+?) ago")
_PART = re.compile(r"([\d.]+)\s*(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class LighthouseStatus:
    seen_s: dict[str, float] = field(default_factory=dict)  # site -> seconds since its newest replica beat
    ended: frozenset[str] = frozenset()  # sites that announced they finished the run


def _seconds(text: str) -> float:
    parts = _PART.findall(text)
    return sum(float(n) * _UNIT_S[u] for n, u in parts) if parts else 0.0  # unreadable: as if just now


def parse_status(page: str) -> LighthouseStatus:
    """The heartbeats of a Lighthouse status page, by site (the replica id before ":")."""
    _, _, beats = page.partition("Heartbeats")
    seen: dict[str, float] = {}
    ended: set[str] = set()
    for rid, age in _BEAT.findall(beats):
        site, _, suffix = rid.strip().partition(":")
        if suffix == ENDED:
            ended.add(site)
        else:
            seen[site] = min(seen.get(site, float("inf")), _seconds(age))
    return LighthouseStatus(seen_s=seen, ended=frozenset(ended))


def ended_without(page: str, site: str, gone_s: float = GONE_S) -> str | None:
    """Why the run is over for `site`, waiting for a quorum: another site announced it finished the run,
    and no site but this one has heartbeated for `gone_s`. None while either is not so."""
    st = parse_status(page)
    ended = sorted(st.ended - {site})
    if not ended or any(age < gone_s for s, age in st.seen_s.items() if s != site):
        return None
    return f"the run ended without this site: {', '.join(ended)} finished its last round and no other site is left"
