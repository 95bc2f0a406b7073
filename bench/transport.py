"""Cross-site transport benchmark: TLS striped ring (trainer.transport) against gloo, side by side.

K processes on loopback (or, with --host/--peers, across a lab link) each run, for every payload
size and repeat, one gloo allreduce and one TLS allreduce of the same fp32 tensor, alternating,
so both arms see the same machine state. Reported per arm: median exchange time, goodput
(payload bytes / exchange time, the issue's figure), and CPU seconds per GB this process moved
(sent + received), from the process's CPU clock around each collective.

    .venv/bin/python bench/transport.py --sizes 1,16,64 --repeats 5 --streams 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from trainer.transport import Identity, Listener, connect

    torch.set_num_threads(1)
    rank, k = a.rank, a.k
    timeout = timedelta(seconds=a.timeout)
    store = dist.TCPStore(a.store_host, a.store_port, k, rank == 0, timeout=timeout)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, k, timeout)
    site = f"b{rank}"
    d = Path(a.ca)
    ident = Identity(site=site, cert=str(d / "sites" / f"{site}.crt"), key=str(d / "sites" / f"{site}.key"),
                     ca=str(d / "ca.crt"))
    comms, opened = {}, []
    # "tls": every stream encrypted; "clear": streams between loopback ends leave TLS after the hello
    for arm in [x for x in ("tls", "clear") if x in a.arms]:
        lst = Listener(ident, host="0.0.0.0", clear_loopback=arm == "clear")
        store.set(f"addr/{arm}/{rank}", json.dumps([a.host, lst.port]))
        addrs = [tuple(json.loads(store.get(f"addr/{arm}/{r}"))) for r in range(k)]
        comm = connect(lst, rank=rank, sites=[f"b{r}" for r in range(k)], addrs=addrs, streams=a.streams,
                       session=f"bench-{arm}".encode().ljust(16, b"!"), timeout_s=a.timeout)
        if a.pace_mbit > 0:
            comm.pace(a.pace_mbit)
        if a.cc:
            comm.congestion(a.cc)
        comms[arm] = comm.allreduce_sum
        opened.append((comm, lst))

    def barrier() -> None:
        gloo.allreduce([torch.zeros(1)]).wait()

    def gloo_sum(t: torch.Tensor) -> None:
        gloo.allreduce([t]).wait()

    arms = {name: fn for name, fn in (("gloo", gloo_sum), *comms.items()) if name in a.arms}
    rows = []
    for mb in a.sizes:
        n = int(mb * (1 << 20)) // 4
        base = torch.randn(n)
        for fn in arms.values():  # warm-up: first-touch, connection windows
            fn(base.clone())
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
        for rep in range(a.repeats):
            order = list(arms) if rep % 2 == 0 else list(reversed(arms))
            for name in order:
                t = base.clone()
                time.sleep(a.idle_s)  # a round's compute: connections idle, as between real exchanges
                barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                arms[name](t)
                times[name].append((time.perf_counter() - w0, time.process_time() - c0))
        moved = 2 * 2 * (k - 1) / k * n * 4  # ring: 2(K-1)/K of the payload sent, as much received
        for name, tc in times.items():
            wall = statistics.median(w for w, _ in tc)
            cpu = statistics.median(c for _, c in tc)
            rows.append({"arm": name, "mb": mb, "wall_s": wall, "goodput_mbit": n * 4 * 8 / wall / 1e6,
                         "cpu_s_per_gb": cpu / (moved / 1e9), "cpu_s": cpu})
    barrier()
    for comm, lst in opened:
        comm.close()
        lst.close()
    if rank == 0:
        print(json.dumps(rows), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,16,64", help="payload sizes in MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--streams", type=int, default=4, help="TLS connections per peer and direction")
    p.add_argument("--k", type=int, default=2, help="members (sites)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--arms", default="gloo,tls", help="which transports to run: gloo, tls, clear (tls whose loopback streams leave TLS after the hello)")
    p.add_argument("--idle-s", type=float, default=0.0, help="idle seconds before each exchange (a round's compute)")
    p.add_argument("--cc", default="auto", help="congestion control of the TLS streams (the trainer's default: auto, cubic else reno; \"\": the host's)")
    p.add_argument("--pace-mbit", type=float, default=0.0, help="pace each direction's S TLS streams to this total")
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--ca", default="", help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help="address this member advertises")
    p.add_argument("--store-host", default="127.0.0.1")
    p.add_argument("--store-port", type=int, default=0)
    a = p.parse_args()
    a.sizes = [float(x) for x in a.sizes.split(",")]
    a.arms = [x for x in a.arms.split(",") if x]
    if not a.arms or set(a.arms) - {"gloo", "tls", "clear"}:
        sys.exit("bench/transport.py: --arms takes gloo, tls, clear")
    if a.rank >= 0:
        worker(a)
        return
    from dilococtl import run_ca

    with tempfile.TemporaryDirectory() as tmp:
        run_ca.ensure(tmp, "bench", [f"b{r}" for r in range(a.k)])
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        argv = [sys.executable, __file__, "--sizes", ",".join(map(str, a.sizes)), "--repeats", str(a.repeats),
                "--streams", str(a.streams), "--k", str(a.k), "--timeout", str(a.timeout), "--ca", tmp,
                "--store-port", str(port), "--arms", ",".join(a.arms), "--pace-mbit", str(a.pace_mbit), "--idle-s", str(a.idle_s), "--cc", a.cc]
        procs = [subprocess.Popen([*argv, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True)
                 for r in range(a.k)]
        out = [pr.communicate()[0] for pr in procs]
        if any(pr.returncode for pr in procs):
            sys.exit("bench/transport.py: a worker failed")
    rows = json.loads(out[0].strip().splitlines()[-1])
    print(f"K={a.k} loopback, TLS streams={a.streams}, median of {a.repeats}; goodput = payload bytes / exchange time")
    print(f"{'MiB':>6} {'arm':>5} {'time s':>9} {'goodput Mbit/s':>15} {'CPU s/GB moved':>15} {'/ gloo time':>12}")
    by = {(r["mb"], r["arm"]): r for r in rows}
    for mb in a.sizes:
        for arm in a.arms:
            r = by[(mb, arm)]
            ratio = f"{r['wall_s'] / by[(mb, 'gloo')]['wall_s']:.2f}x" if arm != "gloo" and "gloo" in a.arms else ""
            print(f"{mb:>6g} {arm:>5} {r['wall_s']:>9.4f} {r['goodput_mbit']:>15.0f} {r['cpu_s_per_gb']:>15.2f} {ratio:>12}")


if __name__ == "__main__":
    main()
