"""Tunes recorded in the store, read back: the newest for a spec and H, where an overlap or async
run's update lands (launch), tune-h's prediction beside a run's measured sync share (status), and each
round replayed in its tune's model (report).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dilococtl.spec_sites import lighthouse_host
from dilococtl.spec_types import RunSpec
from dilococtl.tune.choose import net_of, site_of_host, transport_model
from dilococtl.tune.measure import Link
from dilococtl.tune.tls_model import tls_arrivals, tls_cold_s
from dilococtl.tune.transfer import replicas


def newest_tune(store, spec_path: str, h: int):
    """The newest tune of the spec file at `spec_path` made for H = `h`, or None."""
    paths = list(dict.fromkeys([spec_path, str(Path(spec_path).resolve())]))
    tunes = [t for p in paths for t in store.tunes(spec_path=p) if t.h == h]
    return max(tunes, key=lambda x: (x.created, x.id)) if tunes else None




def tune_for(store, run):
    """The newest tune of `run`'s spec file made for the H the run uses, or None (reads no rounds)."""
    return newest_tune(store, run.spec_path, run.spec().diloco.h)




def tuned_land(store, spec: RunSpec) -> tuple[float, int] | None:
    """(diloco.overlap_land, tune id) for an overlap or async run of `spec` that leaves the landing unset:
    as soon as the exchange the newest tune for its spec file and H predicted is done. None: sync mode,
    an explicit overlap_land, or no such tune (the trainer then lands at UNTUNED_LAND)."""
    d = spec.diloco
    if d.mode not in ("overlap", "async") or d.overlap_land is not None or d.algorithm == "ddp":
        return None
    t = newest_tune(store, spec.path, d.h)
    land = (t.prediction.get("lands") or {}).get(d.mode) if t is not None else None
    if not (isinstance(land, int | float) and not isinstance(land, bool) and 0 < land <= 1):
        return None  # a tune from before lands were predicted, or a record that is not a landing
    return float(land), t.id




def prediction_for(store, run) -> dict | None:
    """The newest tune of `run`'s spec file made for the H the run uses, beside what the run measured.

    Returns None when no such tune exists. measured_sync_share is dilococtl.metrics' sync share of
    round time over the run's rounds (None before the first round), the figure tune-h predicts.
    """
    from dilococtl import metrics

    t = tune_for(store, run)
    if t is None:
        return None
    rounds = store.rounds(run.id)
    p = t.prediction
    return {"tune_id": t.id, "created": t.created, "h": t.h, "budget": t.budget,
            "predicted_sync_share": p.get("sync_share"), "predicted_efficiency": p.get("efficiency"),
            "predicted_sync_s": p.get("sync_s"), "predicted_step_s": p.get("step_s"),
            "measured_sync_share": metrics.sync_share(rounds), "measured_rounds": len(rounds)}




def _finite(*xs: Any) -> bool:
    return all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in xs)




def rounds_against_model(store, run, last: int = 0) -> list[dict[str, Any]] | None:
    """Each round of a sync-mode TLS run replayed in its tune's model from the sites' arrivals.

    A round's exchange is what the site that waited least measured (the others also waited for
    it). The model is tune-h's (`tls_model.tls_arrivals`, on the links of the tune made for the
    run's H), started from each site's `exchange_t`, so rounds where two sites arrived within a
    request's flight to the Lighthouse are predicted as they ran, not as one clean last arrival.
    An idle restart stretches the payload to the slow-start flow after the round's compute
    (`tls_cold_s`). Per round: round, site, measured and predicted sync_s and parts; `last` > 0:
    the newest that many rounds only. None: no such tune, not sync mode on the TLS transport, or fragments;
    rounds recorded before the parts were are left out.
    """
    t = tune_for(store, run)
    spec = run.spec()
    if t is None or spec.diloco.mode != "sync" or t.prediction.get("transport") != "tls":
        return None
    if (t.prediction.get("fragments") or 1) > 1:
        return None  # a round of several exchanges: their arrivals are not replayed (yet)
    links = [Link(**x) for x in t.links]
    tr, _, _ = transport_model(spec, links, t.payload_bytes, derive=False)  # the streams and pacing it ran with
    net = net_of(links, tr.streams * replicas(spec), tr)
    ph = [(op, int(n)) for op, n in t.prediction["phases"]]
    sites = [s.name for s in spec.sites]
    lh = site_of_host(spec, lighthouse_host(spec))
    by_round: dict[int, dict] = {}
    newest = max((r.round for r in store.latest_rounds(run.id).values()), default=0)
    for r in store.rounds(run.id, after=max(0, newest - last) if last > 0 else 0):
        by_round.setdefault(r.round, {})[r.site] = r
    out = []
    for n, rs in sorted(by_round.items()):
        if set(rs) != set(sites) or not all(_finite(r.exchange_t, r.sync_s, r.compute_s, r.quorum_s, r.weight_s,
                                                     r.payload_s) for r in rs.values()):
            continue  # a site's record from before the parts, or one whose numbers are not numbers
        t0 = min(r.exchange_t for r in rs.values())
        pred = tls_arrivals(ph, sites, net, tr, {s: r.exchange_t - t0 for s, r in rs.items()},
                            reps=replicas(spec), lighthouse_site=lh)
        least = min(rs.values(), key=lambda r: r.sync_s)  # the site that arrived last
        # the connections idled through the round's compute: a restart stretches the payload
        cold = tls_cold_s(ph, sites, net, tr, reps=replicas(spec), idle_s=min(r.compute_s for r in rs.values()))
        p = pred[least.site]
        p["payload_s"] = max(p["payload_s"], cold)
        p["sync_s"] = p["quorum_s"] + p["weight_s"] + p["payload_s"]
        out.append({"round": n, "site": least.site, "sync_s": least.sync_s, "predicted_s": p["sync_s"],
                    "measured": {"quorum_s": least.quorum_s, "weight_s": least.weight_s, "payload_s": least.payload_s},
                    "predicted": {k: p[k] for k in ("quorum_s", "weight_s", "payload_s")}})
    return out
