"""What tune-h measures on the nodes, over SSH, with each node's interpreter: the links and the step time.

- links: between the leaders (first host) of every pair of sites, `trainer.probes.probe` (pure stdlib)
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
- step time: `trainer.probes.bench_step` on one node of each site, or an earlier run of the same
  model/batch/parallelism from the store (median compute_s / h of its rounds per site);
- payload: `trainer.rules.codec_spec.wire_plan` on the model's parameter shapes (no torch); with
  `diloco.fragments = F`, on each fragment's shapes (trainer.rules.fragments.split): F exchanges a round.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
from dilococtl.spec_sites import is_local, nproc_per_node, trainer_config
from dilococtl.spec_types import RunSpec, SiteSection
from dilococtl.tune.defaults import DEFAULT_PORT
from dilococtl.tune.transfer import DEFAULT_MSS, replicas
from trainer.rules.model_config import resolve_model

MAX_PROBE_STREAMS = 16  # more parallel streams than this measure the link's capacity anyway


BENCH_TIMEOUT_S = 900.0  # importing torch and building a large model on a cold node is slow


MAX_STREAMS = 256  # --streams: the most an operator may ask for


MAX_PROBE_S = 600.0  # --duration and --warmup: the longest a probe direction may measure or warm up


SWEEP_GAIN = 1.15  # the stream sweep stops once doubling the streams gained less than this



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
        node_python(b, hb), "trainer.probes.probe", "serve", "--bind", bind, "--port", settings.port, "--token", token,
        "--timeout", total_s, "--accept-timeout", accept_s)))
    client = threading.Thread(target=call, daemon=True, args=("client", src, _py(
        node_python(a, ha), "trainer.probes.probe", "client", "--host", addr, "--port", settings.port, "--token", token,
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
    """`trainer.probes.bench_step` on the leader of site `index` with the run's model and batch."""
    from dilococtl.nodes import node_python
    from dilococtl.plan import threads_env
    from trainer.rules.config import dump_toml

    site = spec.sites[index]
    host = site.hosts[0]
    node = pool.get(host)
    work = f"{site.work_dir.rstrip('/')}/tune"
    cfg = trainer_config(spec, index, "tune-h", work)
    path = f"{work}/bench-{site.name}.toml"
    node.write_text(path, dump_toml(cfg))
    r = node.run(_py(node_python(site, host), "trainer.probes.bench_step", "--config", path, "--steps", steps,
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
