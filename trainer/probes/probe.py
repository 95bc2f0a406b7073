"""WAN link probe between two nodes: TCP throughput both ways, round-trip time, retransmits.

Pure stdlib, so `dilococtl tune-h` can start it over SSH with the node's own interpreter on any
node that has the trainer package (no torch import):

    python -m trainer.probes.probe serve  --port P --token T [--bind ADDR] [--timeout S]   # on node B
    python -m trainer.probes.probe client --host B --port P --token T [--streams 4] ...    # on node A

The client prints one JSON line: `rtt_ms` (median/min/max of TCP request/response exchanges of
64 bytes on an idle link, TCP_NODELAY), `forward` (A -> B, measured by B) and `reverse` (B -> A,
measured by A). Throughput runs `streams` parallel TCP connections, sends for `warmup` seconds
(slow start, queue build-up) and then measures for `duration` seconds at the RECEIVER from the
kernel's per-socket `tcpi_bytes_received`: bytes the kernel got in order, whether or not this
process has read them yet, so a descheduled reader cannot distort the figure. Retransmits come
from the sender's TCP_INFO (`tcpi_total_retrans`, `tcpi_segs_out`) over the same window.
Without TCP_INFO (not Linux) the figures fall back to bytes read by the process.

The server serves one client (it checks the token, so a stranger on the port is not taken for
it) and exits; a port in use makes `serve` print {"error": "busy", ...} and exit 3.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import threading
import time

from trainer.transport import tcp_cc

HELLO_LEN = 64  # fixed-size greeting on data connections: the data that follows is never consumed by it
CHUNK = 1 << 16  # bytes per send call
EXIT_BUSY = 3  # `serve`: the port is in use
EXIT_FAILED = 1

# struct tcp_info offsets (linux/tcp.h, stable ABI): all fields used here exist since Linux 4.2
_TI_SND_MSS = 16  # __u32
_TI_TOTAL_RETRANS = 100  # __u32
_TI_BYTES_RECEIVED = 128  # __u64
_TI_SEGS_OUT = 136  # __u32


class ProbeError(Exception):
    """A probe failure with a one-line message."""


def tcp_info(sock: socket.socket) -> dict | None:
    """The TCP_INFO counters the probe uses, or None where the platform has no TCP_INFO."""
    opt = getattr(socket, "TCP_INFO", None)
    if opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, opt, 256)
    except OSError:
        return None
    if len(raw) < _TI_SEGS_OUT + 4:
        return None
    return {"snd_mss": struct.unpack_from("=I", raw, _TI_SND_MSS)[0],
            "total_retrans": struct.unpack_from("=I", raw, _TI_TOTAL_RETRANS)[0],
            "bytes_received": struct.unpack_from("=Q", raw, _TI_BYTES_RECEIVED)[0],
            "segs_out": struct.unpack_from("=I", raw, _TI_SEGS_OUT)[0]}


def _sum_info(socks: list[socket.socket], app_bytes: list[int]) -> dict:
    t0 = time.monotonic()
    infos = [tcp_info(s) for s in socks]
    # the counters were read between t0 and now: the midpoint halves the error of a preemption here
    t = (t0 + time.monotonic()) / 2
    if all(i is not None for i in infos):
        return {"t": t, "source": "tcp_info",
                **{k: sum(i[k] for i in infos) for k in ("total_retrans", "bytes_received", "segs_out")}}
    return {"t": time.monotonic(), "source": "app", "total_retrans": 0, "segs_out": 0,
            "bytes_received": sum(app_bytes)}


def restarts_idle(cc: str | None) -> bool | None:
    """Whether this host's TCP drops a connection's window back to its initial 10 segments after an
    idle RTO: net.ipv4.tcp_slow_start_after_idle (Linux's default 1), which the kernel skips for
    algorithms that pace from their own model (BBR). None where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/tcp_slow_start_after_idle") as f:
            on = f.read().strip() != "0"
    except OSError:
        return None
    return on and not (cc or "").startswith("bbr")


def _sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


# --- bulk transfer ------------------------------------------------------------------------------

def receive(socks: list[socket.socket], warmup: float, duration: float) -> dict:
    """Read every socket; measure goodput over [warmup, warmup + duration] after all are open.

    Closes the sockets when done, which stops the sender (it gets a reset).
    """
    counts = [0] * len(socks)
    stop = threading.Event()

    def drain(i: int, s: socket.socket) -> None:
        buf = bytearray(1 << 20)
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                n = s.recv_into(buf)
            except TimeoutError:
                continue
            except OSError:
                return
            if not n:
                return
            counts[i] += n

    threads = [threading.Thread(target=drain, args=(i, s), daemon=True) for i, s in enumerate(socks)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    _sleep_until(t0 + warmup)
    a = _sum_info(socks, counts)
    _sleep_until(t0 + warmup + duration)
    b = _sum_info(socks, counts)
    stop.set()
    for th in threads:
        th.join(2.0)
    for s in socks:  # unread data makes this a reset: the sender stops at once
        _close(s)
    secs = b["t"] - a["t"]
    got = b["bytes_received"] - a["bytes_received"]
    return {"mbit": got * 8 / secs / 1e6 if secs > 0 else 0.0, "bytes": got, "seconds": round(secs, 4),
            "streams": len(socks), "counter": a["source"]}


def send(socks: list[socket.socket], warmup: float, duration: float, slack: float = 10.0,
         congestion: str = "") -> dict:
    """Send on every socket until the receiver closes (or warmup + duration + slack passes).

    Returns the sender's retransmits and segments over the receiver's measurement window (as
    seen from this clock), its MSS, and whether it restarts idle connections in slow start (an
    exchange after minutes of compute pays that; the probe's warm stream does not).
    """
    for s in socks:  # the exchange's own congestion control, so the rate and idle restart are its
        try:
            tcp_cc.apply(s, congestion)
        except tcp_cc.Refused as e:
            raise ProbeError(str(e)) from None
    stop = threading.Event()
    deadline = time.monotonic() + warmup + duration + slack

    def pump(s: socket.socket) -> None:
        data = b"\0" * CHUNK
        s.settimeout(5.0)
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                s.sendall(data)
        except OSError:
            pass  # the receiver closed: the measurement is over

    threads = [threading.Thread(target=pump, args=(s,), daemon=True) for s in socks]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    zeros = [0] * len(socks)
    _sleep_until(t0 + warmup)
    a = _sum_info(socks, zeros)
    _sleep_until(t0 + warmup + duration)
    b = _sum_info(socks, zeros)
    mss = (tcp_info(socks[0]) or {}).get("snd_mss") if socks else None
    cc = tcp_cc.current(socks[0]) if socks else None
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()) + 1.0)
    stop.set()
    for s in socks:
        _close(s)
    retrans, segs = b["total_retrans"] - a["total_retrans"], b["segs_out"] - a["segs_out"]
    return {"retrans": retrans, "segs_out": segs, "retrans_pct": round(100.0 * retrans / segs, 3) if segs else 0.0,
            "mss": mss, "cc": cc, "restarts_idle": restarts_idle(cc)}


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass


# --- control connection -------------------------------------------------------------------------

class _Lines:
    """JSON lines over a socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""

    def send(self, obj: dict) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self) -> dict:
        while b"\n" not in self.buf:
            data = self.sock.recv(4096)
            if not data:
                raise ProbeError("the peer closed the control connection")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = sock.recv(n - len(out))
        if not data:
            raise ProbeError("the peer closed the connection")
        out += data
    return bytes(out)


def _hello(token: str) -> bytes:
    return f"DLPROBE1 {token}".encode().ljust(HELLO_LEN)[:HELLO_LEN]


# --- server -------------------------------------------------------------------------------------

def serve(bind: str, port: int, token: str, timeout: float = 120.0, accept_timeout: float | None = None) -> dict:
    """Serve one client (the one that knows `token`), then return a summary.

    `accept_timeout`: give up this soon when no client arrives (default: `timeout`).
    """
    ls = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        ls.bind((bind, port))
    except OSError as e:
        raise _Busy(f"port {port} is in use ({e.strerror or e})") from None
    ls.listen(64)
    end = time.monotonic() + timeout
    try:
        ctl = _accept(ls, token, min(end, time.monotonic() + (accept_timeout or timeout)))
        ctl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ctl.settimeout(max(1.0, end - time.monotonic()))
        lines = _Lines(ctl)
        lines.send({"ok": True})
        done = []
        while True:
            req = lines.recv()
            op = req.get("op")
            if op == "bye":
                break
            if op == "echo":
                lines.send({"ok": True})
                for _ in range(int(req["n"])):
                    ctl.sendall(_recv_exact(ctl, int(req["size"])))
            elif op in ("sink", "source"):
                lines.send({"ok": True})
                socks = [_accept(ls, token, end) for _ in range(int(req["streams"]))]
                if op == "sink":
                    lines.send(receive(socks, float(req["warmup"]), float(req["duration"])))
                else:
                    lines.send(send(socks, float(req["warmup"]), float(req["duration"]),
                                    congestion=str(req.get("congestion", ""))[:15]))
            else:
                lines.send({"error": f"unknown op {op!r}"})
            done.append(op)
        _close(ctl)
        return {"served": done}
    finally:
        _close(ls)


class _Busy(ProbeError):
    pass


def _accept(ls: socket.socket, token: str, end: float) -> socket.socket:
    """The next connection that greets with `token` (others are dropped)."""
    want = _hello(token)
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise ProbeError("timed out waiting for the client")
        ls.settimeout(left)
        try:
            c, _ = ls.accept()
        except TimeoutError:
            raise ProbeError("timed out waiting for the client") from None
        c.settimeout(5.0)
        try:
            if _recv_exact(c, HELLO_LEN) == want:
                return c
        except (OSError, ProbeError):
            pass
        _close(c)


# --- client -------------------------------------------------------------------------------------

def _connect(host: str, port: int, token: str, window: float) -> socket.socket:
    """Connect and greet; retry refused connections for `window` seconds (the server may start late)."""
    end, err = time.monotonic() + window, "timed out"
    while True:
        try:
            s = socket.create_connection((host, port), timeout=max(1.0, end - time.monotonic()))
            s.sendall(_hello(token))
            return s
        except OSError as e:
            err = e.strerror or str(e)
        if time.monotonic() >= end:
            raise ProbeError(f"cannot connect to {host}:{port}: {err}")
        time.sleep(0.1)


def rtt(lines: _Lines, n: int, size: int = 64) -> dict:
    """Median/min/max milliseconds of `n` request/response exchanges (after one unmeasured one)."""
    lines.send({"op": "echo", "n": n + 1, "size": size})
    if not lines.recv().get("ok"):
        raise ProbeError("the server refused the echo test")
    msg = b"x" * size
    samples = []
    for i in range(n + 1):
        t = time.monotonic()
        lines.sock.sendall(msg)
        _recv_exact(lines.sock, size)
        if i:
            samples.append((time.monotonic() - t) * 1000.0)
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": n}


def _bulk(lines: _Lines, host: str, port: int, token: str, op: str, streams: int, warmup: float,
          duration: float, congestion: str = "") -> dict:
    lines.send({"op": op, "streams": streams, "warmup": warmup, "duration": duration, "congestion": congestion})
    if not lines.recv().get("ok"):
        raise ProbeError(f"the server refused the {op} test")
    socks = [_connect(host, port, token, 10.0) for _ in range(streams)]
    if op == "sink":  # we send, the server measures
        mine = send(socks, warmup, duration, congestion=congestion)
        theirs = lines.recv()
        return {**theirs, **mine}
    mine = receive(socks, warmup, duration)
    theirs = lines.recv()
    return {**mine, **theirs}


def client(host: str, port: int, token: str, *, streams: int = 4, warmup: float = 1.0, duration: float = 5.0,
           rtt_count: int = 20, window: float = 15.0, auto_warmup: bool = False, congestion: str = "") -> dict:
    """RTT, then forward (this node -> host) and reverse throughput; see the module docstring.

    `auto_warmup`: warm up for max(warmup, 20 measured RTTs), long enough for slow start to end.
    `congestion`: the senders' TCP congestion control (`trainer.transport.tcp_cc.apply`; "": the hosts').
    """
    ctl = _connect(host, port, token, window)
    ctl.settimeout(5.0)
    lines = _Lines(ctl)
    try:
        if not lines.recv().get("ok"):
            raise ProbeError("unexpected greeting")
    except (OSError, ProbeError, ValueError):
        raise ProbeError(f"port {port} on {host} is answered by something that is not this probe "
                         "(port in use?)") from None
    ctl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    r = rtt(lines, rtt_count)
    if auto_warmup:
        warmup = max(warmup, 20 * r["median"] / 1000.0)
    ctl.settimeout(warmup + duration + 60.0)
    fwd = _bulk(lines, host, port, token, "sink", streams, warmup, duration, congestion)
    rev = _bulk(lines, host, port, token, "source", streams, warmup, duration, congestion)
    lines.send({"op": "bye"})
    _close(ctl)
    return {"rtt_ms": r, "forward": fwd, "reverse": rev, "warmup_s": warmup, "duration_s": duration}


# --- entry --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.probes.probe", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="listen for one client")
    s.add_argument("--bind", default="")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--token", required=True)
    s.add_argument("--timeout", type=float, default=120.0, help="seconds the whole session may take")
    s.add_argument("--accept-timeout", type=float, default=None, help="seconds to wait for the client")
    c = sub.add_parser("client", help="measure towards a server")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--token", required=True)
    c.add_argument("--streams", type=int, default=4)
    c.add_argument("--warmup", type=float, default=1.0)
    c.add_argument("--auto-warmup", action="store_true", help="warm up at least 20 RTTs")
    c.add_argument("--duration", type=float, default=5.0)
    c.add_argument("--rtt-count", type=int, default=20)
    c.add_argument("--window", type=float, default=15.0, help="seconds to retry connecting")
    c.add_argument("--congestion", default="", help="the senders' TCP congestion control (auto: cubic, else reno)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "serve":
            out = serve(a.bind, a.port, a.token, a.timeout, a.accept_timeout)
        else:
            out = client(a.host, a.port, a.token, streams=a.streams, warmup=a.warmup, duration=a.duration,
                         rtt_count=a.rtt_count, window=a.window, auto_warmup=a.auto_warmup,
                         congestion=a.congestion)
    except _Busy as e:
        print(json.dumps({"error": "busy", "message": str(e)}), flush=True)
        return EXIT_BUSY
    except (ProbeError, OSError) as e:
        print(json.dumps({"error": "failed", "message": str(e) or type(e).__name__}), flush=True)
        return EXIT_FAILED
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
