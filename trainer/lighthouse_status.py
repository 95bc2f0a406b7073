"""What torchft's Lighthouse status page (GET /status) says about the run's end.

A site the quorum went on without (a straggler, with `min_sites` under `sites`) may ask for its next
quorum after the other sites committed the run's last round and exited: that quorum can never form,
and torchft would wait out the quorum timeout (15 minutes) before failing the site. The page shows the
previous quorum (each member's replica id and step) and when each replica last heartbeated; the
Lighthouse has no other read API. torchft is pinned (pyproject.toml), and the page's markup with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GONE_S = 10.0  # a replica whose last heartbeat is older than this has left (torchft beats every 100 ms)

_MEMBER = re.compile(r"<b>([^<]+)</b>\s*<br/>\s*Step:\s*(\d+)")
_BEAT = re.compile(r"<li class=\"heartbeat[^\"]*\">\s*([^<]+?): seen ([^<]+?) ago")
_PART = re.compile(r"([\d.]+)\s*(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class LighthouseStatus:
    previous: dict[str, int]  # site -> the step it reported in the previous quorum
    seen_s: dict[str, float]  # site -> seconds since its replica last heartbeated (the newest, if several)


def _site(replica_id: str) -> str:
    return replica_id.strip().split(":")[0]


def _seconds(text: str) -> float:
    parts = _PART.findall(text)
    return sum(float(n) * _UNIT_S[u] for n, u in parts) if parts else float("inf")


def parse_status(page: str) -> LighthouseStatus:
    """The previous quorum and the heartbeats of a Lighthouse status page."""
    _, _, prev = page.partition("Previous Quorum")
    prev, _, beats = prev.partition("Heartbeats")
    seen: dict[str, float] = {}
    for rid, age in _BEAT.findall(beats):
        seen[_site(rid)] = min(seen.get(_site(rid), float("inf")), _seconds(age))
    return LighthouseStatus(previous={_site(rid): int(step) for rid, step in _MEMBER.findall(prev)}, seen_s=seen)


def ended_without(page: str, site: str, final_step: int, gone_s: float = GONE_S) -> str | None:
    """Why the run is over for `site`, waiting for a quorum: the previous quorum was of other sites only,
    at the run's final step (`final_step`: the step of the last round's quorum at least) or past it,
    and none of them has heartbeated for `gone_s`. None while any of that is not so."""
    st = parse_status(page)
    if not st.previous or site in st.previous or min(st.previous.values()) < final_step:
        return None
    if any(st.seen_s.get(s, float("inf")) < gone_s for s in st.previous):
        return None
    others = ", ".join(sorted(st.previous))
    return (f"the run ended without this site: {others} committed its last round at step "
            f"{min(st.previous.values())} and left")
