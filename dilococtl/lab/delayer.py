"""The lab's latency: an NFQUEUE daemon that holds each queued packet for its link's one-way delay.

This kernel has no netem, so delay is added in user space. Every ordered site pair has its own
queue number in the core namespace's FORWARD chain; a queue's delay is constant, so its packets
leave in arrival order and one batch verdict ("accept every id up to N") releases all that are
due. The daemon speaks nfnetlink_queue directly over an AF_NETLINK socket (stdlib only):

- copy mode META: the payload is never copied to user space;
- the GSO flag: super packets are queued whole (tbf segments them afterwards): few messages;
- a 32 MiB receive buffer (SO_RCVBUFFORCE) and a 64k-packet queue; without fail-open, an
  overflow drops the packet (TCP resends it) instead of letting it bypass the delay, and the
  overflow is counted in the stats file.

Run as `python -m dilococtl.lab.delayer CONFIG STATS` inside the core namespace. CONFIG is JSON
{"<queue>": delay_ms}; SIGHUP re-reads it (`lab shape`). STATS is rewritten about once a second.
SIGTERM: accept everything held, then exit.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from pathlib import Path

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NF_ACCEPT = 1

RCVBUF_BYTES = 32 << 20  # netlink receive buffer: bursts wait here, not in a dropped message
QUEUE_MAXLEN = 65536  # packets the kernel holds per queue awaiting a verdict
RT_PRIORITY = 10  # SCHED_RR priority: above every normal process, below kernel RT threads
_HDR = struct.Struct("=IHHII")  # nlmsghdr
_PACKET = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def message(msg: int, queue: int, attrs: list[bytes], seq: int = 0, flags: int = NLM_F_REQUEST) -> bytes:
    """One nfnetlink_queue request: nlmsghdr + nfgenmsg (family, version 0, queue big-endian) + attrs."""
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", queue) + b"".join(attrs)
    return _HDR.pack(_HDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


def bind_messages(queue: int, seq: int) -> list[bytes]:
    """Bind `queue`, copy metadata only, allow a long queue, take GSO packets whole."""
    return [
        message(NFQNL_MSG_CONFIG, queue, [_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND,
                                                                          socket.AF_INET))], seq, NLM_F_REQUEST | NLM_F_ACK),
        message(NFQNL_MSG_CONFIG, queue, [_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))],
                seq + 1, NLM_F_REQUEST | NLM_F_ACK),
        message(NFQNL_MSG_CONFIG, queue, [_attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))],
                seq + 2, NLM_F_REQUEST | NLM_F_ACK),
        message(NFQNL_MSG_CONFIG, queue, [_attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)),
                                          _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))],
                seq + 3, NLM_F_REQUEST | NLM_F_ACK),
    ]


def verdict_batch(queue: int, max_id: int, verdict: int = NF_ACCEPT) -> bytes:
    """Verdict for every packet of `queue` with an id up to `max_id` (in queue order)."""
    return message(NFQNL_MSG_VERDICT_BATCH, queue, [_attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, max_id))])


def parse(buf: bytes | bytearray | memoryview, n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Split `n` received bytes into (queue, packet id) pairs and (seq, errno) of error/ack messages."""
    packets: list[tuple[int, int]] = []
    acks: list[tuple[int, int]] = []
    off = 0
    while off + _HDR.size <= n:
        length, kind, _flags, seq, _pid = _HDR.unpack_from(buf, off)
        if length < _HDR.size or off + length > n:
            break
        if kind == _PACKET:
            queue = struct.unpack_from("!H", buf, off + 18)[0]
            a, end = off + 20, off + length
            while a + 4 <= end:
                alen, akind = struct.unpack_from("=HH", buf, a)
                if alen < 4:
                    break
                if akind & 0x3FFF == NFQA_PACKET_HDR:
                    packets.append((queue, struct.unpack_from("!I", buf, a + 4)[0]))
                    break
                a += (alen + 3) & ~3
        elif kind == NLMSG_ERROR:
            acks.append((seq, -struct.unpack_from("=i", buf, off + 16)[0]))
        off += (length + 3) & ~3
    return packets, acks


class Delayer:
    """Holds packets per queue and releases them when due; one socket, one thread."""

    def __init__(self, delays_ms: dict[int, float]) -> None:
        self.delays = dict(delays_ms)
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, RCVBUF_BYTES)  # SO_RCVBUFFORCE: above rmem_max
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        self.sock.bind((0, 0))
        self.buf = bytearray(1 << 20)
        self.held: dict[int, collections.deque[tuple[float, int]]] = {q: collections.deque() for q in self.delays}
        self.stats: dict[str, int | str] = {"queued": 0, "released": 0, "overflows": 0, "errors": 0, "held_max": 0}
        seq = 1
        for q in self.delays:
            for msg in bind_messages(q, seq):
                self.sock.send(msg)
                self._await_ack(seq)
                seq += 1
        self.sock.setblocking(False)

    def _await_ack(self, seq: int) -> None:
        while True:
            n = self.sock.recv_into(self.buf)
            _, acks = parse(self.buf, n)
            for s, err in acks:
                if s == seq:
                    if err:
                        raise OSError(err, f"nfqueue config: {os.strerror(err)}")
                    return

    def set_delays(self, delays_ms: dict[int, float]) -> None:
        for q, d in delays_ms.items():
            if q in self.delays:
                self.delays[q] = d

    def drain(self) -> None:
        """Read every pending message; stamp each packet with its due time."""
        now = time.monotonic()
        while True:
            try:
                n = self.sock.recv_into(self.buf)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # messages were lost: those packets were dropped, not passed
                    self.stats["overflows"] += 1
                    continue
                raise
            packets, acks = parse(self.buf, n)
            self.stats["errors"] += sum(1 for _, err in acks if err)
            for q, pid in packets:
                held = self.held.get(q)
                if held is None:  # a queue we did not bind cannot reach us; keep it harmless
                    self.sock.send(verdict_batch(q, pid))
                    continue
                held.append((now + self.delays[q] / 1000.0, pid))
            self.stats["queued"] += len(packets)

    def release(self, now: float, everything: bool = False) -> float | None:
        """Accept what is due (or all); returns the next due time, None when nothing is held."""
        nxt = None
        total = 0
        for q, held in self.held.items():
            last = None
            while held and (everything or held[0][0] <= now):
                last = held.popleft()[1]
                self.stats["released"] += 1
            if last is not None:
                try:
                    self.sock.send(verdict_batch(q, last))
                except BlockingIOError:
                    self.sock.setblocking(True)
                    self.sock.send(verdict_batch(q, last))
                    self.sock.setblocking(False)
            if held:
                nxt = held[0][0] if nxt is None else min(nxt, held[0][0])
            total += len(held)
        self.stats["held_max"] = max(self.stats["held_max"], total)
        return nxt


def _read_config(path: Path) -> dict[int, float]:
    return {int(q): float(d) for q, d in json.loads(path.read_text()).items()}


def _write_stats(path: Path, d: Delayer, ready: bool) -> None:
    data = {"pid": os.getpid(), "ready": ready, "time": time.time(), "delays_ms": d.delays,
            "held": sum(len(h) for h in d.held.values()), **d.stats}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    tmp.replace(path)


def _prioritise() -> str:
    """Real-time round-robin: training on the nodes saturates the CPUs, and a descheduled delayer
    adds its wait to every held packet. The loop is event driven (a few % of a core), and the
    kernel's RT throttling still bounds it."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(RT_PRIORITY))
        return "rr"
    except (OSError, AttributeError):
        return "other"


def serve(config: Path, stats: Path) -> None:
    """The daemon's loop (see the module docstring)."""
    sched = _prioritise()
    d = Delayer(_read_config(config))
    d.stats["sched"] = sched
    flags = {"hup": False, "term": False}
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    signal.signal(signal.SIGHUP, lambda *_: flags.__setitem__("hup", True))
    signal.signal(signal.SIGTERM, lambda *_: flags.__setitem__("term", True))
    signal.signal(signal.SIGINT, lambda *_: flags.__setitem__("term", True))
    ep = select.epoll()
    ep.register(d.sock.fileno(), select.EPOLLIN)
    ep.register(r, select.EPOLLIN)
    _write_stats(stats, d, ready=True)
    last_stats = time.monotonic()
    nxt: float | None = None
    while not flags["term"]:
        now = time.monotonic()
        timeout = 1.0 if nxt is None else max(0.0, min(1.0, nxt - now))
        for fd, _ in ep.poll(timeout):
            if fd == r:
                try:
                    os.read(r, 512)
                except BlockingIOError:
                    pass
            else:
                d.drain()
        if flags["hup"]:
            flags["hup"] = False
            try:
                d.set_delays(_read_config(config))
            except (OSError, ValueError) as e:
                print(f"delayer: keeping the old delays, cannot read {config}: {e}", file=sys.stderr)
        now = time.monotonic()
        nxt = d.release(now)
        if now - last_stats >= 1.0:
            _write_stats(stats, d, ready=True)
            last_stats = now
    d.release(time.monotonic(), everything=True)
    _write_stats(stats, d, ready=False)
    d.sock.close()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m dilococtl.lab.delayer CONFIG.json STATS.json", file=sys.stderr)
        return 2
    serve(Path(argv[0]), Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
