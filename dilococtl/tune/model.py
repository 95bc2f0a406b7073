"""A pure model of one round's sync: what the exchange costs on measured links.

No I/O and no nodes: the inputs are measured links (transfer.py), step times and the payload's wire
plan; measure.py measures them, choose.py turns a round's cost into H. Gloo's round is `sync_round`
(transfer.py says how), the TLS transport's is replayed by tls_model.py, async mode's push and pull
is `async_round`.

Fragments (diloco.fragments = F, Streaming DiLoCo; trainer/rules/fragments.py): the parameter tensors are dealt
into F fragments of about equal size (trainer.rules.fragments.split, the trainer's own split: whole tensors, so
the largest is a little over 1/F), and a round makes F exchanges, fragment f's after inner step
floor((f+1)H/F), each a whole exchange of its fragment's bytes: its own quorum, weight all-gather,
payload collectives and (3 sites on) digest, blocking compute in sync mode (`round_exchanges`). The
round's sync is their sum, every fixed cost paid F times; the peak bytes of one exchange are the
largest fragment's (`fragment_payload_bytes`), and the connections idle H/F steps between exchanges
(`exchange_idle`), not H. Overlap mode hides the sum behind its landing as it hides one exchange (an
approximation: there each exchange has the steps to the next exchange point to hide behind). Not modelled: a round whose
exchanges are replayed from the sites' arrivals (history.rounds_against_model) when F > 1.
"""

from __future__ import annotations

import dataclasses
import math

from dilococtl.tune.tls_model import tls_last_site, tls_round
from dilococtl.tune.transfer import (
    GLOO,
    Net,
    Transport,
    cold_send_s,
    collective_bytes,
    collective_s,
    link_path,
    quorum_rpc_s,
    ring,
    transfer_s,
)
from trainer.rules.fragments import offsets


def last_site_s(br: dict[str, float], sites: list[str], net: Net, lighthouse_site: str | None,
                transport: Transport = GLOO, ph: list[tuple[str, int]] | None = None,
                reps: int = 1) -> dict[str, float]:
    """A synchronous round's exchange (breakdown `br`, charged the farthest site's quorum RPC) as
    each site waits for it when that site arrives last (module docstring). The TLS transport
    replays the round from each site's late arrival (`tls_last_site`; needs `ph`)."""
    if lighthouse_site not in sites or len(sites) <= 1:
        return {s: br["sync_s"] for s in sites}
    if transport.kind == "tls":
        per = tls_last_site(ph or [], sites, net, transport, reps=reps, lighthouse_site=lighthouse_site)
        return {s: per[s]["sync_s"] + br.get("restart_s", 0.0) for s in sites}

    def rtt(s: str) -> float:
        return 0.0 if s == lighthouse_site else link_path(net, s, lighthouse_site).rtt_ms / 1000.0

    far = max(rtt(s) for s in sites)
    return {s: br["sync_s"] - br["quorum_s"] + (rtt(s) + far) / 2 for s in sites}




def sync_round(ph: list[tuple[str, int]], sites: list[str], net: Net, *, reps: int = 1,
               lighthouse_site: str | None = None, transport: Transport = GLOO,
               idle_s: float = math.inf) -> dict[str, float]:
    """Seconds one synchronous round spends in the exchange: quorum + weight + payload collectives.
    `idle_s`: how long the connections idled before it (a round's compute), for the idle restart."""
    if transport.kind == "tls":
        return tls_round(ph, sites, net, transport, reps=reps, lighthouse_site=lighthouse_site, idle_s=idle_s)
    k = len(sites)
    if k <= 1:
        return {"quorum_s": 0.0, "weight_s": 0.0, "payload_s": 0.0, "sync_s": 0.0}
    edges = [link_path(net, a, b) for a, b in ring(sites)]
    quorum = quorum_rpc_s(sites, net, lighthouse_site)
    weight = collective_s("gather", 24, k, edges, reps)
    payload = sum(collective_s(op, n, k, edges, reps) for op, n in ph)
    # a restarted window makes the round's bytes one slow-start flow, whose round trips the steps'
    # own round trips then overlap: the exchange takes the longer of the two
    sent = sum(collective_bytes(op, n, k) for op, n in ph)
    cold = max((cold_send_s(sent, p, reps, idle_s) for p in edges if p.restarts_idle), default=0.0)
    restart = max(0.0, cold - payload)
    return {"quorum_s": quorum, "weight_s": weight, "payload_s": payload, "restart_s": restart,
            "sync_s": quorum + weight + payload + restart}




def async_round(payload_bytes: int, pull_bytes: int, site: str, service_site: str, net: Net, *,
                reps: int = 1) -> float:
    """Seconds site `site` spends pushing its payload to and pulling θ from the outer service."""
    if site == service_site:
        return 0.0
    up, down = link_path(net, site, service_site), link_path(net, service_site, site)
    # one request: θ comes back in the push's answer, so the pull pays no round trip of its own
    return transfer_s(payload_bytes, up, reps) + transfer_s(pull_bytes, down, reps) - down.rtt_ms / 1000.0




def exchange_idle(h: int, n: int, step_s: float) -> list[float]:
    """Seconds the connections idle before each of a round's `n` exchanges: the inner steps since the
    one before (trainer.rules.fragments.offsets; the first's since the last of the round before). One: H."""
    at = offsets(h, n)
    return [(b - a) * step_s for a, b in zip([0, *at], at, strict=False)]




def round_exchanges(xs: list[list[tuple[str, int]]], sites: list[str], net: Net, *, reps: int = 1,
                    lighthouse_site: str | None = None, transport: Transport = GLOO,
                    idle_s: list[float] | None = None) -> tuple[dict[str, float], list[dict[str, float]]]:
    """A synchronous round of the exchanges `xs` (each its phases; one per fragment), each a whole
    `sync_round` with its own quorum, weight all-gather, payload, restart and digest, each blocking
    the compute: (the round's parts summed, each exchange's). `idle_s`: the idle before each (None:
    long enough that restarting windows start from scratch). The mesh is built once per quorum, not
    per exchange: setup_s is the largest exchange's, not their sum."""
    idle = idle_s if idle_s is not None else [math.inf] * len(xs)
    per = [sync_round(ph, sites, net, reps=reps, lighthouse_site=lighthouse_site, transport=transport, idle_s=i)
           for ph, i in zip(xs, idle, strict=True)]
    keys = dict.fromkeys(k for br in per for k in br)
    return {k: (max if k == "setup_s" else sum)(br.get(k, 0.0) for br in per) for k in keys}, per




def scaled(net: Net, s: float) -> Net:
    """Every link with its goodputs (and its own pacing) times s: the same round trips on a faster line."""
    return {k: dataclasses.replace(p, mbit=p.mbit * s, stream_mbit=p.stream_mbit * s,
                                   pace_mbit=p.pace_mbit * s if p.pace_mbit else p.pace_mbit)
            for k, p in net.items()}
