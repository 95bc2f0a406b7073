"""The mutual-TLS relay in front of a plaintext service (torchft's Lighthouse)."""

import os
import socket
import ssl
import threading
import time
from datetime import timedelta

import pytest

from dilococtl import run_ca
from trainer.transport import Identity
from trainer.transport.relay import RelayClient, RelayServer


def ident(ids, site):
    i = ids[site]
    return Identity(site=site, cert=str(i.cert), key=str(i.key), ca=str(i.ca))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_ca.ensure(tmp_path_factory.mktemp("run"), "relay", ["lh", "s1", "s2"])


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return run_ca.ensure(tmp_path_factory.mktemp("other"), "other", ["lh", "s1"])


class Echo:
    """A plaintext service on loopback that echoes, and counts who reached it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = self.sock.getsockname()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c):
        with c:
            while data := c.recv(65536):
                c.sendall(data)

    def close(self):
        self.sock.close()


def test_a_site_reaches_the_service_through_both_relays(run):
    echo = Echo()
    with RelayServer(ident(run, "lh"), target=echo.addr, bind="127.0.0.1") as srv, \
            RelayClient(ident(run, "s1"), server=("127.0.0.1", srv.port), expect="lh") as cli:
        payload = os.urandom(4 << 20)  # more than the relays and the kernel buffer: both ways at once
        with socket.create_connection(("127.0.0.1", cli.port), timeout=10) as c:
            got = bytearray()
            sender = threading.Thread(target=c.sendall, args=(payload,))
            sender.start()
            while len(got) < len(payload):
                got += c.recv(65536)
            sender.join()
        assert bytes(got) == payload
        assert (srv.accepted, srv.refused, cli.accepted, echo.connections) == (1, 0, 1, 1)
    echo.close()


def test_every_leg_of_a_relayed_connection_sends_without_nagle(run, monkeypatch):
    # a relayed gRPC request or answer often leaves in two writes; with Nagle on a plaintext leg the
    # second waits for the first's delayed ACK: a two-write exchange through both relays took 46 ms
    # median on loopback, 0.9 ms with every leg tuned (bench/relay_rtt.py, BENCHMARKS.md)
    from trainer.transport import relay as relay_mod

    tuned = []
    real = relay_mod.tune_socket
    monkeypatch.setattr(relay_mod, "tune_socket", lambda s: (tuned.append(s), real(s))[1])
    echo = Echo()
    with RelayServer(ident(run, "lh"), target=echo.addr, bind="127.0.0.1") as srv, \
            RelayClient(ident(run, "s1"), server=("127.0.0.1", srv.port), expect="lh") as cli:
        with socket.create_connection(("127.0.0.1", cli.port), timeout=10) as c:
            c.sendall(b"ping")
            assert c.recv(4) == b"ping"
            # client: the local leg and the TLS leg; server: the TLS leg and the leg to the service
            assert len(tuned) == 4
            assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in tuned if s.fileno() >= 0)
    echo.close()


def raw_tls(port, ctx):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return s.recv(100)
    except (OSError, ssl.SSLError):
        return None


def test_a_process_without_a_certificate_of_the_run_never_reaches_the_service(run, other):
    echo = Echo()
    with RelayServer(ident(run, "lh"), target=echo.addr, bind="127.0.0.1") as srv:
        anon = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        anon.check_hostname, anon.verify_mode = False, ssl.CERT_NONE
        foreign = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        foreign.check_hostname, foreign.verify_mode = False, ssl.CERT_NONE
        foreign.load_cert_chain(str(other["s1"].cert), str(other["s1"].key))
        assert raw_tls(srv.port, anon) in (None, b"")
        assert raw_tls(srv.port, foreign) in (None, b"")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as plain:  # no TLS at all
            plain.sendall(b"GET / HTTP/1.0\r\n\r\n")
            plain.settimeout(5)
            try:
                plain.recv(100)  # a TLS alert or nothing comes back ...
            except OSError:
                pass
        time.sleep(0.3)
        assert echo.connections == 0  # ... nothing reached the service
        assert srv.refused == 3 and srv.accepted == 0
    echo.close()


def test_the_server_can_admit_named_sites_only(run):
    echo = Echo()
    with RelayServer(ident(run, "lh"), target=echo.addr, bind="127.0.0.1", allowed={"s1"}) as srv, \
            RelayClient(ident(run, "s2"), server=("127.0.0.1", srv.port), expect="lh") as cli:
        with socket.create_connection(("127.0.0.1", cli.port), timeout=5) as c:
            c.sendall(b"x")
            c.settimeout(5)
            try:
                assert c.recv(10) == b""
            except OSError:
                pass
        time.sleep(0.3)
        assert echo.connections == 0 and srv.refused == 1
    echo.close()


def test_a_client_relay_refuses_a_server_of_another_run(run, other):
    echo = Echo()
    with RelayServer(ident(other, "lh"), target=echo.addr, bind="127.0.0.1") as srv, \
            RelayClient(ident(run, "s1"), server=("127.0.0.1", srv.port), expect="lh") as cli:
        with socket.create_connection(("127.0.0.1", cli.port), timeout=5) as c:
            c.sendall(b"secret quorum request")
            c.settimeout(5)
            try:
                assert c.recv(10) == b""
            except OSError:
                pass
        time.sleep(0.3)
        assert cli.refused == 1 and echo.connections == 0
    echo.close()


def test_torchfts_lighthouse_answers_through_the_relays(run):
    from torchft.coordination import LighthouseClient, LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        port = int(lh.address().rsplit(":", 1)[1])
        with RelayServer(ident(run, "lh"), target=("127.0.0.1", port), bind="127.0.0.1") as srv, \
                RelayClient(ident(run, "s1"), server=("127.0.0.1", srv.port), expect="lh") as cli:
            client = LighthouseClient(f"http://127.0.0.1:{cli.port}", connect_timeout=timedelta(seconds=5))
            client.heartbeat("s1")
            assert srv.accepted >= 1 and cli.accepted >= 1
    finally:
        lh.shutdown()
