"""A pure model of one round's sync: what the exchange costs on measured links, and the H it calls for.

No I/O and no nodes: the inputs are measured links (`Path_` per direction), step times and the
payload's wire plan; dilococtl/tune.py measures them and feeds them here. The rule that turns sync
and step time into H is trainer/sync_rule.py, shared with the trainer's h_auto.

Two transports carry the exchange (`diloco.transport`); the model follows the spec's:

TLS transport (trainer/transport, "tls" and "auto", the default of launched runs; `model_tls`):
- S connections per peer and direction (`diloco.transport_streams`), each process of a site its
  own mesh. A tensor's ring block is cut into chunks (trainer/chunk_rule.py: a multiple of S, two
  per stream or more, 64 KiB to 1 MiB) and chunk c goes on stream c mod S. The chunks that leave together,
  one per stream (a "wave"), share the link's rate (per process); a stream has one window in
  flight at most (`Path_.stream_mbit` x RTT: what it carries alone on a window-limited host), so
  a chunk past its window's free part goes at that stream's rate (`_Sender`). Paced streams
  (`transport_pace_mbit`, or their link's own in `transport_link_pace_mbit`: `Path_.pace_mbit`)
  send every byte at their share of it, and lose none to a bottleneck queue they would overrun.
  Lab, 50 Mbit/s, 80 ms, 128 kB buffers (one stream 7.8 Mbit/s), S = 8, the tiny model's 250 kB
  blocks in 64 KiB chunks: each chunk fits one window and the exchange ran 0.26-0.30 s, against
  0.34 s predicted when every chunk was held to its stream's rate.
- the ring is pipelined per chunk with no rendezvous: a member forwards chunk c of ring step r
  as soon as chunk c of step r-1 has arrived, one-way delay (RTT / 2) after its sender finished
  it. `_ring_s` replays that per member and wave over the ring's own edges, so a slow or long
  edge holds back only what waits for it. An all-reduce is 2(K-1) steps of n/K-byte blocks (each
  site sends 2(K-1)/K of the payload), an all-gather K-1 steps of n bytes, a quantized average an
  all-to-all (n/K bytes to every peer directly, on that pair's link) then an all-gather of n/K.
- a round is replayed from the sites' arrivals (`tls_arrivals`): the quorum forms when the last
  request reaches the Lighthouse (the Lighthouse's own site dials it on its host), each site has
  its answer one one-way delay later and starts the weight all-gather then, and each collective
  starts at a member once the previous one ended there. tune-h's round is the longest any site
  waits when it arrives last, well after the others (`tls_last_site`), with that round's parts as
  the breakdown. A far site arriving last waits its RPC but finds the others' rows on their way;
  the Lighthouse's site waits for them in the all-gather. Lab, asymmetric 3 sites, nine runs: 58
  of 63 rounds within 10% of their replay (most within 3%, each part within 10 ms), the rest
  rounds where a stream lost packets (the replay assumes loss-free windows); two sites arriving
  within a request's flight to the Lighthouse make the round longer than either's clean last
  arrival (1.12x of it), which the replay predicts (BENCHMARKS.md, "The TLS transport's model").
- TLS costs CPU: TLS_CPU_S_PER_GB per GB a process sends and receives; a collective takes at least
  that (it only shows on fast links), and TLS_COLLECTIVE_S to hand its jobs to the comm's workers.
  Sites on one host (a local spec) leave TLS after the hello by default
  (diloco.transport_loopback_clear): one stream per direction, CLEAR_CPU_S_PER_GB.
- the mesh is built once per quorum (pg.py's configure, which torchft calls when the quorum id
  changes, not every round): `setup_s`, a TCP and a TLS 1.3 handshake plus the hello, is reported
  in the breakdown but not charged to a steady round.
- idle restart: each active stream's share of the round's bytes as one slow-start flow (below).
- assumed: streams that keep their window between rounds (a loss-based congestion control, the
  transport's default: CUBIC or Reno, trainer.tcp_cc; without slow start after idle, or with it,
  charged below). Lab, asymmetric 3 sites, CUBIC: 17 of 21 rounds within 10% of the prediction,
  medians 0.94-0.99x; on BBR the rounds after the first steady one ran 1.2-1.6x (its estimate of
  the link from app-limited chunks; BENCHMARKS.md). Not modelled:
  the CPU the per-chunk forwarding needs at every hop (Python threads).

Gloo (diloco.transport = "gloo"; `sync_round` with GLOO). Sync-time model (what
`trainer.loop.SiteRun.sync` does per round, see trainer/compression.py):
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

Fragments (diloco.fragments = F, Streaming DiLoCo; trainer/fragments.py): the parameter tensors are dealt
into F fragments of about equal size (trainer.fragments.split, the trainer's own split: whole tensors, so
the largest is a little over 1/F), and a round makes F exchanges, fragment f's after inner step
floor((f+1)H/F), each a whole exchange of its fragment's bytes: its own quorum, weight all-gather,
payload collectives and (3 sites on) digest, blocking compute in sync mode (`round_exchanges`). The
round's sync is their sum, every fixed cost paid F times; the peak bytes of one exchange are the
largest fragment's (`fragment_payload_bytes`), and the connections idle H/F steps between exchanges
(`exchange_idle`), not H. Overlap mode hides the sum behind its landing as it hides one exchange (an
approximation: there each exchange has the steps to the next exchange point to hide behind). Not modelled: a round whose
exchanges are replayed from the sites' arrivals (tune.rounds_against_model) when F > 1.

H is the smallest multiple of 10 with exposed sync <= budget * H * step time (the slowest site's
step in sync and overlap modes); predicted efficiency = H*step / (H*step + exposed sync). A spec
that leaves overlap_land unset gets the landing derived instead (`choose`): H as sync mode's, the
update landing as soon as the exchange is done, nothing exposed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from dilococtl.errors import BadInput
from dilococtl.spec import RunSpec, nproc_per_node
from dilococtl.tune_defaults import DEFAULT_BUDGET, DEFAULT_MAX_H  # noqa: F401 - re-exported: one home
from trainer.chunk_rule import CHUNK_BYTES, MIN_CHUNK_BYTES, chunk_elems
from trainer.codec_spec import CodecOptions, wire_plan
from trainer.config import ModelConfig, resolve_model
from trainer.fragments import offsets, split
from trainer.outer_rule import land_for
from trainer.sync_rule import GRID, efficiency, exposed_s
from trainer.sync_rule import min_h as _min_h

DEFAULT_MSS = 1448  # bytes per segment on a 1500-byte MTU path with TCP timestamps
INITIAL_WINDOW = 10  # segments: Linux's initial (and after-idle) congestion window
RTO_MIN_S = 0.2  # Linux's tcp_rto_min: a steady path's RTO is about RTT + this
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


GUARD_DIGEST_BYTES = 32  # trainer.guard: the SHA-256 of the average every site decoded, gathered from 3 sites on


def phases(codec: str, shapes: list[tuple[int, ...]], opts: CodecOptions | None = None,
           guarded: bool = True, sites: int = 2) -> list[tuple[str, int]]:
    """(collective, bytes) of each exchange one round makes: ("sum"|"qsum"|"gather", nbytes).

    `guarded` (sync and overlap modes): the guard all-gathers every contribution whole, so that each
    site decodes every other site's bytes itself, and from 3 `sites` on gathers a digest of the
    average after it (trainer.guard); else the codec's own collectives."""
    out = [_phase(p, guarded) for p in wire_plan(codec, shapes, opts).phases]
    return out + [("gather", GUARD_DIGEST_BYTES)] if guarded and sites >= 3 else out


def _phase(p, guarded: bool) -> tuple[str, int]:
    # the sparse codec is reduced by shards even under the guard (trainer.sparse_codec): an all-to-all
    # of its records, an all-gather of the owners' merges, modelled as a quantized average of their mean
    if p.op == "ssum":
        return "qsum", (p.nbytes + p.merged + 1) // 2
    return ("gather" if guarded else p.op), p.nbytes


def fragment_shapes(shapes: list[tuple[int, ...]], fragments: int = 1) -> list[list[tuple[int, ...]]]:
    """Each fragment's parameter shapes (diloco.fragments): trainer.fragments.split of their sizes, the
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


def _path(net: Net, a: str, b: str) -> Path_:
    try:
        return net[(a, b)]
    except KeyError:
        raise BadInput(f"no measured link {a} -> {b}") from None


def _quorum_s(sites: list[str], net: Net, lighthouse_site: str | None) -> float:
    """One quorum RPC: the farthest site's round trip to the Lighthouse's site."""
    if lighthouse_site in sites:
        return max(_path(net, s, lighthouse_site).rtt_ms for s in sites if s != lighthouse_site) / 1000.0
    return max(p.rtt_ms for (a, b), p in net.items() if a in sites and b in sites) / 1000.0


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
        return 0.0 if s == lighthouse_site else _path(net, s, lighthouse_site).rtt_ms / 1000.0

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
    edges = [_path(net, a, b) for a, b in ring(sites)]
    quorum = _quorum_s(sites, net, lighthouse_site)
    weight = collective_s("gather", 24, k, edges, reps)
    payload = sum(collective_s(op, n, k, edges, reps) for op, n in ph)
    # a restarted window makes the round's bytes one slow-start flow, whose round trips the steps'
    # own round trips then overlap: the exchange takes the longer of the two
    sent = sum(collective_bytes(op, n, k) for op, n in ph)
    cold = max((cold_send_s(sent, p, reps, idle_s) for p in edges if p.restarts_idle), default=0.0)
    restart = max(0.0, cold - payload)
    return {"quorum_s": quorum, "weight_s": weight, "payload_s": payload, "restart_s": restart,
            "sync_s": quorum + weight + payload + restart}


# --- the TLS transport ---------------------------------------------------------------------------

def chunk_bytes(block: int, t: Transport, itemsize: int = 4) -> int:
    """The chunk the transport cuts a `block`-byte ring block into (trainer/chunk_rule.py)."""
    return chunk_elems(max(1, block // itemsize), itemsize, t.streams, t.chunk_bytes, t.min_chunk_bytes) * itemsize


def waves(block: int, t: Transport) -> list[tuple[int, int, int]]:
    """(bytes, largest chunk, streams) of each wave of a block: the chunks that go out together,
    chunk c on stream c mod S."""
    if block <= 0:
        return []
    ce = chunk_bytes(block, t)
    sizes = [min(ce, block - o) for o in range(0, block, ce)]
    return [(sum(w), max(w), len(w)) for w in (sizes[i:i + t.streams] for i in range(0, len(sizes), t.streams))]


def pace_of(p: Path_, t: Transport) -> float:
    """The total the streams on `p` are paced to (0: unpaced): the link's own, else the transport's."""
    return t.pace_mbit if p.pace_mbit is None else p.pace_mbit


def stream_mbit(p: Path_, t: Transport) -> float:
    """The most one connection carries: alone on the link (its window), or its pacing share."""
    one = p.stream_mbit or p.mbit
    pace = pace_of(p, t)
    return min(one, pace / t.streams) if pace else one


class _Sender:
    """One member's sending on one link, as far as time goes: its streams' windows.

    An unpaced stream holds up to one window in flight: what it carries per round trip alone on the
    link (stream_mbit x RTT). A chunk that fits in the window's free part leaves at the link's rate,
    shared by the wave's streams; past it, at the stream's own rate (a token bucket of one window,
    refilled at that rate; full at the collective's start: the connections kept their windows over
    the round's idle, as the lab's and WAN-tuned hosts do). A paced stream sends every byte at its
    pacing share instead.
    """

    __slots__ = ("link", "one", "paced", "t", "window", "tokens")

    def __init__(self, p: Path_, reps: int, t: Transport):
        self.link = p.mbit * 1e6 / reps  # bit/s of the link this process's streams get together
        self.one = stream_mbit(p, t) * 1e6  # bit/s one stream carries alone (or paced)
        self.paced = bool(pace_of(p, t))
        self.window = 0.0 if self.paced else self.one * p.rtt_ms / 1000.0 / 8.0  # bytes
        self.tokens, self.t = self.window, 0.0

    def send(self, wave: tuple[int, int, int], start: float) -> float:
        """Seconds the wave takes to leave, starting at `start` (no earlier than the last one ended)."""
        total, big, active = wave
        if self.paced:
            return max(total * 8.0 / min(self.link, active * self.one), big * 8.0 / self.one)
        self.tokens = min(self.window, self.tokens + (start - self.t) * self.one / 8.0)
        d = max(total * 8.0 / self.link, max(0.0, big - self.tokens) * 8.0 / self.one)
        self.tokens = max(0.0, self.tokens + d * self.one / 8.0 - big)
        self.t = start + d
        return d


def wave_s(wave: tuple[int, int, int], p: Path_, reps: int, t: Transport) -> float:
    """Seconds a wave takes to leave on a link that `reps` processes share, each with its streams
    (windows full: the first wave of a collective)."""
    return _Sender(p, reps, t).send(wave, 0.0)


def _ring_done(steps: int, block: int, edges: list[Path_], reps: int, t: Transport,
               start: list[float] | None = None) -> list[float]:
    """When each member is done with `steps` pipelined ring steps of `block` bytes; edges[i]
    carries member i -> i+1, and member i starts at start[i] (default: all at 0).

    Member i sends wave j of step r once it sent everything before it and wave j of step r-1 has
    arrived from member i-1 (that member's finish + one-way delay); it is done once it has sent
    and received its last wave."""
    k, ws = len(edges), waves(block, t)
    begin = list(start) if start is not None else [0.0] * k
    if steps <= 0 or not ws:
        return begin
    senders = [_Sender(e, reps, t) for e in edges]
    for sender, b in zip(senders, begin, strict=True):
        sender.t = b  # its window is full when it starts
    owd = [e.rtt_ms / 2000.0 for e in edges]
    free = list(begin)
    arrived: list[list[float]] | None = None
    for _ in range(steps):
        nxt = [[0.0] * len(ws) for _ in range(k)]
        for i in range(k):
            for j, w in enumerate(ws):
                st = max(free[i], arrived[i][j] if arrived else 0.0)
                free[i] = st + senders[i].send(w, st)
                nxt[(i + 1) % k][j] = free[i] + owd[i]
        arrived = nxt
    return [max(free[i], max(arrived[i])) for i in range(k)]


def _ring_s(steps: int, block: int, edges: list[Path_], reps: int, t: Transport) -> float:
    """Seconds of `steps` pipelined ring steps of `block` bytes, every member starting at once."""
    return max(_ring_done(steps, block, edges, reps, t)) if steps > 0 and block > 0 else 0.0


def _alltoall_done(part: int, order: list[str], net: Net, reps: int, t: Transport, start: list[float]) -> list[float]:
    """When each member has every other member's `part` bytes, sent straight on that pair's link."""
    ws = waves(part, t)

    def pair(p: Path_) -> float:
        sender, end = _Sender(p, reps, t), 0.0
        for w in ws:
            end += sender.send(w, end)
        return end + p.rtt_ms / 2000.0

    return [max([start[i]] + [start[j] + pair(_path(net, a, b)) for j, a in enumerate(order) if a != b])
            for i, b in enumerate(order)]


def tls_collective_done(op: str, nbytes: int, order: list[str], net: Net, reps: int, t: Transport,
                        start: list[float] | None = None) -> list[float]:
    """When each member of `order` (rank order) is done with one collective of the TLS transport,
    member i starting it at start[i] (default: all at 0)."""
    k = len(order)
    begin = list(start) if start is not None else [0.0] * k
    if k <= 1:
        return begin
    edges = [_path(net, a, b) for a, b in ring(order)]
    if op == "sum":
        wire = _ring_done(2 * (k - 1), math.ceil(nbytes / k), edges, reps, t, begin)
    elif op == "gather":
        wire = _ring_done(k - 1, nbytes, edges, reps, t, begin)
    elif op == "qsum":  # all-to-all of the shards, then an all-gather of the averaged ones
        part = math.ceil(nbytes / k)
        shards = [x + TLS_COLLECTIVE_S for x in _alltoall_done(part, order, net, reps, t, begin)]
        wire = _ring_done(k - 1, part, edges, reps, t, shards)
    else:
        raise ValueError(f"unknown collective {op!r}")
    cpu = t.cpu_s_per_gb * 2 * collective_bytes(op, nbytes, k) / 1e9  # sent and as much received
    return [max(w, b + cpu) + TLS_COLLECTIVE_S for w, b in zip(wire, begin, strict=True)]


def tls_collective_s(op: str, nbytes: int, order: list[str], net: Net, reps: int, t: Transport) -> float:
    """Seconds of one collective of the TLS transport over the members `order`, all starting at once."""
    return max(tls_collective_done(op, nbytes, order, net, reps, t)) if len(order) > 1 else 0.0


def _lighthouse_owd(sites: list[str], net: Net, lighthouse_site: str | None) -> dict[str, float]:
    """Each site's one-way delay to the Lighthouse (its site's own trainer dials it on its host)."""
    if lighthouse_site in sites:
        return {s: 0.0 if s == lighthouse_site else _path(net, s, lighthouse_site).rtt_ms / 2000.0 for s in sites}
    return {s: _quorum_s(sites, net, None) / 2 for s in sites}  # elsewhere: charged the longest link


def tls_arrivals(ph: list[tuple[str, int]], sites: list[str], net: Net, t: Transport, starts: dict[str, float], *,
                 reps: int = 1, lighthouse_site: str | None = None) -> dict[str, dict[str, float]]:
    """Each site's exchange when site s enters it at starts[s]: its quorum_s, weight_s, payload_s
    and sync_s (their sum), measured from its own start.

    The quorum forms when the last request reaches the Lighthouse; each site has its answer one
    one-way delay later and starts the weight all-gather then, and each collective starts at a
    member once its previous one is done there. So a site far from the Lighthouse that arrives
    last waits its quorum RPC but finds the others' rows on their way, and the Lighthouse's own
    site, arriving last, waits in the all-gather for the rows its answer has yet to reach."""
    order = sorted(sites)
    owd = _lighthouse_owd(order, net, lighthouse_site)
    formed = max(starts[s] + owd[s] for s in order)
    answer = [formed + owd[s] for s in order]
    gathered = tls_collective_done("gather", 24, order, net, reps, t, answer)
    done = gathered
    for op, n in ph:
        done = tls_collective_done(op, n, order, net, reps, t, done)
    out = {}
    for i, s in enumerate(order):
        q, w, p = answer[i] - starts[s], gathered[i] - answer[i], done[i] - gathered[i]
        out[s] = {"quorum_s": q, "weight_s": w, "payload_s": p, "sync_s": q + w + p}
    return out


def tls_last_site(ph: list[tuple[str, int]], sites: list[str], net: Net, t: Transport, *, reps: int = 1,
                  lighthouse_site: str | None = None) -> dict[str, dict[str, float]]:
    """`tls_arrivals` of each site as it waits the round when it arrives last, well after the others."""
    late = 1e3  # seconds: long after the others' requests have reached the Lighthouse
    return {s: tls_arrivals(ph, sites, net, t, {x: late if x == s else 0.0 for x in sites}, reps=reps,
                            lighthouse_site=lighthouse_site)[s] for s in sites}


def tls_cold_s(ph: list[tuple[str, int]], sites: list[str], net: Net, t: Transport, *, reps: int = 1,
               idle_s: float = math.inf) -> float:
    """Seconds a round's bytes take as slow-start flows after `idle_s` of idle, on the slowest ring
    edge whose sender restarts idle connections (0 when none does): each active stream's share of
    the bytes as one flow. The payload then takes the longer of this and its steady time."""
    order = sorted(sites)
    k = len(order)
    edges = [_path(net, a, b) for a, b in ring(order)] if k > 1 else []
    if not any(p.restarts_idle for p in edges):
        return 0.0
    sent = sum(collective_bytes(op, n, k) for op, n in ph)
    active = max((w[2] for op, n in ph for w in waves(math.ceil(n / k) if op != "gather" else n, t)), default=1)
    return max(cold_send_s(sent / active, Path_(mbit=min(stream_mbit(p, t), p.mbit / (reps * active)),
                                                rtt_ms=p.rtt_ms, mss=p.mss), 1, idle_s)
               for p in edges if p.restarts_idle)


def tls_round(ph: list[tuple[str, int]], sites: list[str], net: Net, t: Transport, *, reps: int = 1,
              lighthouse_site: str | None = None, idle_s: float = math.inf) -> dict[str, float]:
    """Seconds one synchronous round spends in the exchange over the TLS transport (module docstring):
    the longest round any site waits when it arrives last (`tls_last_site`), and its parts."""
    order = sorted(sites)
    k = len(order)
    zero = {"quorum_s": 0.0, "weight_s": 0.0, "payload_s": 0.0, "restart_s": 0.0, "cpu_s": 0.0, "setup_s": 0.0,
            "sync_s": 0.0}
    if k <= 1:
        return zero
    per = tls_last_site(ph, order, net, t, reps=reps, lighthouse_site=lighthouse_site)
    worst = per[max(order, key=lambda s: (per[s]["sync_s"], s))]
    payload = worst["payload_s"]
    cpu = t.cpu_s_per_gb * 2 * sum(collective_bytes(op, n, k) for op, n in ph) / 1e9
    restart = max(0.0, tls_cold_s(ph, order, net, t, reps=reps, idle_s=idle_s) - payload)
    # a new quorum's mesh: TCP connect (1 RTT), TLS 1.3 handshake (1 RTT), hello (1/2), on the longest pair
    setup = 2.5 * max(_path(net, a, b).rtt_ms for a in order for b in order if a != b) / 1000.0
    return {"quorum_s": worst["quorum_s"], "weight_s": worst["weight_s"], "payload_s": payload, "restart_s": restart,
            "cpu_s": cpu, "setup_s": setup, "sync_s": worst["sync_s"] + restart}


def async_round(payload_bytes: int, pull_bytes: int, site: str, service_site: str, net: Net, *,
                reps: int = 1) -> float:
    """Seconds site `site` spends pushing its payload to and pulling θ from the outer service."""
    if site == service_site:
        return 0.0
    up, down = _path(net, site, service_site), _path(net, service_site, site)
    # one request: θ comes back in the push's answer, so the pull pays no round trip of its own
    return _send_s(payload_bytes, up, reps) + _send_s(pull_bytes, down, reps) - down.rtt_ms / 1000.0


def _send_s(nbytes: int, p: Path_, reps: int) -> float:
    steady = _steady_s(nbytes, p, reps)
    return p.rtt_ms / 1000.0 + (max(steady, cold_send_s(nbytes, p, reps)) if p.restarts_idle else steady)


# --- a round of several exchanges (diloco.fragments) ----------------------------------------------

MAX_SCALE = 1e4  # bandwidth_for: links at most this many times their measured goodput


def exchange_idle(h: int, n: int, step_s: float) -> list[float]:
    """Seconds the connections idle before each of a round's `n` exchanges: the inner steps since the
    one before (trainer.fragments.offsets; the first's since the last of the round before). One: H."""
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
    switched to another (launch: tune.tuned_land)."""
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
