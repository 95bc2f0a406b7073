"""The Lighthouse relay's round trip: a small request and answer, each in two writes (as a gRPC
message often leaves: headers, then data), through RelayClient -> TLS -> RelayServer -> service, on
loopback. Two arms side by side, alternating per exchange: every leg sent without Nagle (the relay as
it is), and the relay's plaintext legs left with Nagle (as it was before). Reports each arm's median,
p90 and max round trip and how many exceeded 20 ms.

    .venv/bin/python bench/relay_rtt.py --exchanges 300
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dilococtl import run_ca  # noqa: E402
from trainer.transport import Identity, relay  # noqa: E402


def service() -> socket.socket:
    """A plaintext service on loopback (NODELAY, like gRPC's): answers 20 bytes in two writes."""
    srv = socket.create_server(("127.0.0.1", 0))

    def one(c: socket.socket) -> None:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with c:
            while True:
                got = b""
                while len(got) < 20:
                    if not (chunk := c.recv(100)):
                        return
                    got += chunk
                c.sendall(b"h" * 10)
                c.sendall(b"b" * 10)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=one, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exchanges", type=int, default=300, help="round trips per arm")
    ap.add_argument("--out", default="", help="JSON results file ('' for none)")
    args = ap.parse_args(argv)
    ids = run_ca.ensure(Path(tempfile.mkdtemp()), "relay-bench", ["lh", "s1"])

    def ident(s: str) -> Identity:
        return Identity(site=s, cert=str(ids[s].cert), key=str(ids[s].key), ca=str(ids[s].ca))

    real = relay.tune_socket
    arms: dict[str, list[float]] = {}
    conns = {}
    svc = service()
    for arm in ("nodelay", "nagle"):
        srv = relay.RelayServer(ident("lh"), target=svc.getsockname(), bind="127.0.0.1")
        tls_port = srv.port
        if arm == "nagle":  # only the TLS legs (those on the server relay's port) are tuned
            relay.tune_socket = lambda s, p=tls_port: real(s) if p in (s.getsockname()[1], s.getpeername()[1]) else None
        cli = relay.RelayClient(ident("s1"), server=("127.0.0.1", srv.port), expect="lh")
        c = socket.create_connection(("127.0.0.1", cli.port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(b"x" * 20)  # the connection is set up (and the legs tuned) before the patch goes
        got = b""
        while len(got) < 20:
            got += c.recv(100)
        relay.tune_socket = real
        conns[arm], arms[arm] = c, []
    for _ in range(args.exchanges):
        for arm, c in conns.items():
            t0 = time.perf_counter()
            c.sendall(b"H" * 10)
            time.sleep(0.0005)  # the two writes leave apart, as a request's frames can
            c.sendall(b"B" * 10)
            got = b""
            while len(got) < 20:
                got += c.recv(100)
            arms[arm].append(time.perf_counter() - t0)
            time.sleep(0.005)
    out = {}
    for arm, lat in arms.items():
        lat = sorted(lat)
        out[arm] = {"median_ms": statistics.median(lat) * 1e3, "p90_ms": lat[int(0.9 * len(lat))] * 1e3,
                    "max_ms": lat[-1] * 1e3, "over_20ms": sum(x > 0.02 for x in lat), "n": len(lat)}
        print(f"{arm:8} median {out[arm]['median_ms']:.1f} ms  p90 {out[arm]['p90_ms']:.1f}  "
              f"max {out[arm]['max_ms']:.1f}  over 20 ms: {out[arm]['over_20ms']} of {len(lat)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "relay_rtt", "arms": out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
