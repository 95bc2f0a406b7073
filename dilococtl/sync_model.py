"""A pure model of one round's sync: what the exchange costs on measured links, and the H it calls for.

No I/O and no nodes: the inputs are measured links (`Path_` per direction), step times and the
payload's wire plan; dilococtl/tune.py measures them and feeds them here. The rule that turns sync
and step time into H is trainer/sync_rule.py, shared with the trainer's h_auto.

Sync-time model (what `trainer.loop.SiteRun.sync` does per round, see trainer/compression.py):
- torchft ranks the sites by replica id (the site name), and gloo runs its collectives as a ring
  in rank order: site[0] -> site[1] -> ... -> site[0] over the names sorted. A ring step moves a
  message to the next site; all sites step together, so a step of b bytes takes
  max over ring edges e of (RTT_e + b * replicas * 8 / bandwidth_e).
  Latency model: a whole round trip per ring step: gloo sends only once the receiver has told it
  that its receive is posted (measured in the lab: a 24-byte all-gather between two sites took
  42-44 ms at 40 ms RTT; see BENCHMARKS.md, "tune-h against the run it tuned").
- an all-reduce ("sum": codec "none" and PowerSGD without a quantizer) of n bytes over K sites is
  2(K-1) steps of n/K bytes; so is a quantized average ("qsum": int8, fp8, PowerSGD+int8/fp8: an
  all-to-all of n/K-byte shards, modelled as K-1 ring steps, then a ring all-gather of the
  averaged shards); an all-gather ("gather": top-k) is K-1 steps of n bytes (every site
  receives (K-1) payloads). PowerSGD exchanges P, then Q: two collectives.
- idle restart: a sender with net.ipv4.tcp_slow_start_after_idle = 1 (Linux's default) drops its
  congestion window back to 10 segments once a connection idled for an RTO, as every connection of
  the exchange has during the round's compute. A round's bytes on a connection then go out in slow
  start (the window doubling every RTT) until the window holds the link's bandwidth-delay product;
  the round's bytes on a connection then form one slow-start flow (`cold_send_s`; the window is
  kept between the ring's steps), whose round trips overlap the steps' own: the payload takes the
  longer of that flow and the steady model, on the slowest edge (`restart_s`: the difference).
  Each RTO of idle halves the window; a round's compute at the chosen H lasts many RTOs, so the
  flow starts from 10 segments. BBR paces from its bandwidth estimate instead and is exempt. The
  probe's streams are warm: it measures the steady rate. Lab, 50 Mbit/s, 80 ms, H = 400 (5 s of
  compute): exchange 0.58 s (Reno) / 0.64 s (CUBIC) restarting, 0.40-0.42 s not (or with BBR);
  predicted 0.57 / 0.41; 500 kB on an idle Reno connection took 0.42 s to deliver, the flow 0.41 s.
- per round also: one quorum RPC to the Lighthouse (the farthest site's RTT to the Lighthouse's
  site: with every member back, it answers at once rather than on its tick) and the all-gather
  of each site's participation weight and timings (24 bytes, K-1 steps).
- replicas: every trainer process of a site holds the full model and exchanges it with the same
  local rank of the other sites, over the same WAN: the bytes are multiplied by the processes
  per site (the largest site's count); in async mode the site's leader alone pushes and pulls.
- overlap mode: the exchange hides behind the next round's compute; only
  max(0, sync - H * step) is exposed.
- async mode: each site pushes its payload to, and pulls the fp32 parameters (4 bytes per
  parameter) from, an outer service assumed beside the Lighthouse: 2 RTTs plus both transfers
  on that site's link; sites run at their own pace, so each site gets its own H and the largest
  is chosen.

H is the smallest multiple of 10 with exposed sync <= budget * H * step time (the slowest site's
step in sync and overlap modes); predicted efficiency = H*step / (H*step + exposed sync).

H is the smallest multiple of 10 with exposed sync <= budget * H * step time (the slowest site's
step in sync and overlap modes); predicted efficiency = H*step / (H*step + exposed sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dilococtl.errors import BadInput
from dilococtl.spec import RunSpec, nproc_per_node
from trainer.codec_spec import CodecOptions, wire_plan
from trainer.config import ModelConfig, resolve_model
from trainer.sync_rule import GRID, efficiency
from trainer.sync_rule import min_h as _min_h

DEFAULT_MSS = 1448  # bytes per segment on a 1500-byte MTU path with TCP timestamps
INITIAL_WINDOW = 10  # segments: Linux's initial (and after-idle) congestion window
DEFAULT_MAX_H = 1000
DEFAULT_BUDGET = 0.1
TABLE_H = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000)  # rows of the efficiency table (<= max_h)


def min_h(sync_s: float, step_s: float, budget: float, mode: str = "sync", grid: int = GRID,
          land: float = 1.0) -> int:
    """trainer.sync_rule.min_h, with bad inputs as BadInput (exit 2)."""
    if not 0 < budget < 1:
        raise BadInput(f"--budget: must be in (0, 1), got {budget:g}")
    try:
        return _min_h(sync_s, step_s, budget, mode, grid, land)
    except ValueError as e:
        raise BadInput(str(e)) from None


def check_limits(budget: float, max_h: int) -> None:
    if not 0 < budget < 1:
        raise BadInput(f"--budget: must be in (0, 1), got {budget:g}")
    if max_h < GRID:
        raise BadInput(f"--max-h: must be >= {GRID}, got {max_h}")



@dataclass(frozen=True, slots=True)
class Path_:
    """What the model needs of one direction of a link."""

    mbit: float
    rtt_ms: float
    mss: int = DEFAULT_MSS
    restarts_idle: bool = False


Net = dict[tuple[str, str], Path_]  # (src site, dst site) -> path


# --- payload -------------------------------------------------------------------------------------

def param_shapes(model: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of `trainer.model.Transformer(model).parameters()`, in order, without torch."""
    m = resolve_model(model)
    hd = m.dim // m.n_heads
    block = [(m.dim,), (m.n_heads * hd, m.dim), (m.n_kv_heads * hd, m.dim), (m.n_kv_heads * hd, m.dim),
             (m.dim, m.n_heads * hd), (m.dim,), (m.ffn_hidden, m.dim), (m.dim, m.ffn_hidden), (m.ffn_hidden, m.dim)]
    shapes: list[tuple[int, ...]] = [(m.vocab_size, m.dim)]
    for _ in range(m.n_layers):
        shapes += block
    shapes.append((m.dim,))
    if not m.tie_embeddings:  # a tied output weight is the embedding: parameters() yields it once
        shapes.append((m.vocab_size, m.dim))
    return shapes


def phases(codec: str, shapes: list[tuple[int, ...]], opts: CodecOptions | None = None) -> list[tuple[str, int]]:
    """(collective, bytes) of each exchange one round makes: ("sum"|"qsum"|"gather", nbytes)."""
    return [(p.op, p.nbytes) for p in wire_plan(codec, shapes, opts).phases]


def replicas(spec: RunSpec) -> int:
    """Full payloads a site sends per round: one per trainer process of the largest site (each local
    rank exchanges with the same local rank of the other sites), one in async mode (the site's
    leader pushes and pulls for the whole site)."""
    if spec.diloco.mode == "async":
        return 1
    return max(len(s.hosts) * nproc_per_node(s) for s in spec.sites)


# --- sync model ----------------------------------------------------------------------------------

def ring(sites: list[str]) -> list[tuple[str, str]]:
    """Directed ring edges in torchft's rank order (replica id = site name, sorted)."""
    order = sorted(sites)
    return [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))] if len(order) > 1 else []


def _steady_s(nbytes: float, p: Path_, reps: int) -> float:
    """Seconds nbytes take at the link's measured rate, `reps` copies of them at once."""
    return nbytes * reps * 8.0 / (p.mbit * 1e6)


def _step_s(nbytes: float, edges: list[Path_], reps: int) -> float:
    return max(p.rtt_ms / 1000.0 + _steady_s(nbytes, p, reps) for p in edges)


def cold_send_s(nbytes: float, p: Path_, reps: int = 1) -> float:
    """Seconds to put nbytes through a connection whose window restarted at INITIAL_WINDOW
    segments; `reps` connections share the link's measured rate."""
    rate = p.mbit * 1e6 / reps  # bit/s per connection
    rtt = p.rtt_ms / 1000.0
    iw = INITIAL_WINDOW * p.mss
    bdp = max(rate * rtt / 8.0, iw)
    # the window doubles every round trip: after t round trips iw * (2^t - 1) bytes are out, until
    # the window holds the link (t = log2(bdp / iw), bdp - iw bytes out); the rest goes at the rate
    if nbytes <= bdp - iw:
        return rtt * math.log2(nbytes / iw + 1)
    return rtt * math.log2(bdp / iw) + (nbytes - (bdp - iw)) * 8.0 / rate


def _ring_steps(op: str, nbytes: int, k: int) -> tuple[int, float]:
    """(steps, bytes each member sends per step) of one ring collective (module docstring)."""
    if k <= 1:
        return 0, 0.0
    if op in ("sum", "qsum"):
        return 2 * (k - 1), nbytes / k
    if op == "gather":
        return k - 1, float(nbytes)
    raise ValueError(f"unknown collective {op!r}")


def collective_bytes(op: str, nbytes: int, k: int) -> float:
    """Bytes one member sends on its ring connection in one collective."""
    steps, b = _ring_steps(op, nbytes, k)
    return steps * b


def collective_s(op: str, nbytes: int, k: int, edges: list[Path_], reps: int = 1) -> float:
    """Seconds of one ring collective of `nbytes` per member over `k` members (see module docstring)."""
    steps, b = _ring_steps(op, nbytes, k)
    return steps * _step_s(b, edges, reps) if steps else 0.0


def _path(net: Net, a: str, b: str) -> Path_:
    try:
        return net[(a, b)]
    except KeyError:
        raise BadInput(f"no measured link {a} -> {b}") from None


def sync_round(ph: list[tuple[str, int]], sites: list[str], net: Net, *, reps: int = 1,
               lighthouse_site: str | None = None) -> dict[str, float]:
    """Seconds one synchronous round spends in the exchange: quorum + weight + payload collectives."""
    k = len(sites)
    if k <= 1:
        return {"quorum_s": 0.0, "weight_s": 0.0, "payload_s": 0.0, "sync_s": 0.0}
    edges = [_path(net, a, b) for a, b in ring(sites)]
    if lighthouse_site in sites:
        quorum = max(_path(net, s, lighthouse_site).rtt_ms for s in sites if s != lighthouse_site) / 1000.0
    else:
        quorum = max(p.rtt_ms for (a, b), p in net.items() if a in sites and b in sites) / 1000.0
    weight = collective_s("gather", 24, k, edges, reps)
    payload = sum(collective_s(op, n, k, edges, reps) for op, n in ph)
    # a restarted window makes the round's bytes one slow-start flow, whose round trips the steps'
    # own round trips then overlap: the exchange takes the longer of the two
    sent = sum(collective_bytes(op, n, k) for op, n in ph)
    cold = max((cold_send_s(sent, p, reps) for p in edges if p.restarts_idle), default=0.0)
    restart = max(0.0, cold - payload)
    return {"quorum_s": quorum, "weight_s": weight, "payload_s": payload, "restart_s": restart,
            "sync_s": quorum + weight + payload + restart}


def async_round(payload_bytes: int, pull_bytes: int, site: str, service_site: str, net: Net, *,
                reps: int = 1) -> float:
    """Seconds site `site` spends pushing its payload to and pulling θ from the outer service."""
    if site == service_site:
        return 0.0
    up, down = _path(net, site, service_site), _path(net, service_site, site)
    return _send_s(payload_bytes, up, reps) + _send_s(pull_bytes, down, reps)


def _send_s(nbytes: int, p: Path_, reps: int) -> float:
    steady = _steady_s(nbytes, p, reps)
    return p.rtt_ms / 1000.0 + (max(steady, cold_send_s(nbytes, p, reps)) if p.restarts_idle else steady)


@dataclass(kw_only=True, slots=True)
class Choice:
    """The H for one set of inputs, and what it predicts."""

    h: int  # smallest grid H meeting the budget (may exceed max_h)
    within_max: bool  # h <= max_h
    sync_s: float  # predicted exchange seconds per round (the governing site's, in async mode)
    step_s: float  # the governing step time
    efficiency: float  # at h
    sync_share: float  # 1 - efficiency: exposed sync / (compute + exposed sync)
    per_site: dict[str, dict[str, float]] = field(default_factory=dict)  # async: sync_s, step_s, h per site
    breakdown: dict[str, float] = field(default_factory=dict)  # sync mode: quorum/weight/payload seconds


def choose(*, mode: str, sites: list[str], net: Net, step_by_site: dict[str, float], ph: list[tuple[str, int]],
           reps: int = 1, pull_bytes: int = 0, lighthouse_site: str | None = None, budget: float = DEFAULT_BUDGET,
           max_h: int = DEFAULT_MAX_H, land: float = 1.0) -> Choice:
    """H for these measurements; see the module docstring for the model. `land`: overlap's
    diloco.overlap_land, the part of a round the exchange hides behind."""
    if mode == "async":
        svc = lighthouse_site if lighthouse_site in sites else sorted(sites)[0]
        payload = sum(n for _, n in ph)
        per = {}
        for s in sites:
            sy = async_round(payload, pull_bytes, s, svc, net, reps=reps)
            per[s] = {"sync_s": sy, "step_s": step_by_site[s], "h": min_h(sy, step_by_site[s], budget, mode)}
        h = max(p["h"] for p in per.values())
        gov = max(per, key=lambda s: (per[s]["sync_s"] / per[s]["step_s"], s))
        sync_s, step_s = per[gov]["sync_s"], per[gov]["step_s"]
        for p in per.values():
            p["efficiency"] = efficiency(h, p["step_s"], p["sync_s"], mode)
        eff = min(p["efficiency"] for p in per.values())
        return Choice(h=h, within_max=h <= max_h, sync_s=sync_s, step_s=step_s, efficiency=eff,
                      sync_share=1 - eff, per_site=per)
    br = sync_round(ph, sites, net, reps=reps, lighthouse_site=lighthouse_site)
    step_s = max(step_by_site[s] for s in sites)  # the slowest site holds everyone at the boundary
    h = min_h(br["sync_s"], step_s, budget, mode, land=land)
    eff = efficiency(h, step_s, br["sync_s"], mode, land)
    return Choice(h=h, within_max=h <= max_h, sync_s=br["sync_s"], step_s=step_s, efficiency=eff,
                  sync_share=1 - eff, breakdown=br)


def table(choice: Choice, mode: str, max_h: int, extra: tuple[int, ...] = (),
          land: float = 1.0) -> list[dict[str, float]]:
    """Predicted efficiency at a few H (the chosen and `extra` ones included), up to max_h."""
    hs = sorted({h for h in TABLE_H if h <= max_h} | {h for h in (choice.h, *extra) if 0 < h})
    rows = []
    for h in hs:
        if choice.per_site:
            eff = min(efficiency(h, p["step_s"], p["sync_s"], mode) for p in choice.per_site.values())
        else:
            eff = efficiency(h, choice.step_s, choice.sync_s, mode, land)
        rows.append({"h": h, "efficiency": eff, "sync_share": 1 - eff})
    return rows
