"""Issue 34, finding 11: connections that never authenticate hold a bounded number of threads in the
relay and the mesh, and a member that answers promptly still gets through the flood."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from dilococtl import run_ca
from trainer.transport import Identity
from trainer.transport import mesh as mesh_mod
from trainer.transport import relay as relay_mod
from trainer.transport.mesh import Listener, build_mesh
from trainer.transport.relay import RelayClient, RelayServer

FLOOD = 20  # connections beyond the cap


def ident(ids, site) -> Identity:
    i = ids[site]
    return Identity(site=site, cert=str(i.cert), key=str(i.key), ca=str(i.ca))


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    return run_ca.ensure(tmp_path_factory.mktemp("run"), "caps", ["lh", "s1", "s2"])


class Peak:
    """The most threads alive at once while it runs, in all and by name prefix (sampled every millisecond)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.base = threading.active_count()
        self.peak = self.base
        self.named = 0  # the most threads whose name starts with `prefix` alive at once
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, threading.active_count())
            self.named = max(self.named, sum(t.name.startswith(self.prefix) for t in threading.enumerate()))

    def stop(self) -> int:
        """Threads added at the peak (its own sampler not counted)."""
        self._stop.set()
        self._t.join()
        return self.peak - self.base - 1


def silent_flood(port: int, n: int) -> list[socket.socket]:
    """`n` TCP connections that never send a byte; each accepted before the next is opened."""
    out = []
    for _ in range(n):
        out.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    return out


class Echo:
    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = self.sock.getsockname()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c):
        with c:
            while data := c.recv(65536):
                c.sendall(data)


def test_a_silent_flood_holds_at_most_the_cap_in_threads_and_a_site_still_gets_through_the_relay(ids):
    echo = Echo()
    peak = Peak("relay-conn")
    with RelayServer(ident(ids, "lh"), target=echo.addr, bind="127.0.0.1") as srv, \
            RelayClient(ident(ids, "s1"), server=("127.0.0.1", srv.port), expect="lh") as cli:
        flood = silent_flood(srv.port, relay_mod.PREAUTH_MAX + FLOOD)
        deadline = time.monotonic() + 5
        while srv.cut < FLOOD and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", cli.port), timeout=5) as c:  # a site's real request
            c.sendall(b"ping")
            c.settimeout(5)
            assert c.recv(4) == b"ping"
        took = time.monotonic() - t0
        added = peak.stop()
        for s in flood:
            s.close()
        assert srv.cut >= FLOOD and srv.accepted == 1
    echo.sock.close()
    assert took < 3.0
    # the flood's handshakes (the cap) and the relayed connection at each relay: not one thread per silent
    # connection (before the cap: 52 and more)
    assert peak.named <= relay_mod.PREAUTH_MAX + 2, peak.named
    assert added <= relay_mod.PREAUTH_MAX + 6, added  # + the two relays' accept threads and the echo's


def test_a_silent_flood_does_not_keep_a_member_out_of_the_mesh(ids):
    a = Listener(ident(ids, "s1"), host="127.0.0.1")
    b = Listener(ident(ids, "s2"), host="127.0.0.1")
    flood = silent_flood(a.port, mesh_mod.PREAUTH_MAX + FLOOD)  # queued on rank 0's listener before the build
    session = os.urandom(16)
    addrs = [("127.0.0.1", a.port), ("127.0.0.1", b.port)]
    out: dict = {}

    def member(rank, lst):
        out[rank] = build_mesh(lst, rank=rank, size=2, sites=["s1", "s2"], addrs=addrs, streams=2,
                               session=session, timeout_s=8.0)

    peak = Peak("dlt-accept")
    t0 = time.monotonic()
    ths = [threading.Thread(target=member, args=(r, lst)) for r, lst in ((0, a), (1, b))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(15)
    took = time.monotonic() - t0
    added = peak.stop()
    try:
        assert set(out) == {0, 1}, "the mesh was not built"
        assert took < 4.0
        assert a.cut >= FLOOD
        # at most the cap's handshakes, never one per silent connection (before the cap: 52 and more)
        assert peak.named <= mesh_mod.PREAUTH_MAX, peak.named
        assert added <= mesh_mod.PREAUTH_MAX + 6, added  # + the two builders and b's dialer
    finally:
        for s in flood:
            s.close()
        for m in out.values():
            m.close()
        a.close()
        b.close()
