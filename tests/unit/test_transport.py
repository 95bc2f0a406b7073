"""The TLS transport's collectives, in threads on loopback: results, bytes, failures, leaks."""

import os
import threading
import time

import pytest
import torch

from dilococtl import run_ca
from trainer.transport import CollectiveMismatch, Identity, Listener, PeerLost, TransportError, connect


def identity(ids, site) -> Identity:
    i = ids[site]
    return Identity(site=site, cert=str(i.cert), key=str(i.key), ca=str(i.ca))


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    d = tmp_path_factory.mktemp("ca")
    return run_ca.ensure(d, "run-t", ["s0", "s1", "s2", "s3"])


class Group:
    """K listeners on loopback; `run(fn)` builds a fresh mesh per call and runs fn(rank, comm) in K threads."""

    def __init__(self, ids, k, streams=2, timeout_s=20.0, clear=(), **chunking):
        self.sites = [f"s{i}" for i in range(k)]
        self.listeners = [Listener(identity(ids, s), host="127.0.0.1", clear_loopback=i in clear)
                          for i, s in enumerate(self.sites)]
        self.addrs = [("127.0.0.1", lst.port) for lst in self.listeners]
        self.streams, self.timeout_s, self.chunking = streams, timeout_s, chunking
        self.calls = 0

    def comm(self, rank, session):
        return connect(self.listeners[rank], rank=rank, sites=self.sites, addrs=self.addrs,
                       streams=self.streams, session=session, timeout_s=self.timeout_s, **self.chunking)

    def run(self, fn, keep_errors=False):
        self.calls += 1
        session = self.calls.to_bytes(16, "big")
        out, errs = [None] * len(self.sites), [None] * len(self.sites)

        def body(r):
            try:
                with self.comm(r, session) as c:
                    out[r] = fn(r, c)
            except BaseException as e:  # noqa: BLE001
                errs[r] = e

        ths = [threading.Thread(target=body, args=(r,)) for r in range(len(self.sites))]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
        if keep_errors:
            return out, errs
        for e in errs:
            if e is not None:
                raise e
        return out

    def close(self):
        for lst in self.listeners:
            lst.close()


@pytest.fixture
def group3(ca):
    g = Group(ca, 3, streams=3, min_chunk_bytes=256, chunk_bytes=1024)  # tiny chunks: many per stream
    yield g
    g.close()


def test_allreduce_is_bit_identical_everywhere_and_matches_the_sum(group3):
    gens = [torch.Generator().manual_seed(r) for r in range(3)]
    inputs = [torch.randn(10_007, generator=g) * (10.0 ** torch.randint(-6, 7, (10_007,), generator=g)) for g in gens]

    def site(r, c):
        t = inputs[r].clone()
        c.allreduce_sum(t)
        again = inputs[r].clone()
        c.allreduce_sum(again)
        return t, again

    out = group3.run(site)
    exact = sum(x.double() for x in inputs)
    for t, again in out:
        assert torch.equal(t, out[0][0])  # same bits at every member
        assert torch.equal(again, t)  # and at every call: the order is fixed
    assert torch.allclose(out[0][0].double(), exact, rtol=1e-6, atol=1e-5)
    # the order, exactly: block b (of 3) is summed round the ring from member b: (x_b + x_b+1) + x_b+2
    per = -(-10_007 // 3)
    for b in range(3):
        sl = slice(b * per, (b + 1) * per)
        ring = (inputs[b][sl] + inputs[(b + 1) % 3][sl]) + inputs[(b + 2) % 3][sl]
        assert torch.equal(out[0][0][sl], ring)


def test_allreduce_of_cancelling_values_agrees_at_every_member(group3):
    # 1e8 + 1 - 1e8 depends on the order; whatever the ring computes, all members hold the same
    vals = [torch.tensor([1e8, 0.5, 3.0]), torch.tensor([1.0, 0.25, -1.0]), torch.tensor([-1e8, 0.125, 2.0])]
    out = group3.run(lambda r, c: (lambda t: (c.allreduce_sum(t), t)[1])(vals[r].clone()))
    assert out[0].tolist()[1:] == [0.875, 4.0]
    assert out[0][0].item() in (0.0, 1.0)
    assert all(torch.equal(t, out[0]) for t in out)


@pytest.mark.parametrize("n", [0, 1, 2, 5, 4099])
def test_allreduce_of_odd_sizes_and_dtypes(group3, n):
    def site(r, c):
        f = torch.full((n,), float(r + 1))
        i = torch.arange(n, dtype=torch.int64) * (r + 1)
        c.allreduce_sum(f)
        c.allreduce_sum(i)
        return f, i

    for f, i in group3.run(site):
        assert f.tolist() == [6.0] * n
        assert i.tolist() == [6 * j for j in range(n)]


def test_allreduce_in_place_of_a_non_contiguous_view(group3):
    def site(r, c):
        base = torch.zeros(4, 6)
        view = base[:, ::2]  # not contiguous
        view.fill_(float(r))
        c.allreduce_sum(view)
        return base

    for base in group3.run(site):
        assert base[:, ::2].eq(3.0).all() and base[:, 1::2].eq(0.0).all()


def test_allgather_orders_by_rank_keeps_dtype_and_shape_and_gives_private_copies(group3):
    def site(r, c):
        got = c.allgather(torch.full((3, 5), r, dtype=torch.bfloat16))
        raw = c.allgather(torch.arange(7, dtype=torch.uint8) + r)
        got[0].fill_(-1)
        return got, raw

    for got, raw in group3.run(site):
        assert [g.shape for g in got] == [(3, 5)] * 3 and got[1].dtype == torch.bfloat16
        assert got[1].eq(1).all() and got[2].eq(2).all() and got[0].eq(-1).all()
        assert [x.tolist() for x in raw] == [[j + r for j in range(7)] for r in range(3)]


def test_alltoall_scatters_parts_by_rank(group3):
    def site(r, c):
        return c.alltoall(torch.arange(3 * 1000, dtype=torch.float32) + 100_000 * r)

    out = group3.run(site)
    for me, got in enumerate(out):
        parts = got.view(3, 1000)
        for src in range(3):
            assert torch.equal(parts[src], torch.arange(me * 1000, (me + 1) * 1000, dtype=torch.float32) + 100_000 * src)


def test_alltoall_refuses_a_tensor_that_does_not_split(group3):
    out, errs = group3.run(lambda r, c: c.alltoall(torch.zeros(4)), keep_errors=True)
    assert all(isinstance(e, ValueError) and "3 equal parts" in str(e) for e in errs)


def test_each_member_sends_2_k_minus_1_over_k_of_an_allreduce(ca):
    g = Group(ca, 4, streams=2)
    try:
        n = 1 << 18  # fp32: 1 MiB

        def site(r, c):
            c.allreduce_sum(torch.ones(n))
            return c.bytes_sent, c.bytes_recv

        for sent, recv in g.run(site):
            assert sent == recv == 2 * 3 * (n * 4) // 4
    finally:
        g.close()


def test_a_single_member_group_needs_no_peer(ca):
    g = Group(ca, 1)
    try:
        out = g.run(lambda r, c: (c.allreduce_sum(t := torch.ones(3)), t, c.allgather(t), c.alltoall(t))[1:])
        t, ag, a2 = out[0]
        assert t.tolist() == [1.0] * 3 and len(ag) == 1 and a2.tolist() == [1.0] * 3
    finally:
        g.close()


def test_mismatched_shapes_fail_every_member_with_a_named_mismatch(group3):
    t0 = time.monotonic()
    out, errs = group3.run(lambda r, c: c.allreduce_sum(torch.ones(100 + (r == 2))), keep_errors=True)
    assert all(isinstance(e, TransportError) for e in errs)
    assert any(isinstance(e, CollectiveMismatch) and "collective mismatch" in str(e) for e in errs)
    assert time.monotonic() - t0 < group3.timeout_s  # detected, not timed out


def test_a_silent_peer_fails_the_collective_within_the_timeout(ca):
    g = Group(ca, 3, streams=2, timeout_s=1.5)
    try:
        hold = threading.Event()

        def site(r, c):
            if r == 2:
                hold.wait(10)  # alive, connected, never takes part
                return None
            t0 = time.monotonic()
            with pytest.raises(PeerLost):
                c.allreduce_sum(torch.ones(1000))
            took = time.monotonic() - t0
            if r == 0:
                time.sleep(0.5)
                hold.set()
            return took

        took = g.run(site)
        for r in (0, 1):
            assert 1.4 < took[r] < 4.0
    finally:
        g.close()


def test_a_peer_that_drops_its_streams_mid_collective_fails_the_others_fast(ca):
    g = Group(ca, 3, streams=2, timeout_s=30.0, min_chunk_bytes=1024, chunk_bytes=4096)
    try:
        def site(r, c):
            if r == 2:
                threading.Timer(0.05, c.mesh.abort).start()  # its process dies: every stream ends
                try:
                    c.allreduce_sum(torch.ones(4_000_000))
                except TransportError:
                    pass
                return None
            t0 = time.monotonic()
            with pytest.raises(TransportError):
                c.allreduce_sum(torch.ones(4_000_000))
            return time.monotonic() - t0

        took = g.run(site)
        assert took[0] < 10 and took[1] < 10  # far inside the 30 s timeout: a closed stream is seen at once
    finally:
        g.close()


def test_a_failed_comm_refuses_further_collectives(ca):
    g = Group(ca, 2, timeout_s=1.0)
    try:
        def site(r, c):
            if r == 1:
                time.sleep(2.5)
                return None
            with pytest.raises(PeerLost):
                c.allreduce_sum(torch.ones(10))
            with pytest.raises(TransportError, match="unusable after an earlier failure"):
                c.allgather(torch.ones(1))
            return c.failed

        assert isinstance(g.run(site)[0], PeerLost)
    finally:
        g.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_thread_or_socket_outlives_its_round(ca):
    g = Group(ca, 3, streams=4)
    try:
        def rounds(r, c):
            for _ in range(5):
                c.allreduce_sum(torch.ones(50_000))
                c.allgather(torch.ones(3))
                c.alltoall(torch.ones(30))
            return threading.active_count()

        g.run(rounds)  # warm-up: lazy imports, pools
        threads, fds = threading.active_count(), _fds()
        for _ in range(3):  # three quorums, each its own mesh
            g.run(rounds)
        assert threading.active_count() == threads
        assert _fds() == fds
        # a failed round leaves nothing behind either
        g.timeout_s = 1.0
        g.run(lambda r, c: c.allreduce_sum(torch.ones(10)) if r else time.sleep(2.0), keep_errors=True)
        time.sleep(0.2)
        assert threading.active_count() == threads
        assert _fds() == fds
    finally:
        g.close()


def test_pacing_splits_the_rate_over_the_streams_of_each_peer(ca):
    import socket

    g = Group(ca, 3, streams=4)
    try:
        def site(r, c):
            c.pace(48.0)
            rates = {c.mesh.tx(p, s).getsockopt(socket.SOL_SOCKET, 47) for p in c.mesh.links for s in range(4)}
            for bad in (0.0, -1.0, float("nan"), float("inf")):
                with pytest.raises(ValueError, match="pace_mbit"):
                    c.pace(bad)
            c.allreduce_sum(t := torch.ones(10))
            return rates, t

        for rates, t in g.run(site):
            assert rates == {48_000_000 // 8 // 4}  # bytes/s per stream: 4 streams make 48 Mbit/s
            assert t.tolist() == [3.0] * 10
    finally:
        g.close()


def test_congestion_control_is_set_on_every_stream_or_refused_by_name(ca):
    import socket

    g = Group(ca, 2, streams=2)
    try:
        def site(r, c):
            c.congestion("reno")
            names = {sk.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")
                     for sk in c.mesh.all_sockets()}
            with pytest.raises(TransportError, match="'no-such-cc' refused"):
                c.congestion("no-such-cc")
            return names

        assert g.run(site) == [{b"reno"}, {b"reno"}]
    finally:
        g.close()


def _every_collective(r, c):
    """allreduce (tiny chunks: many per stream), allgather, alltoall and a blob; what each gave."""
    g = torch.Generator().manual_seed(r)
    t = torch.randn(20_011, generator=g)
    c.allreduce_sum(t)
    gathered = c.allgather(torch.arange(5.0) + r)
    a2a = c.alltoall(torch.arange(6.0) + 100 * r)
    if r == 0:
        c.send_blob(1, bytes(range(256)) * 1000)
        blob = None
    elif r == 1:
        blob = bytes(c.recv_blob(0, 1 << 20))
    else:
        blob = None
    return t, gathered, a2a, blob, {p: c.mesh.lanes(p) for p in c.mesh.links}


@pytest.mark.parametrize("clear,lanes", [((0, 1, 2), 1), ((0, 1), None), ((), 3)])
def test_loopback_streams_leave_tls_only_where_both_listeners_allow_it(ca, clear, lanes):
    """Where both ends allow it, a loopback pair's streams leave TLS and a collective stripes over
    one of them; the results are the bits of the all-TLS group's, whatever mix of pairs."""
    ref = Group(ca, 3, streams=3, min_chunk_bytes=256, chunk_bytes=1024)
    mixed = Group(ca, 3, streams=3, clear=clear, min_chunk_bytes=256, chunk_bytes=1024)
    try:
        want, got = ref.run(_every_collective), mixed.run(_every_collective)
    finally:
        ref.close()
        mixed.close()
    for (t0, g0, a0, b0, _), (t1, g1, a1, b1, _) in zip(want, got, strict=True):
        assert torch.equal(t0, t1) and all(torch.equal(x, y) for x, y in zip(g0, g1, strict=True))
        assert torch.equal(a0, a1) and b0 == b1
    assert got[1][3] == bytes(range(256)) * 1000
    if lanes is None:  # s0-s1 clear (1 lane), s2's pairs encrypted (3)
        assert got[0][4] == {1: 1, 2: 3} and got[1][4] == {0: 1, 2: 3} and got[2][4] == {0: 3, 1: 3}
    else:
        assert all(set(x[4].values()) == {lanes} for x in got)


def test_a_listener_keeps_tls_where_its_own_end_is_not_on_loopback(ca, monkeypatch):
    """Each end decides from its own socket: a peer that asks for clear cannot get it from a listener
    whose connection is not a loopback one (here: the check patched to say so)."""
    from trainer.transport import mesh as mesh_mod

    monkeypatch.setattr(mesh_mod, "on_loopback", lambda sock: False)
    g = Group(ca, 2, streams=2, clear=(0, 1))
    try:
        out = g.run(lambda r, c: (c.mesh.lanes(1 - r), c.mesh.clear_streams))
    finally:
        g.close()
    assert out == [(2, {1: 0}), (2, {0: 0})]


@pytest.mark.parametrize("host,want", [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
                                       ("::ffff:127.0.0.1", True), ("10.210.1.10", False), ("::ffff:10.0.0.1", False),
                                       ("fe80::1%eth0", False), ("0.0.0.0", False), ("", False), ("site0-n0", False)])
def test_what_counts_as_loopback(host, want):
    from trainer.transport.tls import _is_loopback

    assert _is_loopback(host) is want


def test_a_rings_chunks_are_dealt_round_the_streams_over_all_its_steps(ca, monkeypatch):
    # 2 KiB blocks in 1 KiB chunks over S = 4: two chunks a step. Dealt from stream 0 at every step,
    # streams 0 and 1 would carry both steps (the second waiting on windows the first still holds)
    # and 2 and 3 nothing; dealt in one sequence, each stream carries one chunk
    from trainer.transport import comm as comm_mod

    sent: dict[int, int] = {}
    real = comm_mod.send_all

    def counting(sock, data):
        sent[id(sock)] = sent.get(id(sock), 0) + len(data)
        return real(sock, data)

    monkeypatch.setattr(comm_mod, "send_all", counting)
    g = Group(ca, 2, streams=4, min_chunk_bytes=1024, chunk_bytes=1024)
    try:
        def site(r, c):
            t = torch.full((1024,), float(r + 1))
            c.allreduce_sum(t)
            return t, [sent.get(id(c.mesh.tx(1 - r, s)), 0) for s in range(4)]

        for t, per_stream in g.run(site):
            assert t.tolist() == [3.0] * 1024
            header = comm_mod.HEADER.size
            assert per_stream == [1024 + header] * 4, per_stream
    finally:
        g.close()
