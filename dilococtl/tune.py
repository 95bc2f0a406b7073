"""`dilococtl tune-h`: measure the WAN and the step time on the nodes, then choose H with the sync model.

Measurement (on the nodes themselves, over SSH, with each node's interpreter):
- links: between the leaders (first host) of every pair of sites, `trainer.probe` (pure stdlib)
  measures RTT (median TCP request/response, idle link) and goodput in both directions, after a
  warm-up of at least 20 RTTs, at the receiver, with as many parallel TCP streams as the exchange
  opens between two sites (`probe_counts`): on a link whose bandwidth-delay product exceeds the
  hosts' socket buffers (Linux's default 4-6 MB, at 1 Gbit/s and 50 ms and up) each stream is
  capped by its window, so four streams measure up to four times what one gloo connection gets
  (lab, 50 Mbit/s, 80 ms, 128 kB buffers: 7.9 vs 31.6 Mbit/s). Gloo opens one connection per
  process; the TLS transport S per process, and the probe also measures one stream alone (what a
  chunk can get: its window). A spec that does not set `diloco.transport_streams` gets S from the
  links: the probe doubles its streams (1, 2, 4, ... MAX_PROBE_STREAMS) until one more doubling
  gains under SWEEP_GAIN, and S is the fewest that carry SWEEP_SHARE of the best goodput on
  every link, about the bandwidth-delay product over one connection's window (`derive_streams`;
  `--write` writes it beside H). A link over which a round moves several bandwidth-delay products
  also gets its own pacing (`derive_link_pace`, written as diloco.transport_link_pace_mbit);
- step time: `trainer.bench_step` on one node of each site, or an earlier run of the same
  model/batch/parallelism from the store (median compute_s / h of its rounds per site);
- payload: `trainer.codec_spec.wire_plan` on the model's parameter shapes (no torch); with
  `diloco.fragments = F`, on each fragment's shapes (trainer.fragments.split): F exchanges a round.

The model of a round's sync (ring collectives, idle restart, quorum, async push/pull) and the
choice of H from it are pure and live in dilococtl/sync_model.py; this module measures their inputs,
records the tune and writes H into the spec.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilococtl.errors import BadInput, DilocoError
from dilococtl.spec import RunSpec, SiteSection, is_local, lighthouse_host, nproc_per_node, trainer_config
from dilococtl.sync_model import (
    CLEAR_CPU_S_PER_GB,
    DEFAULT_BUDGET,
    DEFAULT_MAX_H,
    DEFAULT_MSS,
    GLOO,
    Choice,
    Net,
    Path_,
    Transport,
    bandwidth_for,
    check_limits,
    choose,
    exchanges,
    fragment_payload_bytes,
    lands_at,
    param_shapes,
    replicas,
    table,
    tls_arrivals,
    tls_cold_s,
)
from dilococtl.tune_defaults import DEFAULT_PORT, FEW_ROUNDS  # noqa: F401 - re-exported: tune-h's defaults, one home
from trainer.codec_spec import codec_max_h
from trainer.config import link_key, resolve_model

# codecs tried, mildest first, when H would exceed the maximum
CANDIDATE_CODECS = ("int8", "fp4", "powersgd:64", "powersgd:32+int8", "powersgd:16+int8", "topk:0.01+int8",
                    "sparse:0.01", "powersgd:4+int8", "topk:0.001+int8")
MAX_PROBE_STREAMS = 16  # more parallel streams than this measure the link's capacity anyway
BENCH_TIMEOUT_S = 900.0  # importing torch and building a large model on a cold node is slow
MAX_STREAMS = 256  # --streams: the most an operator may ask for
MAX_PROBE_S = 600.0  # --duration and --warmup: the longest a probe direction may measure or warm up
SWEEP_GAIN = 1.15  # the stream sweep stops once doubling the streams gained less than this
SWEEP_SHARE = 0.9  # derived S: the fewest streams carrying this share of a link's best goodput
PACE_OVER = 1.03  # derived pacing: the streams' total on a link, over its best goodput (derive_link_pace)
PACE_MIN_BDPS = 4  # derived pacing: only a link over which a round moves this many bandwidth-delay products

Say = Callable[[str], None]


@dataclass(kw_only=True, slots=True)
class ProbeSettings:
    port: int = DEFAULT_PORT  # TCP port the probe server listens on at the receiving leader
    streams: int = 0  # parallel TCP streams per direction; 0: exchange_streams(spec)
    duration_s: float = 5.0  # measured seconds per direction, after the warm-up
    warmup_s: float = 1.0  # least seconds sent before measuring (at least 20 RTTs are used)
    rtt_count: int = 20  # request/response exchanges behind the RTT median
    window_s: float = 15.0  # the client retries connecting this long while the server starts
    congestion: str = ""  # the senders' TCP congestion control (measure_links: the TLS exchange's own)

    def check(self) -> None:
        """Raise BadInput naming the first bad setting."""
        if not 1 <= self.port <= 65535:
            raise BadInput(f"--port: must be in 1..65535, got {self.port}")
        if not 0 <= self.streams <= MAX_STREAMS:
            raise BadInput(f"--streams: must be in [0, {MAX_STREAMS}] (0: as many as the exchange opens), "
                           f"got {self.streams}")
        # finite bounds: the probe sleeps and sizes its buffers from these (inf or nan crashed it)
        if not 0 < self.duration_s <= MAX_PROBE_S:
            raise BadInput(f"--duration: must be in (0, {MAX_PROBE_S:g}] seconds, got {self.duration_s:g}")
        if not 0 <= self.warmup_s <= MAX_PROBE_S:
            raise BadInput(f"--warmup: must be in [0, {MAX_PROBE_S:g}] seconds, got {self.warmup_s:g}")


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
    stream_mbit: float = 0.0  # goodput of one stream alone (TLS transport: what one chunk can get; 0: not probed)
    sweep: list[list[float]] = dataclasses.field(default_factory=list)  # [streams, Mbit/s] of every probe, TLS


def transport_of(spec: RunSpec) -> str:
    """The data plane a launched run's exchange uses: "gloo" only when the spec says so (launch gives
    every site an identity, so "auto" is "tls"); async mode pushes over HTTPS, modelled apart."""
    return "gloo" if spec.diloco.transport == "gloo" or spec.diloco.mode == "async" else "tls"


def sets(spec: RunSpec, key: str) -> bool:
    """Whether the spec file sets diloco.KEY (else tune-h may derive it from the links)."""
    try:
        data = tomllib.loads(Path(spec.path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return True  # no file to read (a spec built in code): its value stands
    return key in data.get("diloco", {})


def exchange_streams(spec: RunSpec) -> int:
    """TCP connections a round's exchange opens between two sites, which the probe then measures
    with (at most MAX_PROBE_STREAMS): one gloo connection per exchanging process, one HTTP
    connection in async mode, S per process over the TLS transport (S not set: MAX_PROBE_STREAMS,
    the top of the sweep)."""
    if transport_of(spec) == "gloo":
        return min(replicas(spec), MAX_PROBE_STREAMS)
    if not sets(spec, "transport_streams"):
        return MAX_PROBE_STREAMS
    return min(replicas(spec) * spec.diloco.transport_streams, MAX_PROBE_STREAMS)


def all_on_loopback(spec: RunSpec) -> bool:
    """Every site on this host, and their TLS streams leave TLS after the hello (mesh.py): one lane."""
    return spec.diloco.transport_loopback_clear and all(is_local(h) for s in spec.sites for h in s.hosts)


def probe_counts(spec: RunSpec, streams: int = 0) -> list[int]:
    """The stream counts each link is probed with, in order: the exchange's (gloo); one stream and
    the exchange's (TLS); 1, 2, 4, ... (TLS, S derived: measure_pair_sweep stops early). `streams`
    (--streams, > 0) replaces the exchange's count."""
    if transport_of(spec) == "gloo":
        return [streams or exchange_streams(spec)]
    if all_on_loopback(spec):
        return [streams or 1]
    if streams or sets(spec, "transport_streams"):
        return sorted({1, streams or exchange_streams(spec)})
    return [2 ** i for i in range(int(math.log2(MAX_PROBE_STREAMS)) + 1)]


def agg_mbit(link: Link, streams: int) -> float:
    """A link's goodput with `streams` streams: the probe with the most streams not above that
    (more streams than the sweep went to: the sweep had saturated, its best)."""
    if not link.sweep:
        return link.mbit
    under = [m for n, m in link.sweep if n <= streams]
    return max(under) if under else min(m for _, m in link.sweep)


def best_mbit(link: Link) -> float:
    """The best goodput a link's stream sweep measured (its capacity, as the probe sees it)."""
    return max(m for _, m in link.sweep)


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
        settings.duration_s, "--rtt-count", settings.rtt_count, "--window", settings.window_s,
        "--congestion", settings.congestion)))
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
    return probe_links(out, a, b, settings.streams)


def probe_links(out: dict, a: SiteSection, b: SiteSection, streams: int) -> tuple[Link, Link]:
    """(a->b, b->a) from the probe client's report; a figure that is not a finite number >= 0
    (a broken or lying node) is refused with the link named, before it reaches H, S or pacing."""
    def figure(value: Any, what: str) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            x = math.nan
        if not (math.isfinite(x) and x >= 0):
            raise DilocoError(f"link {a.name} <-> {b.name}: the probe reported {what} = {value!r}, "
                              "not a finite number >= 0")
        return x

    rtt = figure(out["rtt_ms"]["median"], "rtt_ms")

    def link(d: dict, s: SiteSection, t: SiteSection) -> Link:
        return Link(src=s.name, dst=t.name, src_host=s.hosts[0], dst_host=t.hosts[0],
                    mbit=figure(d["mbit"], f"{s.name} -> {t.name} Mbit/s"), rtt_ms=rtt,
                    retrans=int(d.get("retrans", 0)), segs_out=int(d.get("segs_out", 0)),
                    streams=int(d.get("streams", streams)), mss=int(d.get("mss") or DEFAULT_MSS),
                    restarts_idle=bool(d.get("restarts_idle")))

    return link(out["forward"], a, b), link(out["reverse"], b, a)


def measure_pair_sweep(pool, a: SiteSection, b: SiteSection, settings: ProbeSettings, counts: list[int],
                       say: Say = lambda m: None) -> tuple[Link, Link]:
    """measure_pair with each stream count in turn (counts of more than two: a sweep, which stops
    once a doubling gained under SWEEP_GAIN both ways). The links carry the last probe's figures,
    one stream's goodput and every probe's (`sweep`)."""
    got: list[tuple[int, Link, Link]] = []
    for n in counts:
        if len(counts) > 2 or n > 1:
            say(f"  {a.name} <-> {b.name}: {n} stream(s)")
        fwd, rev = measure_pair(pool, a, b, dataclasses.replace(settings, streams=n))
        got.append((n, fwd, rev))
        if len(counts) > 2 and len(got) > 1:
            (_, f0, r0), (_, f1, r1) = got[-2], got[-1]
            if f1.mbit < SWEEP_GAIN * f0.mbit and r1.mbit < SWEEP_GAIN * r0.mbit:
                break
    _, fwd, rev = got[-1]
    for k, x in ((1, fwd), (2, rev)):
        x.sweep = [[g[0], round(g[k].mbit, 3)] for g in got]
        x.stream_mbit = next((g[k].mbit for g in got if g[0] == 1), 0.0)
    return fwd, rev


def measure_links(spec: RunSpec, pool, settings: ProbeSettings, say: Say = lambda m: None) -> list[Link]:
    """Both directions between the leaders of every pair of sites, one pair at a time."""
    links: list[Link] = []
    sites = spec.sites
    counts = probe_counts(spec, settings.streams)
    if transport_of(spec) == "tls":  # its rate, and whether an idle round restarts its window
        settings = dataclasses.replace(settings, congestion=spec.diloco.transport_congestion)
    for i in range(len(sites)):
        for j in range(i + 1, len(sites)):
            say(f"probing {sites[i].name} <-> {sites[j].name} ({sites[i].hosts[0]} <-> {sites[j].hosts[0]})")
            if len(counts) == 1:
                links += measure_pair(pool, sites[i], sites[j], dataclasses.replace(settings, streams=counts[0]))
            else:
                links += measure_pair_sweep(pool, sites[i], sites[j], settings, counts, say)
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
    transport: str = "gloo"  # the data plane modelled: transport_of(spec)
    streams: int = 1  # tls: S modelled, connections per peer and direction
    streams_derived: bool = False  # S came from the links (derive_streams), not from the spec
    pace_mbit: float = 0.0  # tls: the total the S streams to a peer are paced to (0: unpaced) ...
    link_pace: dict[str, float] = dataclasses.field(default_factory=dict)  # ... but on "SRC->DST", its own
    pace_derived: bool = False  # link_pace came from the links (derive_link_pace), not from the spec
    suggestion: dict[str, Any] | None = None  # when choice.h > max_h: a codec that brings H under it
    lands: dict[str, float] = dataclasses.field(default_factory=dict)  # overlap, async: where the update lands
    # at the chosen H when the spec leaves diloco.overlap_land unset (sync_model.lands_at); launch applies it
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
    """The bandwidth the spec's H needs (sync_model.bandwidth_for): every link's goodput times `scale`,
    the slowest link's then `mbit` (both None: no bandwidth does). None in async mode."""
    if spec.diloco.mode == "async":
        return None
    scale = bandwidth_for(spec.diloco.h, ph=ph, xs=xs, **kw)
    slowest = min(p.mbit for p in kw["net"].values()) if kw["net"] else 0.0
    return {"h": spec.diloco.h, "scale": scale, "mbit": None if scale is None else slowest * scale}



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
        write_h(spec.path, res.choice.h, res.streams if res.streams_derived else None,
                res.link_pace if res.pace_derived else None)
        res.written = True
    t = store.add_tune(spec_path=res.spec_path, links=[dataclasses.asdict(x) for x in links],
                       step_s=res.choice.step_s, payload_bytes=res.payload_bytes, h=res.choice.h, budget=budget,
                       prediction=res.prediction())
    res.tune_id = t.id
    return res


# --- spec writing and the self-check -------------------------------------------------------------

def write_h(path: str | Path, h: int, streams: int | None = None, link_pace: dict[str, float] | None = None) -> None:
    """Set diloco.h (and diloco.transport_streams, diloco.transport_link_pace_mbit when given) in the spec
    file, keeping its comments and layout (tomlkit); atomic."""
    import tomlkit

    from dilococtl.spec import spec_from_dict

    p = Path(path)
    doc = tomlkit.parse(p.read_text())
    if "diloco" not in doc:
        doc["diloco"] = tomlkit.table()
    doc["diloco"]["h"] = int(h)
    if streams is not None:
        doc["diloco"]["transport_streams"] = int(streams)
    if link_pace is not None:
        doc["diloco"]["transport_link_pace_mbit"] = {k: float(v) for k, v in link_pace.items()}
    text = tomlkit.dumps(doc)
    spec_from_dict(tomllib.loads(text), str(p))  # never leave an invalid spec behind
    tmp = p.with_name(p.name + ".tune-h.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)


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
    it). The model is tune-h's (`sync_model.tls_arrivals`, on the links of the tune made for the
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
