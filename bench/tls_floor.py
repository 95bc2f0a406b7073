"""The floor of encryption on this machine: one TCP stream over loopback, plain and TLS 1.3.

No ring, no threads of ours, no chunking: one `sendall` of the whole payload against a reader
thread in the same process, so the CPU figure covers both ends (send + receive). It bounds what
any TLS transport can do on loopback, where the link is free and the CPU is the whole cost:
`bench/transport.py` compares the trainer's transport with gloo against this floor.

    .venv/bin/python bench/tls_floor.py --mib 256 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dilococtl import run_ca  # noqa: E402
from trainer.transport.tls import Identity, client_context, server_context  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one(payload: memoryview, read_bytes: int, ctxs: tuple[ssl.SSLContext, ssl.SSLContext] | None) -> dict:
    """Move `payload` once over a fresh loopback connection; wall and CPU seconds (both ends)."""
    n = len(payload)
    with socket.create_server(("127.0.0.1", 0)) as ls:
        got = [0]

        def serve() -> None:
            s, _ = ls.accept()
            if ctxs:
                s = ctxs[0].wrap_socket(s, server_side=True)
            buf = memoryview(bytearray(read_bytes))
            while got[0] < n:
                k = s.recv_into(buf, read_bytes)
                if not k:
                    break
                got[0] += k
            s.close()

        th = threading.Thread(target=serve)
        th.start()
        c = socket.create_connection(ls.getsockname())
        if ctxs:
            c = ctxs[1].wrap_socket(c)
            c.do_handshake()
        t0, c0 = time.perf_counter(), _cpu_s()
        c.sendall(payload)
        th.join()
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
        cipher = c.cipher()[0] if ctxs else ""
        c.close()
    if got[0] != n:
        raise RuntimeError(f"received {got[0]} of {n} bytes")
    return {"wall_s": wall, "cpu_s": cpu, "cipher": cipher}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="payload size in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--read-kib", type=int, default=1024, help="receiver's recv_into size")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args()
    payload = memoryview(bytearray(a.mib << 20))
    with tempfile.TemporaryDirectory() as d:
        ids = run_ca.ensure(d, "floor", ["a", "b"])
        ident = {s: Identity(site=s, cert=str(i.cert), key=str(i.key), ca=str(i.ca)) for s, i in ids.items()}
        ctxs = (server_context(ident["a"]), client_context(ident["b"]))
        rows = {}
        for arm, c in (("tcp", None), ("tls", ctxs)):
            runs = [one(payload, a.read_kib << 10, c) for _ in range(a.repeats)]
            gb = len(payload) / 1e9
            rows[arm] = {"gb_per_s": statistics.median(gb / r["wall_s"] for r in runs),
                         "cpu_s_per_gb": statistics.median(r["cpu_s"] / gb for r in runs),
                         "cipher": runs[0]["cipher"]}
    for arm, r in rows.items():
        print(f"{arm:4} {r['gb_per_s']:.2f} GB/s  {r['cpu_s_per_gb']:.2f} CPU s/GB (both ends)  {r['cipher']}")
    print(f"tls / tcp wall time: {rows['tcp']['gb_per_s'] / rows['tls']['gb_per_s']:.2f}x")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
