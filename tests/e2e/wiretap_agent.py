"""Run inside lab node namespaces by test_lab.py's wiretap test (`ip netns exec NS python wiretap_agent.py ...`).

    capture SECONDS OUT                       every frame on every interface of this namespace -> OUT
    tls RANK ADDR0 ADDR1 PORT CA_DIR          one allreduce of the motif tensor over the TLS transport,
                                              listeners as the trainer makes them (clear_loopback on)
    gloo RANK ADDR0 PORT                      the same allreduce over gloo (store at ADDR0:PORT)
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def motif_tensor() -> torch.Tensor:
    motif = torch.randn(16, generator=torch.Generator().manual_seed(4242))  # 64 distinctive bytes
    return motif.repeat(8192)  # 512 KiB


def capture(seconds: float, out: str) -> None:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL, no bind: all
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    s.settimeout(0.1)
    print("ready", flush=True)
    frames, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            frames.append(s.recv(1 << 17))
        except TimeoutError:
            continue
    Path(out).write_bytes(b"".join(frames))


def tls(rank: int, addrs: list[str], port: int, ca: str) -> None:
    from trainer.transport import Identity, Listener, connect

    site = f"s{rank}"
    d = Path(ca)
    ident = Identity(site=site, cert=str(d / "sites" / f"{site}.crt"), key=str(d / "sites" / f"{site}.key"),
                     ca=str(d / "ca.crt"))
    with Listener(ident, host=addrs[rank], port=port, clear_loopback=True) as lst:
        with connect(lst, rank=rank, sites=["s0", "s1"], addrs=[(a, port) for a in addrs], streams=2,
                     session=b"w" * 16, timeout_s=30) as c:
            t = motif_tensor()
            c.allreduce_sum(t)
            assert torch.equal(t, motif_tensor() * 2)
            print(f"lanes {c.mesh.lanes(1 - rank)}", flush=True)


def gloo(rank: int, addr0: str, port: int) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # not the shared hostname, which resolves to 127.0.0.1
    store = dist.TCPStore(addr0, port, 2, rank == 0, timeout=timedelta(seconds=30))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("w", store), rank, 2, timedelta(seconds=30))
    t = motif_tensor()
    pg.allreduce([t]).wait()
    assert torch.equal(t, motif_tensor() * 2)
    pg.allreduce([torch.zeros(1)]).wait()  # neither side leaves while the other still reads


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "capture":
        capture(float(args[0]), args[1])
    elif cmd == "tls":
        tls(int(args[0]), [args[1], args[2]], int(args[3]), args[4])
    elif cmd == "gloo":
        gloo(int(args[0]), args[1], int(args[2]))
    else:
        sys.exit(f"wiretap_agent: unknown command {cmd}")
