"""launch: the TLS transport's streams and pacing from links already measured, for an untuned spec.

A spec that sets none of diloco.transport_streams, transport_pace_mbit and transport_link_pace_mbit
runs with 4 unpaced streams unless tune-h --write fixed them; on a window-limited WAN that moved a
small-preset round at 66-67% of the link where tune-h's settings moved it at 88% (BENCHMARKS.md,
"The whole round on the wire"). So launch derives them as tune-h would (tune.transport_model) from
the newest measurement of the same site leaders, by `doctor --links` or by a tune-h of any H, at most
MAX_AGE_S old. A fresh launch records what it chose as a `transport` event; a relaunch of some sites
(resume) reuses that event, never a newer measurement: every site of a run must open the same
number of streams to its peers.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from dilococtl.spec_types import RunSpec
from dilococtl.store import Store
from dilococtl.tune.choose import largest_exchange, spec_exchanges, transport_model
from dilococtl.tune.measure import Link, all_on_loopback, sets, transport_of
from dilococtl.tune.transfer import replicas

MAX_AGE_S = 7 * 86400.0  # an older measurement may describe another WAN: launch keeps the defaults
KEYS = ("transport_streams", "transport_pace_mbit", "transport_link_pace_mbit")
EVENT = "transport"


def _leaders(spec: RunSpec) -> dict[str, str] | None:
    """Site name -> leader host; None where a site's nodes are known only once its job runs (Slurm)."""
    if any(s.scheduler == "slurm" for s in spec.sites):
        return None
    return {s.name: s.hosts[0] for s in spec.sites}


def _sane(x: Link) -> bool:
    """Figures a derivation can use: finite, positive rates over positive stream counts, a finite RTT."""
    try:
        return all(isinstance(n, int | float) and isinstance(m, int | float) and 1 <= n <= 1024 and 0 < m < math.inf
                   for n, m in x.sweep) and 0 <= x.rtt_ms < math.inf
    except (TypeError, ValueError):
        return False


def stored_links(spec: RunSpec, store: Store, now: float | None = None) -> tuple[dict[str, Any], list[Link]] | None:
    """The newest stored measurement (doctor --links or tune-h, with a stream sweep) that covers every
    direction between the spec's site leaders, its links named by this spec's sites; None if none."""
    leaders = _leaders(spec)
    if leaders is None:
        return None
    fields = {f.name for f in dataclasses.fields(Link)}
    now = time.time() if now is None else now
    pairs = [(a, b) for a in leaders for b in leaders if a != b]
    for probe in store.link_probes(since=now - MAX_AGE_S):
        try:
            links = [Link(**{k: v for k, v in x.items() if k in fields}) for x in probe["links"] or []]
        except (TypeError, AttributeError):
            continue  # a row of another shape: not ours to use
        by_hosts = {(x.src_host, x.dst_host): x for x in links if x.sweep and _sane(x)}
        if pairs and all((leaders[a], leaders[b]) in by_hosts for a, b in pairs):
            return probe, [dataclasses.replace(by_hosts[(leaders[a], leaders[b])], src=a, dst=b) for a, b in pairs]
    return None


def derivable(spec: RunSpec) -> bool:
    """The spec leaves its TLS transport across hosts to be derived: it sets none of KEYS."""
    return transport_of(spec) == "tls" and not all_on_loopback(spec) and not any(sets(spec, k) for k in KEYS)


def derive(spec: RunSpec, store: Store, now: float | None = None) -> dict[str, Any] | None:
    """{"streams", "link_pace", "source", "probe_id", "measured", "replicas"} for a spec launch derives for;
    None where the spec sets its transport, does not use TLS across hosts, or no measurement fits."""
    if not derivable(spec):
        return None
    found = stored_links(spec, store, now)
    if found is None:
        return None
    probe, links = found
    tr, _, _ = transport_model(spec, links, largest_exchange(spec_exchanges(spec)))
    return {"streams": tr.streams, "link_pace": dict(tr.link_pace), "source": probe["source"],
            "probe_id": probe["id"], "measured": probe["created"], "replicas": replicas(spec)}


def describe(got: dict[str, Any]) -> str:
    """One line for launch's progress and the event."""
    pace = ", ".join(f"{k} {v:g}" for k, v in sorted(got["link_pace"].items())) or "unpaced"
    age = time.strftime("%Y-%m-%d %H:%M", time.localtime(got["measured"]))
    return (f"transport tls: {got['streams']} stream(s) per peer and direction, pacing {pace} Mbit/s, derived "
            f"from the links {got['source']} measured at {age} (tune-h --write fixes them in the spec)")


def apply(spec: RunSpec, store: Store, run_id: str, *, fresh: bool, progress=lambda m: None) -> RunSpec:
    """`spec` with the derived transport settings: derived and recorded on a fresh launch, the run's
    recorded ones on a relaunch; unchanged where there is nothing to derive."""
    if fresh:
        got = derive(spec, store)
        if got is None:
            if derivable(spec) and _leaders(spec) is not None:
                progress(f"note: transport tls with its defaults ({spec.diloco.transport_streams} streams, unpaced): no "
                         f"measurement of these sites' links to derive them from (`dilococtl doctor SPEC --links` or "
                         f"tune-h measures them)")
            return spec
        msg = describe(got)
        store.add_event(run_id, EVENT, msg, detail=got)
    else:
        prior = store.events(run_id, kinds=[EVENT])
        if not prior:
            return spec
        got, msg = prior[-1].detail, prior[-1].message
    progress(msg)
    return dataclasses.replace(spec, diloco=dataclasses.replace(
        spec.diloco, transport_streams=int(got["streams"]), transport_link_pace_mbit=dict(got["link_pace"])))
