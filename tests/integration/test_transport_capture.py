"""What a wiretap sees: a known pseudo-gradient exchanged over gloo and over the TLS transport,
captured on loopback with a raw packet socket (root). Gloo's capture holds the tensor's bytes in
clear; the TLS transport's does not, unless its listeners let loopback streams leave TLS
(`clear_loopback`, the trainer's default for sites on one host). tests/e2e/test_lab.py taps a lab
link, where that default stays encrypted."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dilococtl import run_ca
from trainer.transport import Identity, Listener, connect

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a packet capture needs root (AF_PACKET)")

ETH_P_ALL = 0x0003


class Capture:
    """Every frame on `lo` while it runs."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.bind(("lo", 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self.sock.settimeout(0.1)
        self.frames: list[bytes] = []
        self.bytes = 0
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.frames.append(self.sock.recv(1 << 17))
            except TimeoutError:
                continue

    def stop(self) -> bytes:
        time.sleep(0.2)
        self._stop.set()
        self._th.join(5)
        self.sock.close()
        return b"".join(self.frames)


def pattern_tensor() -> tuple[torch.Tensor, bytes]:
    motif = torch.randn(16, generator=torch.Generator().manual_seed(4242))  # 64 distinctive bytes
    return motif.repeat(8192), motif.numpy().tobytes()  # 512 KiB of pseudo-gradient


def both(fn):
    errs = []

    def body(r):
        try:
            fn(r)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ths = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    if errs:
        raise errs[0]


def test_gloo_shows_the_pseudo_gradient_in_clear_and_tls_does_not(tmp_path):
    delta, motif = pattern_tensor()
    # gloo, as torchft's ProcessGroupGloo runs it
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    port = store.port
    cap = Capture()

    def gloo_site(r):
        s = store if r == 0 else dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
        pg = dist.ProcessGroupGloo(dist.PrefixStore("cap", s), r, 2, timedelta(seconds=30))
        pg.allreduce([delta.clone()]).wait()

    both(gloo_site)
    gloo_wire = cap.stop()
    assert gloo_wire.count(motif) > 100  # the capture works: gloo's bytes are the tensor's bytes

    ids = run_ca.ensure(tmp_path, "cap", ["s0", "s1"])
    tls_wire = tls_capture(ids, delta, clear_loopback=False)
    assert len(tls_wire) > delta.nbytes  # the exchange was captured ...
    assert tls_wire.count(motif) == 0  # ... and holds not one copy of the 64-byte motif
    assert tls_wire.count(motif[:16]) == 0  # not even a quarter of it
    # loopback streams that left TLS after the authenticated hello carry the bytes as gloo does
    assert tls_capture(ids, delta, clear_loopback=True).count(motif) > 100


def tls_capture(ids, delta: torch.Tensor, clear_loopback: bool) -> bytes:
    """The frames on `lo` while two TLS transport members allreduce `delta` (checked: 2 x delta)."""
    lst = [Listener(Identity(site=s, cert=str(ids[s].cert), key=str(ids[s].key), ca=str(ids[s].ca)),
                    host="127.0.0.1", clear_loopback=clear_loopback) for s in ("s0", "s1")]
    addrs = [("127.0.0.1", x.port) for x in lst]
    got = [None, None]
    cap = Capture()

    def tls_site(r):
        with connect(lst[r], rank=r, sites=["s0", "s1"], addrs=addrs, streams=2, session=b"c" * 16,
                     timeout_s=30) as c:
            t = delta.clone()
            c.allreduce_sum(t)
            got[r] = t

    both(tls_site)
    wire = cap.stop()
    for x in lst:
        x.close()
    assert torch.equal(got[0], delta * 2) and torch.equal(got[1], delta * 2)
    return wire
