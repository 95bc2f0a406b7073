"""Choose H from the model: the smallest H whose exposed sync stays within the budget, and the
tune's whole result (`plan`, no I/O). The rule that turns sync and step time into H is
trainer/rules/sync_rule.py, shared with the trainer's h_auto.

H is the smallest multiple of 10 with exposed sync <= budget * H * step time (the slowest site's
step in sync and overlap modes); predicted efficiency = H*step / (H*step + exposed sync). A spec
that leaves overlap_land unset gets the landing derived instead (`choose`): H as sync mode's, the
update landing as soon as the exchange is done, nothing exposed.

Codecs: where no H up to max_h meets the budget, `plan` suggests the mildest of CANDIDATE_CODECS that
does. Transport: a spec that sets neither streams nor pacing gets them derived from the links
(`derive_streams`, `derive_link_pace`); launch derives the same from doctor's measurements.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dilococtl.errors import BadInput
from dilococtl.spec_sites import is_local, lighthouse_host
from dilococtl.spec_types import RunSpec
from dilococtl.tune.defaults import DEFAULT_BUDGET, DEFAULT_MAX_H
from dilococtl.tune.measure import Link, agg_mbit, all_on_loopback, best_mbit, sets, transport_of
from dilococtl.tune.model import async_round, exchange_idle, last_site_s, round_exchanges, scaled
from dilococtl.tune.transfer import (
    CLEAR_CPU_S_PER_GB,
    GLOO,
    Net,
    Path_,
    Transport,
    exchanges,
    fragment_payload_bytes,
    param_shapes,
    replicas,
)
from trainer.rules.codec_spec import codec_max_h
from trainer.rules.diloco_config import link_key
from trainer.rules.fragments import offsets
from trainer.rules.outer_rule import land_for
from trainer.rules.sync_rule import GRID, efficiency, exposed_s
from trainer.rules.sync_rule import min_h as _min_h

TABLE_H = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000)  # rows of the efficiency table (<= max_h)




def min_h(sync_s: float, step_s: float, budget: float, mode: str = "sync", grid: int = GRID,
          land: float = 1.0) -> int:
    """trainer.rules.sync_rule.min_h, with bad inputs as BadInput (exit 2)."""
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




# --- a round of several exchanges (diloco.fragments) ----------------------------------------------

MAX_SCALE = 1e4  # bandwidth_for: links at most this many times their measured goodput




def bandwidth_for(h: int, *, mode: str, sites: list[str], net: Net, step_by_site: dict[str, float],
                  ph: list[tuple[str, int]], xs: list[list[tuple[str, int]]] | None = None, reps: int = 1,
                  lighthouse_site: str | None = None, budget: float = DEFAULT_BUDGET, land: float | None = 1.0,
                  transport: Transport = GLOO, **_: object) -> float | None:
    """The bandwidth H needs: the least factor on every link's goodput (`scaled`) with which a round
    of the exchanges `xs` (None: [ph]) meets the budget at H, sized as `choose` sizes H (windows
    restarted from scratch; `land` None: as sync mode). None where MAX_SCALE would not do: the round
    trips and fixed costs of the exchanges alone break the budget. Sync and overlap modes."""
    xs = xs or [ph]
    step_s = max(step_by_site[s] for s in sites)
    size_mode, size_land = ("sync", 1.0) if land is None else (mode, land)
    compute = h * step_s

    def meets(s: float) -> bool:
        br, _ = round_exchanges(xs, sites, scaled(net, s), reps=reps, lighthouse_site=lighthouse_site,
                                transport=transport)
        return exposed_s(br["sync_s"], compute, size_mode, size_land) <= budget * compute

    lo, hi = 1.0 / MAX_SCALE, MAX_SCALE
    if not meets(hi):
        return None
    if meets(lo):
        return lo
    while hi / lo > 1.001:  # geometric bisection: 0.1% apart
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if meets(mid) else (mid, hi)
    return hi




@dataclass(kw_only=True, slots=True)
class Choice:
    """The H for one set of inputs, and what it predicts."""

    h: int  # smallest grid H meeting the budget (may exceed max_h)
    within_max: bool  # h <= max_h (and, where the codec bounds H, the budget met at that bound)
    sync_s: float  # predicted exchange seconds per round (the governing site's, in async mode)
    step_s: float  # the governing step time
    efficiency: float  # at h
    sync_share: float  # 1 - efficiency: exposed sync / (compute + exposed sync)
    land: float = 1.0  # overlap, async: where in the next round the update lands (diloco.overlap_land); in
    # sync mode, where overlap's would land
    per_site: dict[str, dict[str, float]] = field(default_factory=dict)  # async: sync_s, step_s, h per site
    breakdown: dict[str, float] = field(default_factory=dict)  # sync mode: quorum/weight/payload seconds
    last_site: dict[str, float] = field(default_factory=dict)  # sync mode: the exchange when that site is last
    exchanges: list[dict[str, float]] = field(default_factory=list)  # sync mode: each exchange of the round at h
    # (one per fragment): after_step (its inner step), bytes (its collectives'), sync_s and its parts
    codec_cap: int | None = None  # the codec's largest H (codec_spec.codec_max_h), when it bounded h




def _async_per_site(sites: list[str], net: Net, step_by_site: dict[str, float], ph: list[tuple[str, int]],
                    reps: int, pull_bytes: int, lighthouse_site: str | None) -> dict[str, dict[str, float]]:
    """Async mode: each site's push and pull with the outer service (beside the Lighthouse), and its step."""
    svc = lighthouse_site if lighthouse_site in sites else sorted(sites)[0]
    payload = sum(n for _, n in ph)
    return {s: {"sync_s": async_round(payload, pull_bytes, s, svc, net, reps=reps), "step_s": step_by_site[s]}
            for s in sites}




def _async_land(per: dict[str, dict[str, float]], h: int) -> float:
    """Async's landing at H: after the slowest push of any site."""
    return max(land_for(p["sync_s"], p["step_s"], h) for p in per.values())




def _meets(eff: float, budget: float) -> bool:
    """compute / (compute + exposed) at least 1 / (1 + budget): exposed sync within budget x compute."""
    return eff >= 1 / (1 + budget) - 1e-12




def choose(*, mode: str, sites: list[str], net: Net, step_by_site: dict[str, float], ph: list[tuple[str, int]],
           reps: int = 1, pull_bytes: int = 0, lighthouse_site: str | None = None, budget: float = DEFAULT_BUDGET,
           max_h: int = DEFAULT_MAX_H, land: float | None = 1.0, transport: Transport = GLOO,
           xs: list[list[tuple[str, int]]] | None = None, h_cap: int | None = None) -> Choice:
    """H for these measurements; see the module docstring for the model.

    `xs`: the phases of each exchange of a round (`exchanges`: one per fragment of diloco.fragments;
    None: the one exchange `ph`). A round pays each exchange whole (`round_exchanges`), and H keeps
    their sum within the budget. Async mode exchanges `ph` (fragments need rounds in lockstep).

    `land`: overlap's and async's diloco.overlap_land, the part of the next round the exchange hides
    behind; the budget bounds what sticks out of it. None (the spec leaves it unset): derived. H is then
    sized as sync mode sizes it (the exchange within the budget of a round's compute: the update lands
    no later than that), and the update lands as soon as the exchange is done (Choice.land), so nothing
    is exposed.

    `h_cap`: the largest H the codec keeps its quality at (codec_spec.codec_max_h). A larger H is cut to
    it; the budget then holds only where the mode hides the exchange, and `within_max` says whether it does.
    """
    size_mode, size_land = ("sync", 1.0) if land is None else (mode, land)
    if mode == "async":
        per = _async_per_site(sites, net, step_by_site, ph, reps, pull_bytes, lighthouse_site)
        for p in per.values():
            p["h"] = min_h(p["sync_s"], p["step_s"], budget, size_mode, land=size_land)
        h = max(p["h"] for p in per.values())
        capped = h_cap is not None and h > h_cap
        h = h_cap if capped else h
        at = _async_land(per, h) if land is None else land
        gov = max(per, key=lambda s: (per[s]["sync_s"] / per[s]["step_s"], s))
        sync_s, step_s = per[gov]["sync_s"], per[gov]["step_s"]
        for p in per.values():
            p["efficiency"] = efficiency(h, p["step_s"], p["sync_s"], mode, at)
        eff = min(p["efficiency"] for p in per.values())
        return Choice(h=h, within_max=h <= max_h and (not capped or _meets(eff, budget)), sync_s=sync_s,
                      step_s=step_s, efficiency=eff, sync_share=1 - eff, land=at, per_site=per,
                      codec_cap=h_cap if capped else None)
    xs = xs or [ph]
    rx = dict(reps=reps, lighthouse_site=lighthouse_site, transport=transport)
    br, per = round_exchanges(xs, sites, net, **rx)
    step_s = max(step_by_site[s] for s in sites)  # the slowest site holds everyone at the boundary
    h = min_h(br["sync_s"], step_s, budget, size_mode, land=size_land)
    capped = h_cap is not None and h > h_cap
    if capped:
        h = h_cap
    if br.get("restart_s"):
        # H was sized for windows restarted from scratch (a long idle); at that H the compute
        # may last only a few RTOs, and the windows keep part of themselves: predict that round
        br, per = round_exchanges(xs, sites, net, **rx, idle_s=exchange_idle(h, len(xs), step_s))
    at = land_for(br["sync_s"], step_s, h) if land is None else land
    eff = efficiency(h, step_s, br["sync_s"], mode, at)
    last = [last_site_s(b, sites, net, lighthouse_site, transport, x, reps) for b, x in zip(per, xs, strict=True)]
    return Choice(h=h, within_max=h <= max_h and (not capped or _meets(eff, budget)), sync_s=br["sync_s"],
                  step_s=step_s, efficiency=eff,
                  sync_share=1 - eff, land=at, codec_cap=h_cap if capped else None, breakdown=br,
                  last_site={s: sum(x[s] for x in last) for s in sites},
                  exchanges=[{"after_step": o, "bytes": sum(n for _, n in x), **b}
                             for o, x, b in zip(offsets(h, len(xs)), xs, per, strict=True)])




def lands_at(h: int, *, sites: list[str], net: Net, step_by_site: dict[str, float], ph: list[tuple[str, int]],
             reps: int = 1, pull_bytes: int = 0, lighthouse_site: str | None = None,
             transport: Transport = GLOO, xs: list[list[tuple[str, int]]] | None = None,
             **_: object) -> dict[str, float]:
    """Where overlap's and async's update can land at H: as soon as each mode's predicted exchange is
    done (overlap: the round's exchanges `xs`, as `choose`). A tune made in one mode thus serves a run
    switched to another (launch: history.tuned_land)."""
    step_s = max(step_by_site[s] for s in sites)
    xs = xs or [ph]
    sync_s = round_exchanges(xs, sites, net, reps=reps, lighthouse_site=lighthouse_site, transport=transport,
                             idle_s=exchange_idle(h, len(xs), step_s))[0]["sync_s"]
    per = _async_per_site(sites, net, step_by_site, ph, reps, pull_bytes, lighthouse_site)
    return {"overlap": land_for(sync_s, step_s, h), "async": _async_land(per, h)}




def table(choice: Choice, mode: str, max_h: int, extra: tuple[int, ...] = (),
          land: float | None = 1.0) -> list[dict[str, float]]:
    """Predicted efficiency at a few H (the chosen and `extra` ones included), up to max_h; `land` as
    in `choose` (None: each H lands as soon as its exchange is done, the row's `land`)."""
    hs = sorted({h for h in TABLE_H if h <= max_h} | {h for h in (choice.h, *extra) if 0 < h})
    rows = []
    for h in hs:
        if choice.per_site:
            at = _async_land(choice.per_site, h) if land is None else land
            eff = min(efficiency(h, p["step_s"], p["sync_s"], mode, at) for p in choice.per_site.values())
        else:
            at = land_for(choice.sync_s, choice.step_s, h) if land is None else land
            eff = efficiency(h, choice.step_s, choice.sync_s, mode, at)
        rows.append({"h": h, "efficiency": eff, "sync_share": 1 - eff, "land": at})
    return rows



# codecs tried, mildest first, when H would exceed the maximum
CANDIDATE_CODECS = ("int8", "fp4", "powersgd:64", "powersgd:32+int8", "powersgd:16+int8", "topk:0.01+int8",
                    "sparse:0.01", "powersgd:4+int8", "topk:0.001+int8")


SWEEP_SHARE = 0.9  # derived S: the fewest streams carrying this share of a link's best goodput


PACE_OVER = 1.03  # derived pacing: the streams' total on a link, over its best goodput (derive_link_pace)


PACE_MIN_BDPS = 4  # derived pacing: only a link over which a round moves this many bandwidth-delay products




def derive_streams(links: list[Link], reps: int = 1) -> int:
    """S for a spec that sets none: on every link, the fewest probed streams that carried
    SWEEP_SHARE of its best goodput (about bandwidth-delay product / one connection's window),
    shared by the `reps` processes of a site; the largest over the links, at least 1."""
    need = 1
    for x in links:
        if x.sweep:
            n = min(n for n, m in x.sweep if m >= SWEEP_SHARE * best_mbit(x))
            need = max(need, math.ceil(n / reps))
    return min(need, 256)




def derive_link_pace(links: list[Link], payload_bytes: int, reps: int = 1) -> dict[str, float]:
    """diloco.transport_link_pace_mbit for a spec that sets no pacing: each swept link over which a
    site's round payload (`reps` processes of `payload_bytes`) is at least PACE_MIN_BDPS of its
    bandwidth-delay product, paced to PACE_OVER x its own best goodput, shared by the `reps`
    processes, rounded to 0.1 Mbit/s; the others unpaced (absent).

    Unpaced, a loss-based sender probes past a shallow bottleneck queue, many streams together
    sooner, and the round's payload stretches by the retransmissions (asymmetric lab, one stream on
    a 20 Mbit/s link: 72 and 46 segments retransmitted in exactly the rounds 13-26% over their
    replay; BENCHMARKS.md, "The TLS transport's model"); paced at its share, each stream sends evenly
    and the queue stays short. But a stream paced at its share stays at it while the others have no
    chunk to send, so a payload the streams' windows hold at once goes slower paced. Lab, 50 Mbit/s,
    80 ms (BDP ~0.5 MB), 128 kB buffers, 8 CUBIC streams, 5 s idle before each exchange (BENCHMARKS.md,
    "The lab's window-limited link"): unpaced / paced at 49 Mbit/s, 0.5 MiB 0.197 / 0.253 s, 2 MiB
    0.491 / 0.438 s, 4 MiB 0.798 / 0.800 s, 16 MiB 3.07 / 2.95 s. The probe's goodput counts payload
    at the receiver, pacing the bytes TCP sends: pacing at the goodput itself would leave the
    headers' ~3% of the link unused. Each link gets its own rate: one rate for all would hold a
    fast link to the slowest one's.
    """
    out = {}
    for x in links:
        if not x.sweep:
            continue  # not swept: its capacity unknown
        best = best_mbit(x)
        if reps * payload_bytes >= PACE_MIN_BDPS * best * 1e6 / 8 * x.rtt_ms / 1000:
            out[link_key(x.src, x.dst)] = round(PACE_OVER * best / max(1, reps), 1)
    return out




# --- the whole tune ------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class TuneResult:
    spec_path: str  # absolute path of the spec
    mode: str  # diloco.mode
    codec: str  # diloco.compression
    sites: list[str]
    links: list[Link]
    steps: dict[str, Any]  # source, per_site seconds
    payload_bytes: int  # what one process hands to the comm per round
    phases: list[tuple[str, int]]
    replicas: int  # full payloads a site sends per round (replicas(spec))
    budget: float
    max_h: int
    current_h: int  # diloco.h in the spec
    choice: Choice
    table: list[dict[str, float]]
    transport: str = "gloo"  # the data plane modelled: transport_of(spec)
    streams: int = 1  # tls: S modelled, connections per peer and direction
    streams_derived: bool = False  # S came from the links (derive_streams), not from the spec
    pace_mbit: float = 0.0  # tls: the total the S streams to a peer are paced to (0: unpaced) ...
    link_pace: dict[str, float] = dataclasses.field(default_factory=dict)  # ... but on "SRC->DST", its own
    pace_derived: bool = False  # link_pace came from the links (derive_link_pace), not from the spec
    suggestion: dict[str, Any] | None = None  # when choice.h > max_h: a codec that brings H under it
    lands: dict[str, float] = dataclasses.field(default_factory=dict)  # overlap, async: where the update lands
    # at the chosen H when the spec leaves diloco.overlap_land unset (lands_at); launch applies it
    rounds: int = 0  # the run's outer rounds at the chosen H (rounds_at)
    sized_in_steps: bool = False  # the spec sets train.steps (else diloco.rounds fixes the rounds)
    fragments: int = 1  # diloco.fragments: exchanges per round
    fragment_payload_bytes: list[int] = dataclasses.field(default_factory=list)  # each exchange's payload per
    # process (the trainer's own figure); one entry without fragments
    peak_exchange_bytes: int = 0  # the largest of them: the peak bytes of one exchange
    bandwidth: dict[str, Any] | None = None  # the bandwidth the spec's H needs (bandwidth_of); None: async
    tune_id: int | None = None  # row in the store
    written: bool = False  # H was written into the spec

    def exchange_lines(self) -> list[str]:
        """What tune-h says of the round's exchanges (fragments) and of the bandwidth the spec's H needs."""
        out, c = [], self.choice
        if self.fragments > 1 and c.exchanges:
            out.append(f"fragments {self.fragments}: {len(c.exchanges)} exchanges a round, after inner steps "
                       + ", ".join(str(x["after_step"]) for x in c.exchanges) + f" of H = {c.h}, of "
                       + " + ".join(f"{n:,}" for n in self.fragment_payload_bytes) + " bytes per process (peak "
                       f"{self.peak_exchange_bytes:,}: {self.peak_exchange_bytes / max(1, self.payload_bytes):.1%} "
                       "of the round's)")
            out.append("each exchange pays its own quorum, weight and payload: "
                       + ", ".join(f"{x['sync_s']:.3f}" for x in c.exchanges) + f" s; {c.sync_s:.3f} s a round")
        b = self.bandwidth
        if b is not None:
            if b["mbit"] is None:
                out.append(f"H = {b['h']} (the spec's) meets the budget at no bandwidth: the round trips and CPU of "
                           f"its {self.fragments} exchange(s) a round alone exceed {self.budget:g} of its compute")
            else:
                out.append(f"H = {b['h']} (the spec's) needs links at {b['scale']:.2f}x their measured goodput "
                           f"(the slowest {b['mbit']:.1f} Mbit/s) to keep its sync within {self.budget:g} of compute")
        return out

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["links"] = [dataclasses.asdict(x) for x in self.links]
        d["choice"] = dataclasses.asdict(self.choice)
        d["h"] = self.choice.h
        d["within_max"] = self.choice.within_max
        return d

    def prediction(self) -> dict[str, Any]:
        """What the store keeps as the tune's prediction (prediction_for reads it back)."""
        c = self.choice
        return {"mode": self.mode, "codec": self.codec, "k": len(self.sites), "replicas": self.replicas,
                "transport": self.transport, "streams": self.streams, "streams_derived": self.streams_derived,
                "pace_mbit": self.pace_mbit, "link_pace": self.link_pace, "pace_derived": self.pace_derived,
                "sync_s": c.sync_s, "step_s": c.step_s, "compute_s": c.h * c.step_s, "efficiency": c.efficiency,
                "sync_share": c.sync_share, "within_max": c.within_max, "max_h": self.max_h,
                "phases": self.phases, "breakdown": c.breakdown, "per_site": c.per_site, "last_site": c.last_site,
                "table": self.table, "land": c.land, "lands": self.lands, "fragments": self.fragments,
                "fragment_payload_bytes": self.fragment_payload_bytes, "peak_exchange_bytes": self.peak_exchange_bytes,
                "exchanges": c.exchanges, "bandwidth": self.bandwidth,
                "suggestion": self.suggestion, "step_source": self.steps.get("source"),
                "step_per_site": self.steps.get("per_site")}




def net_of(links: list[Link], streams: int = 0, t: Transport = GLOO) -> Net:
    """The model's links; `streams` > 0: each link's goodput with that many streams (agg_mbit); each
    with its own pace where `t` gives it one."""
    return {(x.src, x.dst): Path_(mbit=agg_mbit(x, streams) if streams else x.mbit, rtt_ms=x.rtt_ms, mss=x.mss,
                                  restarts_idle=x.restarts_idle, stream_mbit=x.stream_mbit,
                                  pace_mbit=t.link_pace.get(link_key(x.src, x.dst)))
            for x in links}




def transport_model(spec: RunSpec, links: list[Link], payload_bytes: int = 0,
                    derive: bool = True) -> tuple[Transport, bool, bool]:
    """The transport to model for a round of `payload_bytes` per process, and whether its S and its
    pacing were derived from the links (the spec sets neither; `derive` False: the spec's values, as
    a run of it used them)."""
    if transport_of(spec) == "gloo":
        return GLOO, False, False
    if all_on_loopback(spec):  # one clear stream per direction, nothing to derive
        return Transport(kind="tls", streams=1, cpu_s_per_gb=CLEAR_CPU_S_PER_GB), False, False
    derived = derive and not sets(spec, "transport_streams") and any(x.sweep for x in links)
    s = derive_streams(links, replicas(spec)) if derived else spec.diloco.transport_streams
    d = spec.diloco
    paceable = derived and not sets(spec, "transport_pace_mbit") and not sets(spec, "transport_link_pace_mbit")
    link_pace = derive_link_pace(links, payload_bytes, replicas(spec)) if paceable else dict(d.transport_link_pace_mbit)
    return (Transport(kind="tls", streams=s, pace_mbit=d.transport_pace_mbit, link_pace=link_pace), derived,
            paceable and bool(link_pace))




def rounds_at(spec: RunSpec, h: int) -> int:
    """The run's outer rounds at H: train.steps // H where the spec sizes the run in inner steps (its
    tokens then stay put whatever H), else diloco.rounds."""
    return max(1, spec.train.steps // h) if spec.train.steps else spec.diloco.rounds




def site_of_host(spec: RunSpec, host: str) -> str | None:
    for s in spec.sites:
        if host in s.hosts or (is_local(host) and any(is_local(h) for h in s.hosts)):
            return s.name
    return None




def spec_exchanges(spec: RunSpec, codec: str | None = None) -> list[list[tuple[str, int]]]:
    """A round's exchanges as `spec` runs them (with `codec` in place of its own): one per fragment,
    each its collectives (kind, bytes per process)."""
    d = spec.diloco
    guarded = d.mode != "async" and d.algorithm != "ddp"
    frags = 1 if d.mode == "async" else d.fragments  # async has no fragments (the spec check refuses them)
    return exchanges(d.compression if codec is None else codec, param_shapes(spec.model), d.codec_options(), guarded,
                     len(spec.sites), frags)




def largest_exchange(xs: list[list[tuple[str, int]]]) -> int:
    """Bytes per process of a round's largest exchange: what pacing goes by (the streams idle between
    a round's exchanges)."""
    return max(sum(n for _, n in x) for x in xs)




def plan(spec: RunSpec, links: list[Link], steps: dict[str, Any], *, budget: float = DEFAULT_BUDGET,
         max_h: int = DEFAULT_MAX_H, codec: str | None = None) -> TuneResult:
    """Model the sync time from measurements and choose H (no I/O)."""
    check_limits(budget, max_h)
    codec = spec.diloco.compression if codec is None else codec
    shapes = param_shapes(spec.model)
    sites = [s.name for s in spec.sites]
    opts = spec.diloco.codec_options()
    xs = spec_exchanges(spec, codec)
    frags = len(xs)
    ph = [p for x in xs for p in x]  # the round's collectives, exchange after exchange
    per_frag = fragment_payload_bytes(codec, shapes, opts, frags)
    tr, derived, paced = transport_model(spec, links, largest_exchange(xs))
    net = net_of(links, tr.streams * replicas(spec) if tr.kind == "tls" else 0, tr)
    kw = dict(mode=spec.diloco.mode, sites=sites, net=net, step_by_site=steps["per_site"],
              reps=replicas(spec), pull_bytes=4 * sum(math.prod(s) for s in shapes),
              lighthouse_site=site_of_host(spec, lighthouse_host(spec)), budget=budget, max_h=max_h,
              land=spec.diloco.overlap_land, transport=tr)
    choice = choose(ph=ph, xs=xs, h_cap=codec_max_h(codec), **kw)
    # where each hidden mode's update lands at this H, for a run switched to it (launch: tuned_land)
    lands = lands_at(choice.h, ph=ph, xs=xs, **kw) if spec.diloco.overlap_land is None else {}
    suggestion = None
    if not choice.within_max:
        payload = sum(n for _, n in ph)
        for cand in CANDIDATE_CODECS:
            cxs = spec_exchanges(spec, cand)
            cph = [p for x in cxs for p in x]
            if sum(n for _, n in cph) >= payload:
                continue
            c = choose(ph=cph, xs=cxs, h_cap=codec_max_h(cand), **kw)
            if c.within_max:
                suggestion = {"compression": cand, "h": c.h, "payload_bytes": sum(n for _, n in cph),
                              "sync_s": c.sync_s, "efficiency": c.efficiency}
                break
    return TuneResult(spec_path=str(Path(spec.path).resolve()), mode=spec.diloco.mode, codec=codec, sites=sites,
                      links=links, steps=steps, payload_bytes=sum(n for _, n in ph), phases=ph,
                      replicas=kw["reps"], budget=budget, max_h=max_h, current_h=spec.diloco.h, choice=choice,
                      table=table(choice, spec.diloco.mode, max_h, (spec.diloco.h,), spec.diloco.overlap_land),
                      transport=tr.kind, streams=tr.streams, streams_derived=derived, pace_mbit=tr.pace_mbit,
                      link_pace=tr.link_pace, pace_derived=paced, suggestion=suggestion,
                      rounds=rounds_at(spec, choice.h), sized_in_steps=bool(spec.train.steps), lands=lands,
                      fragments=frags, fragment_payload_bytes=per_frag, peak_exchange_bytes=max(per_frag),
                      bandwidth=bandwidth_of(spec, links, xs, ph, kw))




def bandwidth_of(spec: RunSpec, links: list[Link], xs: list[list[tuple[str, int]]], ph: list[tuple[str, int]],
                 kw: dict[str, Any]) -> dict[str, Any] | None:
    """The bandwidth the spec's H needs (bandwidth_for): every link's goodput times `scale`,
    the slowest link's then `mbit` (both None: no bandwidth does). None in async mode."""
    if spec.diloco.mode == "async":
        return None
    scale = bandwidth_for(spec.diloco.h, ph=ph, xs=xs, **kw)
    slowest = min(p.mbit for p in kw["net"].values()) if kw["net"] else 0.0
    return {"h": spec.diloco.h, "scale": scale, "mbit": None if scale is None else slowest * scale}
