"""`dilococtl tune-h`: measure the WAN and the step time, model the sync time, choose H.

Measurement (on the nodes themselves, over SSH, with each node's interpreter):
- links: between the leaders (first host) of every pair of sites, `trainer.probe` (pure stdlib)
  measures RTT (median TCP request/response, idle link) and goodput in both directions, after a
  warm-up of at least 20 RTTs, at the receiver, with as many parallel TCP streams as the exchange
  opens between two sites (`exchange_streams`): on a link whose bandwidth-delay product exceeds the
  hosts' socket buffers (Linux's default 4-6 MB, at 1 Gbit/s and 50 ms and up) each stream is
  capped by its window, so four streams measure up to four times what one gloo connection gets
  (lab, 50 Mbit/s, 80 ms, 128 kB buffers: 7.9 vs 31.6 Mbit/s);
- step time: `trainer.bench_step` on one node of each site, or an earlier run of the same
  model/batch/parallelism from the store (median compute_s / h of its rounds per site);
- payload: `trainer.codec_spec.wire_plan` on the model's parameter shapes (no torch).

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
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import shlex
import statistics
import threading
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dilococtl.errors import BadInput, DilocoError
from dilococtl.spec import RunSpec, SiteSection, is_local, lighthouse_host, nproc_per_node, trainer_config
from trainer.codec_spec import CodecOptions, wire_plan
from trainer.sync_rule import GRID, efficiency, exposed_s
from trainer.sync_rule import min_h as _min_h


def min_h(sync_s: float, step_s: float, budget: float, mode: str = "sync", grid: int = GRID) -> int:
    """trainer.sync_rule.min_h, with bad inputs as BadInput (exit 2)."""
    if not 0 < budget < 1:
        raise BadInput(f"--budget: must be in (0, 1), got {budget:g}")
    try:
        return _min_h(sync_s, step_s, budget, mode, grid)
    except ValueError as e:
        raise BadInput(str(e)) from None
from trainer.config import ModelConfig, resolve_model

DEFAULT_MSS = 1448  # bytes per segment on a 1500-byte MTU path with TCP timestamps
INITIAL_WINDOW = 10  # segments: Linux's initial (and after-idle) congestion window
DEFAULT_MAX_H = 1000
DEFAULT_BUDGET = 0.1
DEFAULT_PORT = 29580  # probe server port (outside the run's lighthouse/base ports by default)
TABLE_H = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000)  # rows of the efficiency table (<= max_h)
# codecs tried, mildest first, when H would exceed the maximum
CANDIDATE_CODECS = ("int8", "powersgd:64", "powersgd:32+int8", "powersgd:16+int8", "topk:0.01+int8",
                    "powersgd:4+int8", "topk:0.001+int8")
MAX_PROBE_STREAMS = 16  # more parallel streams than this measure the link's capacity anyway
BENCH_TIMEOUT_S = 900.0  # importing torch and building a large model on a cold node is slow

Say = Callable[[str], None]


@dataclass(kw_only=True, slots=True)
class ProbeSettings:
    port: int = DEFAULT_PORT  # TCP port the probe server listens on at the receiving leader
    streams: int = 0  # parallel TCP streams per direction; 0: exchange_streams(spec)
    duration_s: float = 5.0  # measured seconds per direction, after the warm-up
    warmup_s: float = 1.0  # least seconds sent before measuring (at least 20 RTTs are used)
    rtt_count: int = 20  # request/response exchanges behind the RTT median
    window_s: float = 15.0  # the client retries connecting this long while the server starts

    def check(self) -> None:
        """Raise BadInput naming the first bad setting."""
        if not 1 <= self.port <= 65535:
            raise BadInput(f"--port: must be in 1..65535, got {self.port}")
        if self.streams < 0:
            raise BadInput(f"--streams: must be >= 0 (0: as many as the exchange opens), got {self.streams}")
        if not self.duration_s > 0:
            raise BadInput(f"--duration: must be > 0 seconds, got {self.duration_s:g}")
        if self.warmup_s < 0:
            raise BadInput(f"--warmup: must be >= 0 seconds, got {self.warmup_s:g}")


@dataclass(kw_only=True, slots=True)
class Link:
    src: str  # sending site
    dst: str  # receiving site
    src_host: str
    dst_host: str
    mbit: float  # goodput measured at the receiver, Mbit/s
    rtt_ms: float  # median TCP request/response round trip between the two leaders
    retrans: int = 0  # segments the sender retransmitted in the measured window
    segs_out: int = 0  # segments the sender sent in that window
    streams: int = 1  # parallel TCP streams the goodput was measured with
    mss: int = DEFAULT_MSS  # the sender's segment size, bytes
    restarts_idle: bool = False  # the sender restarts idle connections in slow start (see cold_send_s)


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


def exchange_streams(spec: RunSpec) -> int:
    """TCP connections a round's exchange opens between two sites, which the probe then measures
    with (at most MAX_PROBE_STREAMS): one gloo connection per exchanging process, one HTTP
    connection in async mode."""
    return min(replicas(spec), MAX_PROBE_STREAMS)


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
           max_h: int = DEFAULT_MAX_H) -> Choice:
    """H for these measurements; see the module docstring for the model."""
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
    h = min_h(br["sync_s"], step_s, budget, mode)
    eff = efficiency(h, step_s, br["sync_s"], mode)
    return Choice(h=h, within_max=h <= max_h, sync_s=br["sync_s"], step_s=step_s, efficiency=eff,
                  sync_share=1 - eff, breakdown=br)


def table(choice: Choice, mode: str, max_h: int, extra: tuple[int, ...] = ()) -> list[dict[str, float]]:
    """Predicted efficiency at a few H (the chosen and `extra` ones included), up to max_h."""
    hs = sorted({h for h in TABLE_H if h <= max_h} | {h for h in (choice.h, *extra) if 0 < h})
    rows = []
    for h in hs:
        if choice.per_site:
            eff = min(efficiency(h, p["step_s"], p["sync_s"], mode) for p in choice.per_site.values())
        else:
            eff = efficiency(h, choice.step_s, choice.sync_s, mode)
        rows.append({"h": h, "efficiency": eff, "sync_share": 1 - eff})
    return rows


# --- measurement ---------------------------------------------------------------------------------

def _py(python: str, module: str, *args: object) -> str:
    return " ".join([shlex.quote(python), "-m", module, *(shlex.quote(str(a)) for a in args)])


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _why(r) -> str:
    out = _last_json(r.stdout)
    if out and "message" in out:
        return out["message"]
    lines = (r.stderr.strip() or r.stdout.strip() or f"exit {r.rc}").splitlines()
    return lines[-1][:300]


def measure_pair(pool, a: SiteSection, b: SiteSection, settings: ProbeSettings) -> tuple[Link, Link]:
    """Probe a's leader <-> b's leader: the server on b, the client on a. Returns (a->b, b->a)."""
    from dilococtl.nodes import node_address, node_python

    ha, hb = a.hosts[0], b.hosts[0]
    src, dst = pool.get(ha), pool.get(hb)
    addr = node_address(hb)
    bind = addr if addr.startswith("127.") else ""  # loopback tests stay on loopback
    token = secrets.token_hex(8)
    per_dir = settings.duration_s + max(settings.warmup_s, 20.0) + 15.0
    accept_s = settings.window_s + 10.0
    total_s = accept_s + 2 * per_dir + 30.0
    got: dict[str, Any] = {}
    done = threading.Event()

    def call(key: str, node, cmd: str) -> None:
        try:
            got[key] = node.run(cmd, timeout=total_s + 30)
        except Exception as e:  # surfaced below
            got[key + "_error"] = e
        done.set()

    server = threading.Thread(target=call, daemon=True, args=("server", dst, _py(
        node_python(b, hb), "trainer.probe", "serve", "--bind", bind, "--port", settings.port, "--token", token,
        "--timeout", total_s, "--accept-timeout", accept_s)))
    client = threading.Thread(target=call, daemon=True, args=("client", src, _py(
        node_python(a, ha), "trainer.probe", "client", "--host", addr, "--port", settings.port, "--token", token,
        "--streams", settings.streams, "--warmup", settings.warmup_s, "--auto-warmup", "--duration",
        settings.duration_s, "--rtt-count", settings.rtt_count, "--window", settings.window_s)))
    server.start()
    client.start()
    # a server that cannot bind ends at once: report that without waiting out the client's retries
    while client.is_alive():
        done.wait(0.2)
        done.clear()
        if not server.is_alive():
            if "server_error" in got:
                raise got["server_error"]
            if got["server"].rc != 0:
                break
    sr = got.get("server")
    if sr is not None and (_last_json(sr.stdout) or {}).get("error") == "busy":
        raise DilocoError(f"{hb} ({b.name}): probe port {settings.port} is already in use "
                          "(choose another with --port)")
    client.join()
    if "client_error" in got:
        raise got["client_error"]
    r = got["client"]
    out = _last_json(r.stdout) if r.rc == 0 else None
    server.join(60 if out is not None else accept_s + 30)
    sr = got.get("server")
    if out is None or "forward" not in out:
        why = _why(r)
        if sr is not None and sr.rc != 0:
            why += f"; server on {hb}: {_why(sr)}"
        raise DilocoError(f"link {a.name} -> {b.name} ({ha} -> {hb}): probe failed: {why}")
    rtt = float(out["rtt_ms"]["median"])

    def link(d: dict, s: SiteSection, t: SiteSection) -> Link:
        return Link(src=s.name, dst=t.name, src_host=s.hosts[0], dst_host=t.hosts[0], mbit=float(d["mbit"]),
                    rtt_ms=rtt, retrans=int(d.get("retrans", 0)), segs_out=int(d.get("segs_out", 0)),
                    streams=int(d.get("streams", settings.streams)), mss=int(d.get("mss") or DEFAULT_MSS),
                    restarts_idle=bool(d.get("restarts_idle")))

    return link(out["forward"], a, b), link(out["reverse"], b, a)


def measure_links(spec: RunSpec, pool, settings: ProbeSettings, say: Say = lambda m: None) -> list[Link]:
    """Both directions between the leaders of every pair of sites, one pair at a time."""
    links: list[Link] = []
    sites = spec.sites
    for i in range(len(sites)):
        for j in range(i + 1, len(sites)):
            say(f"probing {sites[i].name} <-> {sites[j].name} ({sites[i].hosts[0]} <-> {sites[j].hosts[0]})")
            links += measure_pair(pool, sites[i], sites[j], settings)
    return links


def bench_site(spec: RunSpec, pool, index: int, *, steps: int = 10, warmup: int = 3) -> dict:
    """`trainer.bench_step` on the leader of site `index` with the run's model and batch."""
    from dilococtl.nodes import node_python
    from dilococtl.plan import threads_env
    from trainer.config import dump_toml

    site = spec.sites[index]
    host = site.hosts[0]
    node = pool.get(host)
    work = f"{site.work_dir.rstrip('/')}/tune"
    cfg = trainer_config(spec, index, "tune-h", work)
    path = f"{work}/bench-{site.name}.toml"
    node.write_text(path, dump_toml(cfg))
    r = node.run(_py(node_python(site, host), "trainer.bench_step", "--config", path, "--steps", steps,
                     "--warmup", warmup), env=threads_env(site), timeout=BENCH_TIMEOUT_S)
    out = _last_json(r.stdout)
    if r.rc != 0 or not out or "step_s" not in out:
        raise DilocoError(f"{site.name} ({host}): step benchmark failed: {(out or {}).get('error') or _why(r)}")
    return out


def _step_signature(spec: RunSpec) -> str:
    """What decides the inner step time: model, batch, device and the sites' parallelism."""
    return json.dumps({
        "model": dataclasses.asdict(resolve_model(spec.model)),
        "batch": [spec.data.batch_size, spec.data.seq_len],
        "train": [spec.train.device, spec.train.threads, spec.train.bf16],
        "algorithm": spec.diloco.algorithm,
        "sites": sorted((s.name, len(s.hosts), nproc_per_node(s), s.tp, s.pp, s.gpus_per_node) for s in spec.sites),
    }, sort_keys=True)


def step_from_records(store, spec: RunSpec) -> dict | None:
    """Per-site step time (median compute_s / h of its rounds) of the newest recorded run of the
    same model, batch, device and parallelism, or None."""
    want = _step_signature(spec)
    for run in store.list_runs():
        try:
            if _step_signature(run.spec()) != want:
                continue
        except DilocoError:
            continue
        per: dict[str, list[float]] = {}
        for r in store.rounds(run.id):
            if r.h > 0 and r.compute_s > 0:
                per.setdefault(r.site, []).append(r.compute_s / r.h)
        if {s.name for s in spec.sites} <= set(per):
            return {"source": f"run {run.id}", "per_site": {s: statistics.median(v) for s, v in per.items()
                                                            if s in {x.name for x in spec.sites}}}
    return None


def measure_steps(spec: RunSpec, pool, *, source: str = "auto", store=None, say: Say = lambda m: None,
                  bench_steps: int = 10) -> dict:
    """{"source": ..., "per_site": {site: step seconds}} from the records (auto/records) or a benchmark."""
    if source not in ("auto", "bench", "records"):
        raise BadInput(f"--step-source: must be auto, bench or records, got {source!r}")
    if source != "bench" and store is not None:
        got = step_from_records(store, spec)
        if got is not None:
            say(f"step time from {got['source']}")
            return got
    if source == "records":
        raise BadInput(f"{spec.path}: no recorded run with this model, batch and parallelism (use --step-source bench)")
    per, details = {}, {}
    for i, s in enumerate(spec.sites):
        say(f"benchmarking the inner step on {s.name} ({s.hosts[0]})")
        details[s.name] = bench_site(spec, pool, i, steps=bench_steps)
        per[s.name] = float(details[s.name]["step_s"])
    return {"source": "bench", "per_site": per, "bench": details}


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
    suggestion: dict[str, Any] | None = None  # when choice.h > max_h: a codec that brings H under it
    tune_id: int | None = None  # row in the store
    written: bool = False  # H was written into the spec

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
                "sync_s": c.sync_s, "step_s": c.step_s, "compute_s": c.h * c.step_s, "efficiency": c.efficiency,
                "sync_share": c.sync_share, "within_max": c.within_max, "max_h": self.max_h,
                "phases": self.phases, "breakdown": c.breakdown, "per_site": c.per_site, "table": self.table,
                "suggestion": self.suggestion, "step_source": self.steps.get("source"),
                "step_per_site": self.steps.get("per_site")}


def net_of(links: list[Link]) -> Net:
    return {(x.src, x.dst): Path_(mbit=x.mbit, rtt_ms=x.rtt_ms, mss=x.mss, restarts_idle=x.restarts_idle)
            for x in links}


def site_of_host(spec: RunSpec, host: str) -> str | None:
    for s in spec.sites:
        if host in s.hosts or (is_local(host) and any(is_local(h) for h in s.hosts)):
            return s.name
    return None


def plan(spec: RunSpec, links: list[Link], steps: dict[str, Any], *, budget: float = DEFAULT_BUDGET,
         max_h: int = DEFAULT_MAX_H, codec: str | None = None) -> TuneResult:
    """Model the sync time from measurements and choose H (no I/O)."""
    check_limits(budget, max_h)
    codec = spec.diloco.compression if codec is None else codec
    shapes = param_shapes(spec.model)
    ph = phases(codec, shapes, spec.diloco.codec_options())
    sites = [s.name for s in spec.sites]
    kw = dict(mode=spec.diloco.mode, sites=sites, net=net_of(links), step_by_site=steps["per_site"],
              reps=replicas(spec), pull_bytes=4 * sum(math.prod(s) for s in shapes),
              lighthouse_site=site_of_host(spec, lighthouse_host(spec)), budget=budget, max_h=max_h)
    choice = choose(ph=ph, **kw)
    suggestion = None
    if not choice.within_max:
        payload = sum(n for _, n in ph)
        for cand in CANDIDATE_CODECS:
            cph = phases(cand, shapes, spec.diloco.codec_options())
            if sum(n for _, n in cph) >= payload:
                continue
            c = choose(ph=cph, **kw)
            if c.within_max:
                suggestion = {"compression": cand, "h": c.h, "payload_bytes": sum(n for _, n in cph),
                              "sync_s": c.sync_s, "efficiency": c.efficiency}
                break
    return TuneResult(spec_path=str(Path(spec.path).resolve()), mode=spec.diloco.mode, codec=codec, sites=sites,
                      links=links, steps=steps, payload_bytes=sum(n for _, n in ph), phases=ph,
                      replicas=kw["reps"], budget=budget, max_h=max_h, current_h=spec.diloco.h, choice=choice,
                      table=table(choice, spec.diloco.mode, max_h, (spec.diloco.h,)), suggestion=suggestion)


def check_limits(budget: float, max_h: int) -> None:
    if not 0 < budget < 1:
        raise BadInput(f"--budget: must be in (0, 1), got {budget:g}")
    if max_h < GRID:
        raise BadInput(f"--max-h: must be >= {GRID}, got {max_h}")


def tune(spec: RunSpec, *, store, budget: float = DEFAULT_BUDGET, max_h: int = DEFAULT_MAX_H,
         settings: ProbeSettings | None = None, step_source: str = "auto", write: bool = False,
         accept_new: bool = False, say: Say = lambda m: None) -> TuneResult:
    """Measure, choose H, record the tune in the store, and (write=True, H within max_h) write H.

    Bad input and unreachable sites raise before anything is measured or written.
    """
    from dilococtl.errors import Unreachable
    from dilococtl.nodes import NodePool

    settings = settings or ProbeSettings()
    check_limits(budget, max_h)
    settings.check()
    if settings.streams == 0:
        settings = dataclasses.replace(settings, streams=exchange_streams(spec))
    if step_source not in ("auto", "bench", "records"):
        raise BadInput(f"--step-source: must be auto, bench or records, got {step_source!r}")
    with NodePool(spec.ssh, accept_new=accept_new) as pool:
        leaders = list(dict.fromkeys(s.hosts[0] for s in spec.sites))
        say(f"connecting to {len(leaders)} site leader(s)")
        for host, res in pool.map(lambda n: n.host, leaders).items():
            if isinstance(res, Unreachable):
                site = next(s.name for s in spec.sites if s.hosts[0] == host)
                raise Unreachable(f"site {site}: {res}")
            if isinstance(res, Exception):
                raise res
        links = measure_links(spec, pool, settings, say)
        steps = measure_steps(spec, pool, source=step_source, store=store, say=say)
    res = plan(spec, links, steps, budget=budget, max_h=max_h)
    if write and res.choice.within_max:
        write_h(spec.path, res.choice.h)
        res.written = True
    t = store.add_tune(spec_path=res.spec_path, links=[dataclasses.asdict(x) for x in links],
                       step_s=res.choice.step_s, payload_bytes=res.payload_bytes, h=res.choice.h, budget=budget,
                       prediction=res.prediction())
    res.tune_id = t.id
    return res


# --- spec writing and the self-check -------------------------------------------------------------

def write_h(path: str | Path, h: int) -> None:
    """Set diloco.h in the spec file, keeping its comments and layout (tomlkit); atomic."""
    import tomlkit

    from dilococtl.spec import spec_from_dict

    p = Path(path)
    doc = tomlkit.parse(p.read_text())
    if "diloco" not in doc:
        doc["diloco"] = tomlkit.table()
    doc["diloco"]["h"] = int(h)
    text = tomlkit.dumps(doc)
    spec_from_dict(tomllib.loads(text), str(p))  # never leave an invalid spec behind
    tmp = p.with_name(p.name + ".tune-h.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)


def tune_for(store, run):
    """The newest tune of `run`'s spec file made for the H the run uses, or None (reads no rounds)."""
    h = run.spec().diloco.h
    paths = list(dict.fromkeys([run.spec_path, str(Path(run.spec_path).resolve())]))
    tunes = [t for p in paths for t in store.tunes(spec_path=p) if t.h == h]
    return max(tunes, key=lambda x: (x.created, x.id)) if tunes else None


def prediction_for(store, run) -> dict | None:
    """The newest tune of `run`'s spec file made for the H the run uses, beside what the run measured.

    Returns None when no such tune exists. measured_sync_share = sum sync_s / sum (compute_s +
    sync_s) over the run's rounds (None before the first round).
    """
    t = tune_for(store, run)
    if t is None:
        return None
    rounds = store.rounds(run.id)
    comp = sum(r.compute_s for r in rounds)
    sync = sum(r.sync_s for r in rounds)
    p = t.prediction
    return {"tune_id": t.id, "created": t.created, "h": t.h, "budget": t.budget,
            "predicted_sync_share": p.get("sync_share"), "predicted_efficiency": p.get("efficiency"),
            "predicted_sync_s": p.get("sync_s"), "predicted_step_s": p.get("step_s"),
            "measured_sync_share": sync / (comp + sync) if comp + sync > 0 else None,
            "measured_rounds": len(rounds)}
