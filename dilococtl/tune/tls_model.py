"""The TLS transport's round (trainer/transport, "tls" and "auto", the default of launched runs),
replayed per chunk, stream and ring member from the sites' arrivals:

TLS transport (trainer/transport, "tls" and "auto", the default of launched runs; `model_tls`):
- S connections per peer and direction (`diloco.transport_streams`), each process of a site its
  own mesh. A tensor's ring block is cut into chunks (trainer/rules/chunk_rule.py: a multiple of S, two
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
  transport's default: CUBIC or Reno, trainer.transport.tcp_cc; without slow start after idle, or with it,
  charged below). Lab, asymmetric 3 sites, CUBIC: 17 of 21 rounds within 10% of the prediction,
  medians 0.94-0.99x; on BBR the rounds after the first steady one ran 1.2-1.6x (its estimate of
  the link from app-limited chunks; BENCHMARKS.md). Not modelled:
  the CPU the per-chunk forwarding needs at every hop (Python threads).
"""

from __future__ import annotations

import math

from dilococtl.tune.transfer import (
    TLS_COLLECTIVE_S,
    Net,
    Path_,
    Transport,
    cold_send_s,
    collective_bytes,
    link_path,
    quorum_rpc_s,
    ring,
)
from trainer.rules.chunk_rule import chunk_elems

# --- the TLS transport ---------------------------------------------------------------------------

def chunk_bytes(block: int, t: Transport, itemsize: int = 4) -> int:
    """The chunk the transport cuts a `block`-byte ring block into (trainer/rules/chunk_rule.py)."""
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

    return [max([start[i]] + [start[j] + pair(link_path(net, a, b)) for j, a in enumerate(order) if a != b])
            for i, b in enumerate(order)]




def tls_collective_done(op: str, nbytes: int, order: list[str], net: Net, reps: int, t: Transport,
                        start: list[float] | None = None) -> list[float]:
    """When each member of `order` (rank order) is done with one collective of the TLS transport,
    member i starting it at start[i] (default: all at 0)."""
    k = len(order)
    begin = list(start) if start is not None else [0.0] * k
    if k <= 1:
        return begin
    edges = [link_path(net, a, b) for a, b in ring(order)]
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
        return {s: 0.0 if s == lighthouse_site else link_path(net, s, lighthouse_site).rtt_ms / 2000.0 for s in sites}
    return {s: quorum_rpc_s(sites, net, None) / 2 for s in sites}  # elsewhere: charged the longest link




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
    edges = [link_path(net, a, b) for a, b in ring(order)] if k > 1 else []
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
    setup = 2.5 * max(link_path(net, a, b).rtt_ms for a in order for b in order if a != b) / 1000.0
    return {"quorum_s": worst["quorum_s"], "weight_s": worst["weight_s"], "payload_s": payload, "restart_s": restart,
            "cpu_s": cpu, "setup_s": setup, "sync_s": worst["sync_s"] + restart}
