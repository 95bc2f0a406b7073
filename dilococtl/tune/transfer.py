"""What a round puts on the wire and how long bytes take on a measured path: the model's inputs.

Pure (no I/O, no nodes): measured links (`Path_` per direction, measure.py fills them), the payload's
phases (`trainer.rules.codec_spec.wire_plan` on the model's shapes, per fragment) and the transport
(`Transport`: gloo, or the TLS transport with its streams and pacing). model.py builds a round from
these; tls_model.py replays the TLS transport's.

Gloo (diloco.transport = "gloo"; `sync_round` with GLOO). Sync-time model (what
`trainer.modes.loop.SiteRun.sync` does per round, see trainer/codecs/compression.py):
- torchft ranks the sites by replica id (the site name), and gloo runs its collectives as a ring
  in rank order: site[0] -> site[1] -> ... -> site[0] over the names sorted. A ring step moves a
  message to the next site; all sites step together, so a step of b bytes takes
  max over ring edges e of (RTT_e + b * replicas * 8 / bandwidth_e).
  Latency model: a whole round trip per ring step: gloo sends only once the receiver has told it
  that its receive is posted (measured in the lab: a 24-byte all-gather between two sites took
  42-44 ms at 40 ms RTT; see BENCHMARKS.md, "tune-h against the run it tuned").
- an all-reduce ("sum": codec "none" and PowerSGD without a quantizer) of n bytes over K sites is
  2(K-1) steps of n/K bytes; so is a quantized average ("qsum": int8, fp8, fp4, PowerSGD+any: an
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
  Each RTO of idle (about RTT + 200 ms) halves the window, from the link's bandwidth-delay
  product down to 10 segments (`restart_window`): H is sized for a window restarted from 10
  segments, and the round at that H is then predicted with the window its compute leaves (lab,
  Reno, 50 Mbit/s, 80 ms, TLS, 0.7 s of compute, 2-3 RTOs: 0.30 s measured, 0.54 s predicted
  from 10 segments). BBR paces from its bandwidth estimate instead and is exempt. The
  probe's streams are warm: it measures the steady rate. Lab, 50 Mbit/s, 80 ms, H = 400 (5 s of
  compute): exchange 0.58 s (Reno) / 0.64 s (CUBIC) restarting, 0.40-0.42 s not (or with BBR);
  predicted 0.57 / 0.41; 500 kB on an idle Reno connection took 0.42 s to deliver, the flow 0.41 s.
- per round also: one quorum RPC to the Lighthouse (the farthest site's RTT to the Lighthouse's
  site: with every member back, it answers at once rather than on its tick) and the all-gather
  of each site's participation weight and timings (24 bytes, K-1 steps). That is the round of
  the farthest site arriving last; `last_site_s` gives the round whichever site arrives last: its
  request's half RTT to the Lighthouse, then the farthest member's half RTT for the answer (the
  TLS transport replays it instead, above).
- replicas: every trainer process of a site holds the full model and exchanges it with the same
  local rank of the other sites, over the same WAN: the bytes are multiplied by the processes
  per site (the largest site's count); in async mode the site's leader alone pushes and pulls.
- overlap mode: the exchange hides behind the next round's compute up to the update's landing
  (diloco.overlap_land, a fraction of H); only max(0, sync - land * H * step) is exposed.
- async mode: each site pushes its payload to, and pulls the fp32 parameters (4 bytes per
  parameter) from, an outer service assumed beside the Lighthouse: one request (its answer brings θ
  back), so 1 RTT plus both transfers, hidden like overlap's behind the next round until it lands
  on that site's link; sites run at their own pace, so each site gets its own H and the largest
  is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dilococtl.errors import BadInput
from dilococtl.spec_sites import nproc_per_node
from dilococtl.spec_types import RunSpec
from trainer.rules.chunk_rule import CHUNK_BYTES, MIN_CHUNK_BYTES
from trainer.rules.codec_spec import CodecOptions, wire_plan
from trainer.rules.fragments import split
from trainer.rules.model_config import ModelConfig, resolve_model

DEFAULT_MSS = 1448  # bytes per segment on a 1500-byte MTU path with TCP timestamps


INITIAL_WINDOW = 10  # segments: Linux's initial (and after-idle) congestion window


RTO_MIN_S = 0.2  # Linux's tcp_rto_min: a steady path's RTO is about RTT + this





@dataclass(frozen=True, slots=True)
class Path_:
    """What the model needs of one direction of a link."""

    mbit: float  # goodput with the exchange's connections (all processes' streams at once)
    rtt_ms: float
    mss: int = DEFAULT_MSS
    restarts_idle: bool = False
    stream_mbit: float = 0.0  # goodput of one connection alone (0: not measured, taken as mbit)
    pace_mbit: float | None = None  # tls: this direction's streams paced to this total per process (0:


    # unpaced; None: the transport's pace_mbit), diloco.transport_link_pace_mbit


# CPU seconds per GB a process sends + receives over TLS (AES-GCM both ways, 16 kB reads, a thread
# per stream and direction): bench/transport.py on loopback, this 2-core machine, 16 / 64 MiB:
# 0.87 / 0.72 (BENCHMARKS.md, "Loopback: no link, only CPU": 0.73 / 0.68)
TLS_CPU_S_PER_GB = 0.8


# loopback streams that left TLS: the copy and the per-chunk forwarding only (bench/transport.py
# --arms clear, 16 / 64 MiB: 0.22-0.26 with S = 4, 0.26-0.35 with S = 1)
CLEAR_CPU_S_PER_GB = 0.3


TLS_COLLECTIVE_S = 0.0007  # handing a collective's jobs to the comm's workers and back (loopback, 1 KiB)




@dataclass(frozen=True, slots=True)
class Transport:
    """The cross-site data plane the exchange runs over, as far as its time goes."""

    kind: str = "gloo"  # "gloo": torchft's ProcessGroupGloo; "tls": trainer.transport
    streams: int = 1  # tls: S, connections per peer and direction (diloco.transport_streams)
    pace_mbit: float = 0.0  # tls: the S streams to a peer paced to this total (diloco.transport_pace_mbit)
    link_pace: dict[str, float] = field(default_factory=dict)  # tls: "SRC->DST" -> its own pace, over
    # pace_mbit (diloco.transport_link_pace_mbit); net_of puts each on its link's Path_
    chunk_bytes: int = CHUNK_BYTES
    min_chunk_bytes: int = MIN_CHUNK_BYTES
    cpu_s_per_gb: float = TLS_CPU_S_PER_GB




GLOO = Transport()




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




GUARD_DIGEST_BYTES = 32  # trainer.outer.guard: the SHA-256 of the average every site decoded, gathered from 3 sites on




def phases(codec: str, shapes: list[tuple[int, ...]], opts: CodecOptions | None = None,
           guarded: bool = True, sites: int = 2) -> list[tuple[str, int]]:
    """(collective, bytes) of each exchange one round makes: ("sum"|"qsum"|"gather", nbytes).

    `guarded` (sync and overlap modes): the guard all-gathers every contribution whole, so that each
    site decodes every other site's bytes itself, and from 3 `sites` on gathers a digest of the
    average after it (trainer.outer.guard); else the codec's own collectives."""
    out = [_phase(p, guarded) for p in wire_plan(codec, shapes, opts).phases]
    return out + [("gather", GUARD_DIGEST_BYTES)] if guarded and sites >= 3 else out




def _phase(p, guarded: bool) -> tuple[str, int]:
    # the sparse codec is reduced by shards even under the guard (trainer.codecs.sparse_codec): an all-to-all
    # of its records, an all-gather of the owners' merges, modelled as a quantized average of their mean
    if p.op == "ssum":
        return "qsum", (p.nbytes + p.merged + 1) // 2
    return ("gather" if guarded else p.op), p.nbytes




def fragment_shapes(shapes: list[tuple[int, ...]], fragments: int = 1) -> list[list[tuple[int, ...]]]:
    """Each fragment's parameter shapes (diloco.fragments): trainer.rules.fragments.split of their sizes, the
    trainer's own cut, so that each exchange's bytes are what the trainer sends."""
    try:
        cut = split([math.prod(s) for s in shapes], fragments)
    except ValueError as e:
        raise BadInput(f"diloco.fragments: {e}") from None
    return [[shapes[i] for i in r] for r in cut]




def exchanges(codec: str, shapes: list[tuple[int, ...]], opts: CodecOptions | None = None, guarded: bool = True,
              sites: int = 2, fragments: int = 1) -> list[list[tuple[str, int]]]:
    """`phases` of each exchange a round makes: one per fragment, of that fragment's shapes (each guarded
    and digested on its own, as the trainer exchanges it). One fragment: the round's one exchange."""
    return [phases(codec, fs, opts, guarded, sites) for fs in fragment_shapes(shapes, fragments)]




def fragment_payload_bytes(codec: str, shapes: list[tuple[int, ...]], opts: CodecOptions | None = None,
                           fragments: int = 1) -> list[int]:
    """Bytes a process hands to the comm in each exchange of a round (the trainer's
    `fragment_payload_bytes`: each fragment's wire plan); the largest is the peak of one exchange."""
    return [wire_plan(codec, fs, opts).payload_bytes for fs in fragment_shapes(shapes, fragments)]




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




def restart_window(p: Path_, bdp: float, idle_s: float = math.inf) -> float:
    """Bytes a connection's window holds after `idle_s` idle: Linux halves it once per RTO idled
    (RTO ~ RTT + RTO_MIN_S on a steady path), from the link's bandwidth-delay product (where the
    last round's flow left it), down to INITIAL_WINDOW segments."""
    iw = INITIAL_WINDOW * p.mss
    if not math.isfinite(idle_s):
        return iw
    halvings = int(idle_s / (p.rtt_ms / 1000.0 + RTO_MIN_S))
    return max(iw, min(bdp, bdp / 2.0 ** min(halvings, 60)))




def cold_send_s(nbytes: float, p: Path_, reps: int = 1, idle_s: float = math.inf) -> float:
    """Seconds to put nbytes through a connection whose window restarted after `idle_s` idle
    (restart_window; INITIAL_WINDOW segments after a long idle); `reps` connections share the
    link's measured rate."""
    rate = p.mbit * 1e6 / reps  # bit/s per connection
    rtt = p.rtt_ms / 1000.0
    bdp = max(rate * rtt / 8.0, INITIAL_WINDOW * p.mss)
    w0 = restart_window(p, bdp, idle_s)
    if w0 >= bdp:
        return nbytes * 8.0 / rate
    # the window doubles every round trip: after t round trips w0 * (2^t - 1) bytes are out, until
    # the window holds the link (t = log2(bdp / w0), bdp - w0 bytes out); the rest goes at the rate
    if nbytes <= bdp - w0:
        return rtt * math.log2(nbytes / w0 + 1)
    return rtt * math.log2(bdp / w0) + (nbytes - (bdp - w0)) * 8.0 / rate




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




def link_path(net: Net, a: str, b: str) -> Path_:
    try:
        return net[(a, b)]
    except KeyError:
        raise BadInput(f"no measured link {a} -> {b}") from None




def quorum_rpc_s(sites: list[str], net: Net, lighthouse_site: str | None) -> float:
    """One quorum RPC: the farthest site's round trip to the Lighthouse's site."""
    if lighthouse_site in sites:
        return max(link_path(net, s, lighthouse_site).rtt_ms for s in sites if s != lighthouse_site) / 1000.0
    return max(p.rtt_ms for (a, b), p in net.items() if a in sites and b in sites) / 1000.0




def transfer_s(nbytes: int, p: Path_, reps: int) -> float:
    steady = _steady_s(nbytes, p, reps)
    return p.rtt_ms / 1000.0 + (max(steady, cold_send_s(nbytes, p, reps)) if p.restarts_idle else steady)
